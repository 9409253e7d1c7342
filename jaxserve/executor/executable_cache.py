"""ExecutableCache: every compiled executable of one model's steps, in one place.

Keyed by kind and shape ("forward" + Bucket, "sample" + (rows, penalties, bias), "multi_step" +
Bucket, "prompt_logprobs" + rows; the draft model's "mirror" and "propose"). The runner and the
draft model ask it for the executable of a step; the warm-up (jaxserve.executor.warmup) fills it.
A shape the warm-up has promised but not yet compiled has a future here: asking for it waits,
and tells the warm-up (through `on_wait`) to take that shape next on every thread, so a step
never compiles on the stepping thread. Where executables are saved across restarts
(`executables.ExecutableStore`) is kept here too: `load_or_compile` loads from it, else compiles
and queues the executable for saving.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from typing import Callable, ContextManager, Hashable, Iterable

from jaxserve.executor import executables

Key = tuple[str, Hashable]  # (kind, shape key)


def store_key(kind: str, key: Hashable) -> tuple:
    """The saved store's key of (kind, shape key): ("forward", bucket), ("sample", rows, penalties,
    bias), ("prompt_logprobs", rows), ... (a tuple key is spread after the kind). The warm-up loads
    by it; `plan --compile --save_executables` saves by it."""
    return (kind, *key) if isinstance(key, tuple) else (kind, key)


class ExecutableCache:
    """Compiled executables by (kind, shape key), the shapes promised by a warm-up, the store."""

    def __init__(self, store: executables.ExecutableStore | None = None) -> None:
        self.store = store
        self._compiled: dict[Key, object] = {}
        self._promised: dict[Key, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        # While a step waits for a promised shape: the warm-up's way to take it next (WarmupPlan.urgent).
        self.on_wait: Callable[[str, Hashable], ContextManager] = lambda kind, key: contextlib.nullcontext()
        self._unsaved = threading.local()  # .items: [(store key, executable)] compiled on this thread
        self.waiting = 0  # steps waiting for a promised shape now
        self.num_waits = 0  # steps that ever waited for one

    # ---- what the steps ask -----------------------------------------------------------------
    def get(self, kind: str, key: Hashable):
        """The executable of (kind, key): compiled, or waited for while a warm-up compiles it
        (raising what failed it); None when nothing will compile it (the jitted function then does)."""
        compiled = self._compiled.get((kind, key))
        if compiled is not None:
            return compiled
        future = self._promised.get((kind, key))
        if future is None:
            return None
        if not future.done():
            with self._lock:
                self.waiting += 1
                self.num_waits += 1
            try:
                with self.on_wait(kind, key):
                    future.result()
            finally:
                with self._lock:
                    self.waiting -= 1
        future.result()  # what failed it
        return self._compiled.get((kind, key))

    def on_first_use(self, kind: str, key: Hashable, lower: Callable[[Hashable], object]):
        """The executable of (kind, key) as `get` gives it, else made now on the calling thread
        (a step of an engine without a warm-up: `jaxserve generate`): loaded from the store, or
        `lower(key)` compiled and saved there, so that the next process skips tracing, lowering
        and compiling it; compiled afresh to be saved (executables.persistent_cache_off)."""
        compiled = self.get(kind, key)
        if compiled is None:
            with self.compiling_to_save():
                compiled = self.load_or_compile(kind, key, lambda: lower(key))
            if self.store is not None:
                self.save_queued()
        return compiled

    def compiling_to_save(self) -> ContextManager:
        """While shapes compile to be saved in the store (one not only loaded from): jax's persistent
        compilation cache off, so that each compiles afresh (executables.persistent_cache_off)."""
        if self.store is not None and self.store.mode != "load":
            return executables.persistent_cache_off()
        return contextlib.nullcontext()

    def ready(self, kind: str, key: Hashable) -> bool:
        """Whether (kind, key) is compiled now (a step asking for it would not wait)."""
        return (kind, key) in self._compiled

    def will_compile(self, kind: str, key: Hashable) -> bool:
        """Whether (kind, key) is compiled or promised by a warm-up."""
        return (kind, key) in self._compiled or (kind, key) in self._promised

    def keys(self, kind: str) -> list:
        """The shape keys of `kind` compiled so far."""
        return [key for k, key in list(self._compiled) if k == kind]

    # ---- what the warm-up does --------------------------------------------------------------
    def promise(self, keys: Iterable[Key]) -> None:
        """The warm-up will compile these: steps that need one wait for it from now on."""
        with self._lock:
            for key in keys:
                self._promised.setdefault(key, concurrent.futures.Future())

    def put(self, kind: str, key: Hashable, compiled) -> None:
        """Keeps an executable and wakes the steps waiting for it."""
        self._compiled[kind, key] = compiled
        future = self._promised.get((kind, key))
        if future is not None and not future.done():
            future.set_result(None)

    def fail(self, kind: str, key: Hashable, error: BaseException) -> None:
        """A promised shape will not compile: whatever waits for it raises `error`."""
        future = self._promised.get((kind, key))
        if future is not None and not future.done():
            future.set_exception(error)

    def fail_unfinished(self, error: BaseException) -> None:
        """Every promised shape not compiled raises `error` in whatever waits for it."""
        for future in list(self._promised.values()):
            if not future.done():
                future.set_exception(error)

    def promised(self) -> list[Key]:
        return list(self._promised)

    def load_or_compile(self, kind: str, key: Hashable, lower: Callable[[], object]):
        """The executable of (kind, key) from the store, else `lower()` compiled (queued for
        saving on this thread: `save_queued`); kept here either way."""
        saved_as = store_key(kind, key)
        compiled = self.store.load(saved_as) if self.store is not None else None
        if compiled is None:
            compiled, fresh = executables.compile_fresh(lower())
            if self.store is not None and fresh:
                self._unsaved.items = [*getattr(self._unsaved, "items", []), (saved_as, compiled)]
        self.put(kind, key, compiled)
        return compiled

    def save_queued(self) -> None:
        """Saves what this thread compiled (after it is served here: a step waiting for it need
        not wait for the file too)."""
        for store_key, compiled in getattr(self._unsaved, "items", []):
            self.store.save(store_key, compiled)
        self._unsaved.items = []
