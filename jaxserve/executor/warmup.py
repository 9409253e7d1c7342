"""The warm-up: every shape a ModelRunner steps with, compiled ahead of time on all cores.

XLA compiles with the GIL released, so a thread per core compiles that many shapes at once; the
executables go into the runner's tables (`_compiled_forward`, `_compiled_sample`, ...) and serve
every step, so serving never compiles. Three phases, in order:
  1. what a first request needs: the prefill-only and decode-only steps and their samplers
     without penalties (`WarmupState.first_ready` is set after them);
  2. the rest of the steps (decoding rows beside prefill chunks), the samplers with penalties
     and the multi-step shapes;
  3. the prompt-logprob shapes (they take the forward's hidden rows, known once a prefill step
     compiled), only with `warmup_prompt_logprobs`, `--save_executables` (a saved folder is
     complete) or in a multi-host job (its processes compile together).
In the background (`jaxserve serve`) the phases run in a thread and the runner's steps wait on
each shape's future (`pending`) until it is compiled: nothing compiles on the stepping thread.
There a shape starts compiling only while the engine serves nothing or one of its steps waits
for a shape (`ServingGate`): a shape loaded or compiled beside a step takes the cores and the GIL
that the step needs (a restart's first request after /health took 2.5x a settled one while the
saved executables still loaded). A shape already compiling cannot be stopped, so on a cold start
the first requests may still run beside a compile. So after the first phase an idle engine lets
half the threads take a shape (`ServingGate.idle_threads`), and those threads and XLA's
compiler threads are in the idle scheduling class (`compile_threads`): a compile takes only the
CPU the steps leave. A shutdown (`WarmupPlan.stop`) skips the shapes not started.

Otherwise the prompt-logprob shapes are compiled on first use (`PromptLogprobShapesOnDemand`,
the scheduler's `PromptLogprobShapes`): the first step that would compute rows no compiled shape
holds starts that shape on a thread of its own (loaded from the executable store when saved
there, else compiled and saved), the request waits in the scheduler meanwhile and every other
request is stepped; a larger shape already compiled serves in the meantime.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp

from jaxserve.core.progress import Progress
from jaxserve.executor import compile_threads, executables, sampler

log = logging.getLogger(__name__)


@dataclasses.dataclass
class WarmupState:
    """How far the warm-up is (read from any thread): `compiled` of `total` shapes; `first_ready`
    is set once the first `first_total` (what a first request needs) are compiled, `finished` once
    all are; both also when the warm-up failed (`error`)."""
    total: int
    first_total: int
    on_demand_total: int = 0  # prompt-logprob shapes left to first use (not in `total`)
    compiled: int = 0
    on_demand_compiled: int = 0
    error: str | None = None
    first_ready: threading.Event = dataclasses.field(default_factory=threading.Event)
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)  # every shape, or the failure
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def advance(self) -> None:
        with self._lock:
            self.compiled += 1

    def advance_on_demand(self) -> None:
        with self._lock:
            self.on_demand_compiled += 1

    def to_dict(self) -> dict:
        """/health's view: {"ready", "compiled", "total", "error"}."""
        return {"ready": self.first_ready.is_set() and self.error is None, "compiled": self.compiled,
                "total": self.total, "error": self.error}


class ServingGate:
    """When a background warm-up may start its next shape (`turn()`): while `is_serving()` is
    false (no request in the engine), or while a step waits for a shape (`step_waits`): that step
    needs the warm-up to go on, so it does, on every thread, through the shapes queued before the
    one it waits for. Shapes already compiling run on; only the next ones wait. With
    `idle_threads` set, an idle engine has at most that many shapes in hand at once: a request
    that comes then finds fewer compiles running beside it. Once `stop()` is called no shape
    waits any more (WarmupPlan then skips them)."""

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


