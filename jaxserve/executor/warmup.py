"""The warm-up: every shape a ModelRunner steps with, compiled ahead of time on all cores.

XLA compiles with the GIL released, so a thread per core compiles that many shapes at once; the
executables go into the runner's tables (`_compiled_forward`, `_compiled_sample`, ...) and serve
every step, so serving never compiles. Three phases, in order:
  1. what a first request needs: the prefill-only and decode-only steps and their samplers
     without penalties (`WarmupState.first_ready` is set after them);
  2. the rest of the steps (decoding rows beside prefill chunks), the samplers with penalties
     and the multi-step shapes;
  3. the prompt-logprob shapes (they take the forward's hidden rows, known once a prefill step
     compiled).
In the background (`jaxserve serve`) the phases run in a thread and the runner's steps wait on
each shape's future (`pending`) until it is compiled: nothing compiles on the stepping thread.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import time

import jax
import jax.numpy as jnp

from jaxserve.core.progress import Progress
from jaxserve.executor import executables, sampler

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


class ProcessExiting(Exception):
    """The interpreter is exiting (concurrent.futures takes no new work): the warm-up stops."""


class WarmupPlan:
    """The shapes of one runner in their phases, a future per shape, and how to compile them."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.store = runner._executable_store
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
            [("prompt_logprobs", n, self._compile_prompt_logprobs, (n,)) for n in runner.prompt_logprob_buckets],
        ]
        self.total = sum(len(phase) for phase in self.phases)
        self.state = WarmupState(total=self.total, first_total=len(self.phases[0]))
        self.pending = {(kind, key): concurrent.futures.Future() for phase in self.phases for kind, key, _, _ in phase}

    # ---- one shape each -------------------------------------------------------------------
    def _load_or_compile(self, key, lower):
        """The executable of `key`: from the store, else `lower()` compiled (and saved)."""
        compiled = self.store.load(key) if self.store is not None else None
        if compiled is None:
            compiled, fresh = executables.compile_fresh(lower())
            if self.store is not None and fresh:
                self.store.save(key, compiled)
        return compiled

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
        try:
            fn(*args)
        except BaseException as e:
            future.set_exception(e)
            raise
        future.set_result(None)
        self.state.advance()
        progress.advance()

    def _compile_all(self, threads: int) -> None:
        start = time.perf_counter()
        store = self.store
        # Shapes to be saved compile afresh (see executables.persistent_cache_off); a loaded store skips both.
        fresh = (executables.persistent_cache_off() if store is not None and store.mode != "load"
                 else contextlib.nullcontext())
        with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool, fresh, \
                Progress(self.total, "warm-up", "shapes compiled", log) as progress:
            for number, phase in enumerate(self.phases):
                try:
                    jobs = [pool.submit(self._compile_one, *job, progress) for job in phase]
                except RuntimeError:  # only the interpreter's exit shuts the pool before the phases end
                    raise ProcessExiting() from None
                for job in jobs:
                    job.result()
                if number == 0:
                    self.state.first_ready.set()
        log.info("warm-up compiled %d step shapes, %d sampler shapes (with and without penalties), %d prompt-logprob "
                 "shapes and %d multi-step shapes in %.1fs%s", len(self.buckets), len(self.samplers),
                 len(self.phases[2]), len(self.runner._compiled_multi_step), time.perf_counter() - start,
                 "" if store is None else f" ({store.loaded} loaded and {store.saved} saved in {store.directory})")

    def _compile_in_background(self, threads: int) -> None:
        try:
            self._compile_all(threads)
        except ProcessExiting:  # the server stopped before the warm-up ended: nothing failed
            log.info("warm-up stopped: the process is exiting")
            self.state.first_ready.set()
        except BaseException as e:  # the steps that wait for a failed shape raise it
            self.state.error = f"{type(e).__name__}: {e}"
            log.exception("warm-up failed")
            for future in self.pending.values():
                if not future.done():
                    future.set_exception(RuntimeError(f"warm-up failed: {self.state.error}"))
            self.state.first_ready.set()
        self.state.finished.set()

    def run(self, background: bool) -> int:
        """Compiles every shape (in a thread when `background`); returns the count."""
        threads = os.cpu_count() or 1
        log.info("warm-up: compiling %d shapes on %d threads%s (a filled compilation cache makes this seconds)",
                 self.total, threads, ", serving once the first requests' shapes are ready" if background else "")
        if background:
            threading.Thread(target=self._compile_in_background, args=(threads,), name="warm-up", daemon=True).start()
        else:
            self._compile_all(threads)
            self.state.finished.set()
        return self.total
