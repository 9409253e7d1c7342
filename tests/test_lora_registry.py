"""The LoRA bookkeeping on the host (no jax, no engine): the registry's slots and host cache, and
the scheduler's bound on distinct adapters per step without starving any of them."""
from __future__ import annotations

import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.core.lora_registry import LoRANotFoundError, LoRARegistry
from jaxserve.core.page_allocator import PageAllocator
from jaxserve.core.request import Request, SamplingParams
from jaxserve.core.scheduler import LORA_PASS_LIMIT, Scheduler
from jaxserve.setting_checks import LoRAModule


class Device:
    """Records what the registry writes into and clears from the slab's slots."""

    def __init__(self):
        self.slots, self.reads, self.missing = {}, [], set()

    def load(self, path):
        if path in self.missing:
            raise OSError(f"{path}: no such folder")
        self.reads.append(path)
        return f"adapter@{path}"

    def write(self, slot, adapter):
        self.slots[slot] = adapter

    def clear(self, slot):
        self.slots.pop(slot)


def registry(max_loras=2, max_cpu_loras=None, names="abc"):
    device = Device()
    loras = LoRARegistry(device.load, device.write, device.clear, max_loras, max_cpu_loras)
    for name in names:
        loras.add(LoRAModule(name, f"/{name}"))
    return loras, device


def test_slots_are_reused_least_recently_used_first_never_within_the_step():
    loras, device = registry()
    assert loras.place(["a", "b"], set()) == {"a": 1, "b": 2}
    assert loras.place(["a"], {"a"}) == {"a": 1}  # b idle now, a used more recently
    assert loras.place(["c"], {"a"}) == {"c": 2}  # b's slot: the least recently used one
    assert loras.place(["b", "c"], set()) == {"b": 1, "c": 2}  # a's slot, never c's: c runs in this step
    assert device.slots == {1: "adapter@/b", 2: "adapter@/c"}
    with pytest.raises(ValueError, match="max_loras"):
        loras.place(["a", "b", "c"], set())


def test_the_host_cache_keeps_max_cpu_loras_and_rereads_the_others():
    loras, device = registry(max_loras=1, max_cpu_loras=2)  # a was evicted by c when c was added
    assert device.reads == ["/a", "/b", "/c"]
    loras.place(["b"], set())
    loras.place(["a"], set())
    assert device.reads == ["/a", "/b", "/c", "/a"] and loras.num_loads == 4


def test_names_and_salts():
    loras, device = registry(names="a")
    with pytest.raises(ValueError, match="already been loaded"):
        loras.add(LoRAModule("a", "/other"))
    salt = loras.prefix_salt("a")
    assert loras.prefix_salt(None) == b"" and salt
    loras.place(["a"], set())
    loras.remove("a")
    assert "a" not in loras and device.slots  # its slot is kept while a request may still use it
    assert loras.place(["a"], {"a"}) == {"a": 1}  # a request admitted before the unload still runs with it
    with pytest.raises(ValueError, match="being unloaded"):
        loras.add(LoRAModule("a", "/new"))
    loras.release_unused({"a"})
    assert device.slots
    loras.release_unused(set())
    assert not device.slots
    loras.add(LoRAModule("a", "/new"))
    assert loras.prefix_salt("a") != salt  # pages of the old adapter never serve the new one
    with pytest.raises(LoRANotFoundError, match="cannot be found"):
        loras.remove("nope")


def test_an_adapter_that_cannot_be_read_again_is_named():
    from jaxserve.core.lora_registry import LoRAPlacementError
    loras, device = registry(max_loras=1, max_cpu_loras=1, names="ab")  # a evicted from host memory by b
    device.missing.add("/a")
    with pytest.raises(LoRAPlacementError, match="'a' could not be read again") as caught:
        loras.place(["a"], set())
    assert caught.value.name == "a" and not device.slots


def make_scheduler(max_loras=2):
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, page_size=4, enable_lora=True, max_loras=max_loras)
    return Scheduler(PageAllocator(256, 4, True), cfg, 256)


def run(scheduler, steps):
    """Steps the scheduler's plans (a fake model: token 7 each time); returns each step's adapters."""
    seen = []
    for _ in range(steps):
        plan = scheduler.schedule()
        if plan.is_empty:
            break
        seen.append({r.params.lora_name for r, _ in plan.scheduled} - {None})
        scheduler.update(plan, [7] * plan.num_seqs)
        for request, _ in plan.scheduled:
            scheduler.check_length(request)
    return seen


def test_a_step_holds_at_most_max_loras_adapters_and_every_request_finishes():
    seed = 11
    rng = np.random.default_rng(seed)
    scheduler = make_scheduler(max_loras=2)
    requests = [Request(f"r{i}", rng.integers(1, 100, int(rng.integers(2, 9))).tolist(),
                        SamplingParams(max_tokens=int(rng.integers(1, 6)),
                                       lora_name=[None, "a", "b", "c", "d"][int(rng.integers(0, 5))]))
                for i in range(40)]
    for request in requests:
        scheduler.add_request(request)
    seen = run(scheduler, 2000)
    assert max(map(len, seen)) <= 2, f"seed {seed}"
    assert not scheduler.has_unfinished() and all(r.status.is_finished for r in requests), f"seed {seed}"


def test_an_adapter_without_a_slot_is_passed_over_a_bounded_number_of_times():
    """A stream of requests for two running adapters would keep a third waiting forever if the
    scheduler always admitted past it: after LORA_PASS_LIMIT admissions it admits none until the
    running ones drain, and the third adapter's request runs."""
    scheduler = make_scheduler(max_loras=2)
    for i in range(2):
        scheduler.add_request(Request(f"hold{i}", [1, 2, 3], SamplingParams(max_tokens=3, lora_name="ab"[i])))
    run(scheduler, 1)
    starved = Request("c", [4, 5, 6], SamplingParams(max_tokens=2, lora_name="c"))
    scheduler.add_request(starved)
    admitted_past = 0
    for step in range(400):
        for name in "ab":  # more work for the running adapters all the time
            scheduler.add_request(Request(f"{name}{step}", [1, 2], SamplingParams(max_tokens=3, lora_name=name)))
        run(scheduler, 1)
        if starved.status.is_finished or starved in scheduler.running:
            break
        admitted_past = scheduler._num_passed_over
    assert starved in scheduler.running or starved.status.is_finished
    assert admitted_past <= LORA_PASS_LIMIT
