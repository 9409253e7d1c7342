"""The warm-up: every shape a ModelRunner steps with, compiled ahead of time on all cores.

XLA compiles with the GIL released, so a thread per core compiles that many shapes at once; the
executables go into the runner's `ExecutableCache` and serve every step, so serving never
compiles. Every shape is promised to the cache at the start: a step that needs one not compiled
yet waits for it, and the warm-up takes that shape next (`urgent`), on every thread. Three
phases, in order:
  1. what a first request needs: the prefill-only and decode-only steps and their samplers
     with penalties, which serve every request (`WarmupState.first_ready` is set after them);
  2. the rest of the steps (decoding rows beside prefill chunks), the samplers without
     penalties (a little faster for the requests without), the multi-step shapes and a
     vision-language model's image encoder, one shape per image size (an image request that
     comes first waits for its shape, which the warm-up then takes next);
  3. the prompt-logprob shapes (in phase 1 instead with `warmup_prompt_logprobs`).
The pooling runner (--runner=pooling) has only its pooled steps, all in the first phase.
In the background (`jaxserve serve`) the phases run in a thread after the first, at the normal
scheduling priority, and a shape starts compiling only while the engine serves nothing (then on
half the threads: `ServingGate.idle_threads`) or one of its steps waits for a shape
(`ServingGate`): a compile beside a step takes the cores and the GIL the step needs. Meanwhile
the runner serves a step whose own shape is not compiled through compiled ones where it can
(`ModelRunner.execute`: a larger bucket, or a mixed step as its decode and prefill halves), so a
request rarely waits. A shutdown (`WarmupPlan.stop`) skips the shapes not started.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import Callable, Hashable

from jaxserve.core.progress import Progress

log = logging.getLogger(__name__)


@dataclasses.dataclass
class WarmupState:
    """How far the warm-up is (read from any thread): `compiled` of `total` shapes; `first_ready`
    is set once the first `first_total` (what a first request needs) are compiled, `finished` once
    all are; both also when the warm-up failed (`error`)."""
    total: int
    first_total: int
    compiled: int = 0
    error: str | None = None
    first_ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)  # every shape, or the failure
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def advance(self) -> None:
        with self._lock:
            self.compiled += 1

    def to_dict(self) -> dict:
        """/health's view: {"ready", "compiled", "total", "error"}."""
        return {"ready": self.first_ready.is_set() and self.error is None, "compiled": self.compiled,
                "total": self.total, "error": self.error}


class ServingGate:
    """When a background warm-up may start its next shape (`turn()`): while `is_serving()` is
    false (no request in the engine), or while a step waits for a shape (`step_waits`): that step
    needs the warm-up to go on, so it does, on every thread. Shapes already compiling run on;
    only the next ones wait. With `idle_threads` set, an idle engine has at most that many shapes
    in hand at once: a request that comes then finds fewer compiles running beside it. Once
    `stop()` is called no shape waits any more (WarmupPlan then skips them)."""

    POLL_S = 0.02  # how often a waiting thread looks again at is_serving()

    def __init__(self, is_serving: Callable[[], bool]) -> None:
        self.is_serving = is_serving
        self.idle_threads: int | None = None  # None: every thread while the engine is idle
        self._step_waiting = threading.Event()
        self.stopped = threading.Event()
        self._lock = threading.Lock()
        self._in_hand = 0

    def _try_start(self) -> bool:
        with self._lock:
            may = (self.stopped.is_set() or self._step_waiting.is_set() or
                   (not self.is_serving() and (self.idle_threads is None or self._in_hand < self.idle_threads)))
            self._in_hand += may
            return may

    @contextlib.contextmanager
    def turn(self):
        """Waits for the warm-up's turn, then holds it over the block (one shape)."""
        while not self._try_start():
            self._step_waiting.wait(self.POLL_S)
        try:
            yield
        finally:
            with self._lock:
                self._in_hand -= 1

    def stop(self) -> None:
        self.stopped.set()

    @contextlib.contextmanager
    def step_waits(self):
        self._step_waiting.set()
        try:
            yield
        finally:
            self._step_waiting.clear()


