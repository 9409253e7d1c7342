"""The LoRA adapters an engine serves, by name, and where each one is (host side, no jax).

Three places, as in vLLM: the adapters the engine knows (`--lora_modules`, and
`load_lora_adapter` at run time: a name and a PEFT folder); the adapters loaded in host memory
(at most `--max_cpu_loras`, least recently used evicted and reloaded from their folder when asked
again); and the adapters in the device slab's slots (`--max_loras`; slot 0 is the zero adapter of
base-model rows). The scheduler keeps at most max_loras distinct adapters among the running
requests, so the adapters of every step fit the slots together; an adapter leaves its slot only
for another, and only when no running request uses it.

Each load of a name gets a fresh `generation`: the prefix cache keys a request's pages with it
(`prefix_salt`), so pages computed under an adapter never serve the base model, another adapter,
or a later adapter loaded under the same name.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Callable, Sequence

from jaxserve.setting_checks import LoRAModule


class LoRAPlacementError(RuntimeError):
    """An adapter that could not be put in a slot: evicted from host memory, it could not be read
    again. `name`: the adapter; its requests cannot run."""

    def __init__(self, name: str, reason: str):
        super().__init__(f"LoRA adapter '{name}' could not be read again: {reason}")
        self.name = name


class LoRANotFoundError(KeyError):
    """A name the engine serves no adapter under (the server answers 404, as vLLM)."""

    def __str__(self) -> str:
        return self.args[0]


@dataclasses.dataclass
class _Known:
    module: LoRAModule
    generation: int


class LoRARegistry:
    """The adapters one engine serves (see the module docstring). `load(path)` reads and checks
    an adapter folder (checkpoints.lora_adapter.load_adapter for the engine's model: raises its
    LoRAError); `write_slot(slot, adapter)` / `clear_slot(slot)` put it on the device."""

    def __init__(self, load: Callable[[str], object], write_slot: Callable[[int, object], None],
                 clear_slot: Callable[[int], None], max_loras: int, max_cpu_loras: int | None = None):
        self._load, self._write_slot, self._clear_slot = load, write_slot, clear_slot
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self._known: dict[str, _Known] = {}
        self._retired: dict[str, _Known] = {}  # removed, while admitted requests still use them
        self._host: collections.OrderedDict[str, object] = collections.OrderedDict()  # name -> adapter, LRU first
        self._slots: dict[str, int] = {}  # name -> its slot (1..max_loras)
        self._slot_use: collections.OrderedDict[str, None] = collections.OrderedDict()  # slotted names, LRU first
        self._generations = itertools.count(1)
        self.num_loads = 0  # adapters read from disk (a reload after a host eviction counts)

    # ---- what the engine knows ------------------------------------------------------------
    def add(self, module: LoRAModule, adapter=None) -> None:
        """Serves `module` (`adapter`: read already; else read and checked now: the loader's
        LoRAError propagates, and nothing changes); ValueError when the name is served already."""
        if module.name in self._known:
            raise ValueError(f"The lora adapter '{module.name}' has already been loaded.")
        if module.name in self._retired:
            raise ValueError(f"The lora adapter '{module.name}' is being unloaded: requests still use it; load it "
                             f"again once they have ended")
        if adapter is None:
            adapter = self._load(module.path)
        self.num_loads += 1
        self._known[module.name] = _Known(module, next(self._generations))
        self._keep_in_host(module.name, adapter)

    def remove(self, name: str) -> None:
        """Stops serving the adapter to new requests; the requests already admitted with it keep
        it until `release_unused` finds none left, which then clears its slot and forgets it.
        LoRANotFoundError when the name is unknown."""
        if name not in self._known:
            raise LoRANotFoundError(f"The lora adapter '{name}' cannot be found.")
        self._retired[name] = self._known.pop(name)

    def __contains__(self, name: str) -> bool:
        return name in self._known

    def modules(self) -> list[LoRAModule]:
        """The adapters served, in the order they were added (a snapshot: the server's threads read
        it while the engine's thread adds and removes)."""
        return [known.module for known in list(self._known.values())]

    def prefix_salt(self, name: str | None) -> bytes:
        """What the prefix cache keys a request's pages with: b"" for the base model, else the
        adapter's name and load generation."""
        if name is None:
            return b""
        return f"lora:{self._known[name].generation}:{name}".encode()

    # ---- the device slots -----------------------------------------------------------------
    @property
    def slotted(self) -> dict[str, int]:
        return dict(self._slots)

    def place(self, names: Sequence[str], in_use: set[str]) -> dict[str, int]:
        """Puts every adapter of `names` (a step's, at most max_loras distinct) in a slot and
        returns each one's slot. A free slot is taken first, else the least recently used slot of
        an adapter not in `names` (slots are given per step: a request that sits a step out gets
        one again when it runs); an adapter evicted from host memory is read again
        (LoRAPlacementError naming it when that fails). Removed adapters that no request uses any
        more (`in_use`: the adapters of every unfinished request) are forgotten first."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.max_loras:
            raise ValueError(f"{len(wanted)} adapters in one step, more than --max_loras={self.max_loras}")
        self.release_unused(in_use | set(wanted))
        for name in wanted:
            if name not in self._slots:
                slot = self._free_slot(keep=set(wanted))
                self._write_slot(slot, self._host_adapter(name))
                self._slots[name] = slot
            self._slot_use[name] = None
            self._slot_use.move_to_end(name)
        return {name: self._slots[name] for name in wanted}

    def release_unused(self, in_use: set[str]) -> None:
        """Forgets the removed adapters no request uses any more (`in_use`: the adapters of the
        unfinished requests), clearing their slots."""
        for name in [n for n in self._retired if n not in in_use]:
            del self._retired[name]
            self._host.pop(name, None)
            if name in self._slots:
                self._clear_slot(self._slots.pop(name))
                self._slot_use.pop(name, None)

    def _free_slot(self, keep: set[str]) -> int:
        taken = set(self._slots.values())
        free = next((slot for slot in range(1, self.max_loras + 1) if slot not in taken), None)
        if free is not None:
            return free
        victim = next(name for name in self._slot_use if name not in keep)  # (at most max_loras are kept)
        self._slot_use.pop(victim)
        return self._slots.pop(victim)

    def _host_adapter(self, name: str):
        adapter = self._host.get(name)
        if adapter is None:
            known = self._known.get(name) or self._retired[name]
            try:
                adapter = self._load(known.module.path)
            except Exception as e:  # its folder changed or went away since it was loaded
                raise LoRAPlacementError(name, f"{type(e).__name__}: {e}") from e
            self.num_loads += 1
            self._keep_in_host(name, adapter)
        self._host.move_to_end(name)
        return adapter

    def _keep_in_host(self, name: str, adapter) -> None:
        self._host[name] = adapter
        self._host.move_to_end(name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