class WarmupPlan:
    """The shapes of one runner in their phases, a future per shape, and how to compile them."""

    def __init__(self, runner, is_serving: Callable[[], bool] = lambda: False) -> None:
        self.runner = runner
        self.store = runner._executable_store
        # Each shape waits for its turn (is_serving: whether the engine holds requests; a warm-up in
        # the foreground runs before any, so only the background one ever waits).
        self.gate = ServingGate(is_serving)
        self.hidden_info = []  # the forward's prefill rows (shape, dtype), for the prompt-logprob function
        buckets = self.buckets = runner.all_buckets()
        rows_of = {b: len(runner.empty_batch(b)["logits_indices"]) for b in buckets}
        self.samplers = [(n, penalties, sampler.ALWAYS_BIAS) for n in sorted(set(rows_of.values()))
                         for penalties in (False, True)]
        # What a first request needs: its prefill chunks alone, then its decoding alone.
        first = [b for b in buckets if not b.num_verify and not (b.num_decode and b.num_prefill_tokens)]
        first_samplers = list(dict.fromkeys((rows_of[b], False, sampler.ALWAYS_BIAS) for b in first))
        self.phases = [
            [("forward", b, self._compile_bucket, (b,)) for b in first]
            + [("sample", v, self._compile_sampler, v) for v in first_samplers],
            [("forward", b, self._compile_bucket, (b,)) for b in buckets if b not in first]
            + [("sample", v, self._compile_sampler, v) for v in self.samplers if v not in first_samplers]
            + [("multi_step", m, self._compile_multi_step, (m,)) for m in runner.multi_step_buckets()],
            [("prompt_logprobs", n, self._compile_prompt_logprobs, (n,)) for n in runner.prompt_logprob_buckets]
            if self.prompt_logprobs_at_start() else [],
        ]
        self.total = sum(len(phase) for phase in self.phases)
        on_demand = () if self.phases[2] else runner.prompt_logprob_buckets
        self.state = WarmupState(total=self.total, first_total=len(self.phases[0]), on_demand_total=len(on_demand))
        self.pending = {(kind, key): concurrent.futures.Future() for phase in self.phases for kind, key, _, _ in phase}
        self.on_demand = PromptLogprobShapesOnDemand(self, on_demand) if on_demand else None
        self.compiler_threads_yielding: list[int] = []  # thread ids put in the idle class (background only)
        self._threads_yield = False  # set after the first phase of a background warm-up
        self._unsaved = threading.local()  # .items: [(store key, executable)] compiled on this thread, not saved yet

    def prompt_logprobs_at_start(self) -> bool:
        """Whether the prompt-logprob shapes compile with the others (else on first use)."""
        return (self.runner.warmup_prompt_logprobs or (self.store is not None and self.store.mode == "save")
                or jax.process_count() > 1)

    # ---- one shape each -------------------------------------------------------------------
    def _load_or_compile(self, key, lower):
        """The executable of `key`: from the store, else `lower()` compiled (and queued for
        saving on this thread: `_save_queued`)."""
        compiled = self.store.load(key) if self.store is not None else None
        if compiled is None:
            compiled, fresh = executables.compile_fresh(lower())
            if self.store is not None and fresh:
                self._unsaved.items = [*getattr(self._unsaved, "items", []), (key, compiled)]
        return compiled

    def _save_queued(self) -> None:
        """Saves what this thread compiled (after its shape is in the runner's tables: a step
        waiting for it need not wait for the file too)."""
        for key, compiled in getattr(self._unsaved, "items", []):
            self.store.save(key, compiled)
        self._unsaved.items = []

    def _compile_bucket(self, bucket):
        r = self.runner
        forward = r._functions.forward_for(bucket)
        compiled = self._load_or_compile(("forward", bucket), lambda: forward.lower(
            r._step_params, r.kv_cache, r.empty_batch(bucket)))
        if bucket.num_prefill_tokens:
            self.hidden_info.append(compiled.out_info[2])
        r._compiled_forward[bucket] = compiled

    def _compile_prompt_logprobs(self, num_rows):
        r = self.runner
        hidden = jax.ShapeDtypeStruct(self.hidden_info[0].shape, self.hidden_info[0].dtype)
        rows = jax.ShapeDtypeStruct((num_rows,), jnp.int32)
        r._compiled_prompt_logprobs[num_rows] = self._load_or_compile(
            ("prompt_logprobs", num_rows), lambda: r._functions.prompt_logprobs.lower(r._head, hidden, rows, rows))

    def _compile_sampler(self, num_rows, penalties, bias):
        r = self.runner
        logits = jax.ShapeDtypeStruct((num_rows, r.config.vocab_size), jnp.float32)
        sampling = sampler.build_sampling_inputs([None] * num_rows, num_rows, r.max_model_len, penalties,
                                                 bias, r.eos_token_ids, vocab_size=r.config.vocab_size)
        r._compiled_sample[num_rows, penalties, bias] = self._load_or_compile(
            ("sample", num_rows, penalties, bias), lambda: r._functions.sample.lower(logits, sampling))

    def _compile_multi_step(self, bucket):
        r = self.runner
        arrays, sampling, num_steps = r._multi_step_inputs(bucket, [], r.num_scheduler_steps)
        r._compiled_multi_step[bucket] = self._load_or_compile(
            ("multi_step", bucket), lambda: r._functions.multi_step.lower(
                r._step_params, r.kv_cache, arrays, sampling, num_steps))

    # ---- all of them ----------------------------------------------------------------------
    def _compile_one(self, kind, key, fn, args, progress) -> None:
        future = self.pending[kind, key]
        with self.gate.turn():
            if self._threads_yield and threading.get_native_id() not in self.compiler_threads_yielding:
                # its Python part (tracing, lowering) too
                self.compiler_threads_yielding += compile_threads.yield_to_others([threading.get_native_id()])
            try:
                if self.gate.stopped.is_set():
                    raise WarmupStopped(f"the engine shut down before {kind} {key} compiled")
                fn(*args)
            except BaseException as e:
                future.set_exception(e)
                raise
        future.set_result(None)
        self.state.advance()
        progress.advance()
        with self.gate.turn():  # serialising an executable holds the GIL a step needs
            self._save_queued()

    def _fresh(self):
        """Shapes to be saved compile afresh (see executables.persistent_cache_off); a loaded store skips both."""
        return (executables.persistent_cache_off() if self.store is not None and self.store.mode != "load"
                else contextlib.nullcontext())

    def compile_on_demand(self, num_rows: int, future: concurrent.futures.Future) -> None:
        """Compiles (or loads) the prompt-logprob shape of `num_rows` rows once the forward's
        prefill rows are known (the first phase), then resolves `future` (with the error, if any)."""
        start = time.perf_counter()
        try:
            self.state.first_ready.wait()
            with self._fresh():
                self._compile_prompt_logprobs(num_rows)
            self._save_queued()
        except BaseException as e:
            log.exception("the prompt-logprob shape of %d rows failed to compile", num_rows)
            future.set_exception(e)
            return
        self.state.advance_on_demand()
        log.info("compiled the prompt-logprob shape of %d rows on first use in %.1fs (%d of %d prompt-logprob "
                 "shapes)", num_rows, time.perf_counter() - start, self.state.on_demand_compiled,
                 self.state.on_demand_total)
        future.set_result(None)

    def _compile_all(self, threads: int, background: bool = False) -> None:
        start = time.perf_counter()
        store = self.store
        first_phase = compile_threads.CpuByThread()
        first_phase.start()
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=COMPILE_THREAD_NAME) as pool, \
                self._fresh(), Progress(self.total, "warm-up", "shapes compiled", log) as progress:
            for number, phase in enumerate(self.phases):
                try:
                    jobs = [pool.submit(self._compile_one, *job, progress) for job in phase]
                except RuntimeError:  # only the interpreter's exit shuts the pool before the phases end
                    raise WarmupStopped("the process is exiting") from None
                for job in jobs:
                    job.result()
                if number == 0:
                    if background:  # the rest compiles beside serving: XLA's compiler threads yield to it
                        self._yield_compiler_threads(first_phase.busy(), threads)
                    self.state.first_ready.set()
        log.info("warm-up compiled %d step shapes, %d sampler shapes (with and without penalties), %d prompt-logprob "
                 "shapes and %d multi-step shapes in %.1fs%s", len(self.buckets), len(self.samplers),
                 len(self.phases[2]), len(self.runner._compiled_multi_step), time.perf_counter() - start,
                 "" if store is None else f" ({store.loaded} loaded and {store.saved} saved in {store.directory})")

    def _resolve_pending(self, error: Exception) -> None:
        """The shapes that will not compile raise `error` in whatever waits for them."""
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)
        self.state.first_ready.set()

    def _yield_compiler_threads(self, busy_while_compiling: list[int], threads: int) -> None:
        found = compile_threads.compiler_threads(busy_while_compiling)
        self.compiler_threads_yielding = compile_threads.yield_to_others(found)
        self._threads_yield = True  # and each warm-up thread, as it takes its next shape (_compile_one)
        self.gate.idle_threads = max(1, threads // 2)
        log.info("warm-up: %d of XLA's compiler threads, and the warm-up's, now run only when serving leaves a core "
                 "idle (SCHED_IDLE); %d shape(s) at a time while the engine is idle, all %d threads while a step "
                 "waits for one", len(self.compiler_threads_yielding), self.gate.idle_threads, threads)

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
        if self.compiler_threads_yielding:
            back = compile_threads.back_to_normal(self.compiler_threads_yielding)
            log.info("warm-up over: %d of %d compiler threads back in the normal scheduling class%s", len(back),
                     len(self.compiler_threads_yielding), "" if back else " (that needs CAP_SYS_NICE)")
        self.state.finished.set()

    def stop(self) -> None:
        """Ends a background warm-up early (the engine shuts down): the shapes not started are
        skipped, those compiling finish; returns at once (`state.finished` is set once they have)."""
        self.gate.stop()

    def run(self, background: bool) -> int:
        """Compiles every shape (in a thread when `background`); returns the count."""
        threads = os.cpu_count() or 1
        log.info("warm-up: compiling %d shapes at start (%d prompt-logprob shapes among them) on %d threads%s (a "
                 "filled compilation cache makes this seconds); %d prompt-logprob shapes compiled on first use%s",
                 self.total, len(self.phases[2]), threads,
                 ", serving once the first requests' shapes are ready" if background else "",
                 self.state.on_demand_total, " (--warmup_prompt_logprobs: at start)" if self.on_demand else "")
        if background:
            threading.Thread(target=self._compile_in_background, args=(threads,), name="warm-up", daemon=True).start()
        else:
            self._compile_all(threads)
            self.state.finished.set()
        return self.total


class PromptLogprobShapesOnDemand:
    """The prompt-logprob shapes a warm-up left to first use (jaxserve.core.step.PromptLogprobShapes):
    each started by the first step that needs it, on a thread of its own, through the plan's
    `compile_on_demand`. Read by the stepping thread, resolved by the compiling ones."""

    def __init__(self, plan: WarmupPlan, sizes) -> None:
        self.plan = plan
        self.sizes = tuple(sizes)  # row buckets, ascending
        self.futures: dict[int, concurrent.futures.Future] = {}  # size -> done once compiled (or failed)
        self._lock = threading.Lock()

    def _compiled(self) -> list[int]:
        return [size for size, future in self.futures.items() if future.done() and future.exception() is None]

    def _failed(self, size: int) -> bool:
        future = self.futures.get(size)
        return future is not None and future.done() and future.exception() is not None

    def _start(self, size: int) -> None:
        with self._lock:
            if size in self.futures:
                return
            future = self.futures[size] = concurrent.futures.Future()
        threading.Thread(target=self.plan.compile_on_demand, args=(size, future), daemon=True,
                         name=f"prompt-logprobs-{size}").start()

    def rows_ready(self, rows: int) -> int:
        """`rows` when a compiled shape holds them, else the most one does (0: none yet); the
        shape of `rows` is started when not compiled. A shape that failed to compile lets its
        rows run: the step then compiles it itself and fails its requests with the error."""
        size = self.size_needed(rows)
        if size is None or self._failed(size):
            return rows
        self._start(size)
        compiled = self._compiled()
        return rows if any(s >= rows for s in compiled) else max(compiled, default=0)

    def size_needed(self, rows: int) -> int | None:
        """The smallest shape of `rows` rows (None: more than the largest)."""
        return next((size for size in self.sizes if size >= rows), None)

    def size_for(self, rows: int) -> int | None:
        """The shape a step of `rows` rows runs with: the smallest compiled one that holds them,
        else the one it needs (then compiled by the step itself)."""
        return min((s for s in self._compiled() if s >= rows), default=None) or self.size_needed(rows)

    def wait(self, timeout: float) -> None:
        """Returns once a shape that is compiling is done, or after `timeout` seconds."""
        concurrent.futures.wait([f for f in self.futures.values() if not f.done()], timeout,
                                return_when=concurrent.futures.FIRST_COMPLETED)