COMPILE_THREAD_NAME = "warm-up-compile"  # the Python threads that lower and compile the shapes


class WarmupStopped(Exception):
    """The engine shut down (WarmupPlan.stop), or the interpreter is exiting (concurrent.futures
    takes no new work): the warm-up stops, nothing failed."""


@dataclasses.dataclass(frozen=True)
class Job:
    """One shape to compile: its cache key and how to lower it (runner.lower_*)."""
    kind: str
    key: Hashable
    lower: Callable


class WarmupPlan:
    """The shapes of one runner in their phases, in one queue, and how they are compiled."""

    def __init__(self, runner, is_serving: Callable[[], bool] = lambda: False) -> None:
        self.runner = runner
        self.cache = runner.executables
        # Each shape waits for its turn (is_serving: whether the engine holds requests; a warm-up in
        # the foreground runs before any, so only the background one ever waits).
        self.gate = ServingGate(is_serving)
        self.phases = self._pooling_phases(runner) if runner.pooler is not None else self._phases(runner)
        self.total = sum(len(phase) for phase in self.phases)
        self.state = WarmupState(total=self.total, first_total=len(self.phases[0]))
        self._queue = collections.deque(job for phase in self.phases for job in phase)  # the next shapes, in order
        self._queue_lock = threading.Lock()
        self.cache.promise((job.kind, job.key) for job in self._queue)
        self.cache.on_wait = self.urgent

    @staticmethod
    def _phases(runner) -> list[list[Job]]:
        """A generating runner's shapes in the three phases of the module docstring."""
        first_steps, first_samplers = runner.first_request_shapes()
        rest_steps = [b for b in runner.all_buckets() if b not in first_steps]
        rest_samplers = [s for s in runner.sampler_shapes() if s not in first_samplers]
        prompt = [Job("prompt_logprobs", n, runner.lower_prompt_logprobs) for n in runner.prompt_logprob_buckets]
        return [
            [Job("forward", b, runner.lower_forward) for b in first_steps]
            + [Job("sample", s, runner.lower_sampler) for s in first_samplers]
            + (prompt if runner.warmup_prompt_logprobs else []),
            [Job("forward", b, runner.lower_forward) for b in rest_steps]
            + [Job("sample", s, runner.lower_sampler) for s in rest_samplers]
            + [Job("multi_step", b, runner.lower_multi_step) for b in runner.multi_step_buckets()]
            + [Job("encoder", size, runner.lower_encoder) for size in runner.encoder_shapes()],
            [] if runner.warmup_prompt_logprobs else prompt,
        ]

    @staticmethod
    def _pooling_phases(runner) -> list[list[Job]]:
        """The pooling runner's shapes: its pooled steps (prefill chunks only), every one before the
        server is ready (no sampler, decode, multi-step or prompt-logprob shapes)."""
        return [[Job("pool", runner.pool_key(b), runner.lower_pool) for b in runner.all_buckets()], [], []]

    # ---- one shape each -------------------------------------------------------------------
    @contextlib.contextmanager
    def urgent(self, kind: str, key: Hashable):
        """A step waits for (kind, key): it is the next shape taken (after the first phase's, which
        its tasks take), and every thread goes on while the step waits."""
        with self._queue_lock:
            job = next((job for job in self._queue if (job.kind, job.key) == (kind, key)), None)
            if job is not None:
                self._queue.remove(job)
                first_left = sum(1 for queued in self._queue if queued in self.phases[0])
                self._queue.insert(0 if job in self.phases[0] else first_left, job)
        with self.gate.step_waits():
            yield

    def _compile_next(self, progress) -> None:
        """Compiles (or loads) the shape at the front of the queue, at this thread's turn."""
        with self.gate.turn():
            with self._queue_lock:
                job = self._queue.popleft()
            try:
                if self.gate.stopped.is_set():
                    raise WarmupStopped(f"the engine shut down before {job.kind} {job.key} compiled")
                self.cache.load_or_compile(job.kind, job.key, lambda: job.lower(job.key))
            except BaseException as e:
                self.cache.fail(job.kind, job.key, e)
                raise
        self.state.advance()
        progress.advance()
        with self.gate.turn():  # serialising an executable holds the GIL a step needs
            self.cache.save_queued()

    # ---- all of them ----------------------------------------------------------------------
    def _compile_all(self, threads: int, background: bool = False) -> None:
        start = time.perf_counter()
        store = self.cache.store
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=COMPILE_THREAD_NAME) as pool, \
                self.cache.compiling_to_save(), Progress(self.total, "warm-up", "shapes compiled", log) as progress:
            for number, phase in enumerate(self.phases):
                try:  # a task per shape; each takes the queue's front when it runs (urgent ones first)
                    tasks = [pool.submit(self._compile_next, progress) for _ in phase]
                except RuntimeError:  # only the interpreter's exit shuts the pool before the phases end
                    raise WarmupStopped("the process is exiting") from None
                for task in tasks:
                    task.result()
                if number == 0:
                    if background:  # the rest compiles beside serving, half the threads while idle
                        self.gate.idle_threads = max(1, threads // 2)
                    self.state.first_ready.set()
        log.info("warm-up compiled %d shapes (%d steps, %d samplers, %d multi-step, %d prompt-logprob, %d image "
                 "encoder) in %.1fs%s",
                 self.total, len(self.cache.keys("forward")) + len(self.cache.keys("pool")), len(self.cache.keys("sample")),
                 len(self.cache.keys("multi_step")), len(self.cache.keys("prompt_logprobs")),
                 len(self.cache.keys("encoder")),
                 time.perf_counter() - start,
                 "" if store is None else f" ({store.loaded} loaded and {store.saved} saved in {store.directory})")

    def _resolve_pending(self, error: Exception) -> None:
        """The shapes that will not compile raise `error` in whatever waits for them."""
        self.cache.fail_unfinished(error)
        self.state.first_ready.set()

    def _compile_in_background(self, threads: int) -> None:
        try:
            self._compile_all(threads, background=True)
        except WarmupStopped as e:  # the server stopped before the warm-up ended: nothing failed
            log.info("warm-up stopped: %s (%d of %d shapes compiled)", e, self.state.compiled, self.total)
            self._resolve_pending(RuntimeError(f"warm-up stopped: {e}"))
        except BaseException as e:  # the steps that wait for a failed shape raise it
            self.state.error = f"{type(e).__name__}: {e}"
            log.exception("warm-up failed")
            self._resolve_pending(RuntimeError(f"warm-up failed: {self.state.error}"))
        self.state.finished.set()

    def stop(self) -> None:
        """Ends a background warm-up early (the engine shuts down): the shapes not started are
        skipped, those compiling finish; returns at once (`state.finished` is set once they have)."""
        self.gate.stop()

    def run(self, background: bool) -> int:
        """Compiles every shape (in a thread when `background`); returns the count."""
        threads = os.cpu_count() or 1
        log.info("warm-up: compiling %d shapes (%d prompt-logprob shapes among them) on %d threads%s (a filled "
                 "compilation cache makes this seconds)", self.total, sum(job.kind == "prompt_logprobs" for phase in self.phases for job in phase),
                 threads, ", serving once the first requests' shapes are ready" if background else "")
        if background:
            threading.Thread(target=self._compile_in_background, args=(threads,), name="warm-up", daemon=True).start()
        else:
            try:
                self._compile_all(threads)
            except BaseException as e:
                self._resolve_pending(RuntimeError(f"warm-up failed: {type(e).__name__}: {e}"))
                raise
            finally:
                self.state.finished.set()
        return self.total
