"""The warm-up in the background (`jaxserve serve`'s: EngineConfig.background_warmup): requests
run while it compiles, a step whose shape is not ready waits for it instead of compiling on the
stepping thread, the progress is reported, and once it ends serving compiles nothing. The
prompt-logprob shapes: compiled on first use off the stepping thread (the request waiting, the
others stepped), or at start with warmup_prompt_logprobs."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from jax import monitoring

from jaxserve.core.request import SamplingParams
from tests.test_engine import GREEDY, TINY, make_engine, random_prompts, recorded_compilations, run_staggered

pytestmark = pytest.mark.slow  # engines and their warm-ups: out of `make test-quick`

WANTING = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)


@pytest.fixture(scope="module")
def params():
    from jaxserve.models import weights
    return weights.random_params(TINY, seed=1)


def wait_for_every_shape(engine, timeout_s=600):
    assert engine.runner.warmup_state.finished.wait(timeout_s)
    for future in engine.runner._pending.values():
        future.result()  # raises what failed


@pytest.fixture
def compiles_by_thread():
    """The idents of the threads that traced or compiled while the block runs."""
    threads = []

    def listener(event, duration, **kwargs):
        if event in ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration"):
            threads.append(threading.get_ident())

    monitoring.register_event_duration_secs_listener(listener)
    yield threads
    monitoring.unregister_event_duration_listener(listener)


def test_requests_run_while_the_warmup_compiles_and_never_compile_on_the_stepping_thread(params, compiles_by_thread):
    seed = 3
    prompts = random_prompts(np.random.default_rng(seed), 6)
    reference = run_staggered(make_engine(params, warmup=True), prompts)
    engine = make_engine(params, warmup=True, background_warmup=True)
    status = engine.warmup_status()
    assert status["total"] == engine.stats().warmup_shapes_total > 0 and status["error"] is None
    del compiles_by_thread[:]  # building the engine traced its KV cache on this thread
    outputs = run_staggered(engine, prompts)  # starts at once: its steps wait for their shapes
    assert outputs == reference, f"seed {seed}"
    assert threading.get_ident() not in compiles_by_thread, "a step compiled on the stepping thread"
    wait_for_every_shape(engine)
    status = engine.warmup_status()
    assert status == {"ready": True, "compiled": status["total"], "total": status["total"], "error": None}
    assert engine.stats().warmup_shapes_compiled == status["total"]
    with recorded_compilations() as compiles:  # once the warm-up is over, serving compiles nothing
        run_staggered(engine, random_prompts(np.random.default_rng(seed + 1), 6), GREEDY, arrivals_per_step=3)
    assert compiles == []


def test_ready_comes_with_the_first_requests_shapes_and_a_failed_warmup_is_reported(params, monkeypatch):
    from jaxserve.executor import executables

    gate, real = threading.Event(), executables.compile_fresh
    seen = []

    def held_after_the_first(lowered):  # the first phase compiles; the rest waits for the gate
        if len(seen) >= first_total:
            gate.wait(timeout=600)
            raise RuntimeError("no memory left for this shape")
        seen.append(lowered)
        return real(lowered)

    small = dict(max_num_batched_tokens=32, max_model_len=64)  # few shapes: each compiles afresh here
    probe = make_engine(params, warmup=False, **small)
    buckets = probe.runner.all_buckets()
    first = [b for b in buckets if not (b.num_decode and b.num_prefill_tokens)]
    rows = {len(probe.runner.empty_batch(b)["logits_indices"]) for b in first}
    first_total = len(first) + len(rows)
    monkeypatch.setattr(executables, "compile_fresh", held_after_the_first)
    monkeypatch.setattr(executables, "default_directory", lambda: None)  # no saved executables: every shape compiles
    engine = make_engine(params, warmup=True, background_warmup=True, **small)
    state = engine.runner.warmup_state
    assert state.first_ready.wait(timeout=600)
    status = engine.warmup_status()
    assert status["ready"] and status["compiled"] == first_total < status["total"]
    prompt = random_prompts(np.random.default_rng(0), 1)[0]
    assert len(engine.generate([prompt], GREEDY)[0].token_ids) == GREEDY.max_tokens  # alone: first shapes only
    gate.set()
    with pytest.raises(RuntimeError, match="no memory left"):
        wait_for_every_shape(engine)
    status = engine.warmup_status()
    assert not status["ready"] and "no memory left" in status["error"]


def test_a_process_exiting_mid_warmup_stops_it_without_an_error(params, monkeypatch, caplog):
    """At the interpreter's exit concurrent.futures takes no new work: a server stopped during the
    warm-up logs that it stopped, not a failure with a traceback."""
    import concurrent.futures
    real = concurrent.futures.ThreadPoolExecutor.submit
    calls = []

    def refusing_after_the_first_phase(self, fn, *args, **kwargs):
        calls.append(args[:2])
        if len(calls) > first_total:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")
        return real(self, fn, *args, **kwargs)

    probe = make_engine(params, warmup=False, max_num_batched_tokens=32, max_model_len=64)
    buckets = probe.runner.all_buckets()
    first = [b for b in buckets if not (b.num_decode and b.num_prefill_tokens)]
    first_total = len(first) + len({len(probe.runner.empty_batch(b)["logits_indices"]) for b in first})
    monkeypatch.setattr(concurrent.futures.ThreadPoolExecutor, "submit", refusing_after_the_first_phase)
    with caplog.at_level("INFO", logger="jaxserve.executor.warmup"):
        engine = make_engine(params, warmup=True, background_warmup=True, max_num_batched_tokens=32, max_model_len=64)
        assert engine.runner.warmup_state.finished.wait(600)
    status = engine.warmup_status()
    assert status["error"] is None and status["compiled"] == first_total < status["total"]
    assert "warm-up stopped: the process is exiting" in caplog.text and "warm-up failed" not in caplog.text


@pytest.fixture
def held_after_the_first_phase(params, monkeypatch):
    """A background warm-up of a small engine whose shapes after the first phase wait for
    `held.set()` (set at the end in any case, or the test process could not exit); `compiled`:
    the shapes handed to the compiler."""
    import types

    from jaxserve.executor import executables
    small = dict(max_num_batched_tokens=32, max_model_len=64)
    probe = make_engine(params, warmup=False, **small)
    first = [b for b in probe.runner.all_buckets() if not (b.num_decode and b.num_prefill_tokens)]
    first_total = len(first) + len({len(probe.runner.empty_batch(b)["logits_indices"]) for b in first})
    held, real, compiled = threading.Event(), executables.compile_fresh, []

    def compile_fresh(lowered):
        if len(compiled) >= first_total:
            held.wait(timeout=600)
        compiled.append(lowered)
        return real(lowered)

    monkeypatch.setattr(executables, "compile_fresh", compile_fresh)
    monkeypatch.setattr(executables, "default_directory", lambda: None)  # nothing saved: every shape compiles
    yield types.SimpleNamespace(start=lambda: make_engine(params, warmup=True, background_warmup=True, **small),
                                first_total=first_total, held=held, compiled=compiled)
    held.set()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="the idle scheduling class is Linux's")
def test_xlas_compiler_threads_yield_to_serving_while_the_warmup_is_in_the_background(held_after_the_first_phase):
    """After the first phase XLA's compiler threads (not the Python ones, not those that run
    executables) are in the idle class until the warm-up ends: a cold start's first request ran
    beside compiles that took the cores it needed (bench/RESULTS.md)."""
    import jax
    import jax.numpy as jnp

    from jaxserve.executor import compile_threads, warmup
    engine = held_after_the_first_phase.start()
    assert engine.runner.warmup_state.first_ready.wait(600)
    yielding = engine.runner._warmup_plan.compiler_threads_yielding
    python_threads = {t.native_id: t.name for t in threading.enumerate()}
    assert yielding and all(compile_threads.is_idle_class(tid) for tid in yielding)
    assert set(yielding) - set(python_threads), "none of XLA's compiler threads yields"
    # of the Python threads, only the warm-up's own (they take their next shape in the idle class)
    assert all(python_threads[tid].startswith(warmup.COMPILE_THREAD_NAME)
               for tid in set(yielding) & set(python_threads))
    assert not any(compile_threads.thread_name(tid).startswith("tf_XLAEigen") for tid in yielding)
    # What runs executables keeps its class (no compile runs now: the rest of the warm-up is held):
    # the tiny model's steps run on the calling thread, a larger matmul on XLA's own threads too.
    matmul = jax.jit(lambda a: a @ a).lower(jnp.ones((1024, 1024))).compile()
    steps = compile_threads.CpuByThread()
    steps.start()
    prompt = random_prompts(np.random.default_rng(0), 1, low=20, high=30)[0]
    engine.generate([prompt], GREEDY)
    for _ in range(20):
        matmul(jnp.ones((1024, 1024))).block_until_ready()
    ran_steps = set(steps.busy()) - set(python_threads)  # (a warm-up thread may be lowering its next shape)
    assert ran_steps, "no thread of XLA's ran the executables"
    assert not ran_steps & set(yielding), (sorted(ran_steps), yielding)
    assert not compile_threads.is_idle_class(threading.get_native_id())  # the stepping thread
    held_after_the_first_phase.held.set()
    wait_for_every_shape(engine)
    still_idle = [tid for tid in yielding if compile_threads.is_idle_class(tid)]
    if os.geteuid() == 0:  # root may leave the idle class, so the warm-up's end undid it
        assert still_idle == []
    else:  # (a thread that ended is in no class)
        assert still_idle or not any(os.path.exists(f"/proc/self/task/{tid}") for tid in yielding)


def test_a_shutdown_mid_warmup_skips_the_shapes_not_started(held_after_the_first_phase, caplog):
    """A server stopped during a cold warm-up exits once the shapes compiling have: the queued
    ones are skipped. Before, the process's exit waited for the whole phase (concurrent.futures
    runs every queued job before its threads end): 20 s here, minutes for a GPU build."""
    import asyncio

    from jaxserve.async_engine import AsyncEngine
    from jaxserve.executor import warmup
    first_total, compiled = held_after_the_first_phase.first_total, held_after_the_first_phase.compiled
    with caplog.at_level("INFO", logger="jaxserve.executor.warmup"):
        engine = held_after_the_first_phase.start()
        state = engine.runner.warmup_state
        assert state.first_ready.wait(600)
        async_engine = AsyncEngine(engine)

        async def start_and_stop():
            await async_engine.start()
            await async_engine.shutdown()
        asyncio.run(start_and_stop())
        assert not state.finished.is_set()  # the shapes compiling finish; shutdown does not wait for them
        held_after_the_first_phase.held.set()
        assert state.finished.wait(600)
    threads = os.cpu_count() or 1
    assert first_total < len(compiled) <= first_total + threads < state.total, (len(compiled), state.total)
    assert state.error is None and state.compiled == len(compiled)
    assert "warm-up stopped: the engine shut down before" in caplog.text and "warm-up failed" not in caplog.text
    with pytest.raises(warmup.WarmupStopped, match="the engine shut down"):
        wait_for_every_shape(engine)


def test_prompt_logprob_shapes_compile_on_first_use_while_the_other_requests_stream(params, monkeypatch,
                                                                                  compiles_by_thread, caplog):
    from jaxserve.executor import warmup
    seed = 4
    wanting, plain = random_prompts(np.random.default_rng(seed), 2, low=20, high=40)
    # Today's path, with the flag: every prompt-logprob shape compiled at start.
    eager = make_engine(params, warmup=True, warmup_prompt_logprobs=True)
    buckets = eager.runner.prompt_logprob_buckets
    assert sorted(eager.runner._compiled_prompt_logprobs) == list(buckets) and eager.runner.prompt_logprob_shapes is None
    expected = eager.generate([wanting], WANTING)[0]
    expected_plain = eager.generate([plain], GREEDY)[0].token_ids
    assert len(expected.prompt_logprobs) == len(wanting) - 1

    gate, started, real = threading.Event(), [], warmup.WarmupPlan._compile_prompt_logprobs

    def gated(self, num_rows):  # the on-demand compile waits for the test's word
        started.append(num_rows)
        assert gate.wait(600)
        real(self, num_rows)

    monkeypatch.setattr(warmup.WarmupPlan, "_compile_prompt_logprobs", gated)
    with caplog.at_level("INFO", logger="jaxserve.executor.warmup"):
        engine = make_engine(params, warmup=True, background_warmup=True)
        wait_for_every_shape(engine)
    state = engine.runner.warmup_state
    assert engine.runner._compiled_prompt_logprobs == {} and started == []  # none compiled at start
    assert state.total == eager.runner.warmup_state.total - len(buckets) and state.on_demand_total == len(buckets)
    assert f"{len(buckets)} prompt-logprob shapes compiled on first use" in caplog.text

    del compiles_by_thread[:]
    engine.add_request("wanting", wanting, WANTING)  # first in the queue, held while its shape compiles
    engine.add_request("plain", plain, GREEDY)
    outputs = {"wanting": [], "plain": []}
    for _ in range(100):
        for out in engine.step():
            outputs[out.request_id].append(out)
        if outputs["plain"] and outputs["plain"][-1].finished:
            break
    assert [t for out in outputs["plain"] for t in out.new_token_ids] == expected_plain, f"seed {seed}"
    assert outputs["wanting"] == [] and engine.scheduler.num_waiting == 1, "the held request ran or was lost"
    needed = next(b for b in buckets if b >= len(wanting) - 1)
    assert started == [needed]
    gate.set()
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    entries = next(out.prompt_logprobs for out in outputs["wanting"] if out.prompt_logprobs is not None)
    assert [(e.token_id, e.rank, [t for t, _ in e.top]) for e in entries] == [
        (e.token_id, e.rank, [t for t, _ in e.top]) for e in expected.prompt_logprobs], f"seed {seed}"
    np.testing.assert_allclose([e.logprob for e in entries], [e.logprob for e in expected.prompt_logprobs], atol=1e-6)
    assert [t for out in outputs["wanting"] for t in out.new_token_ids] == expected.token_ids
    assert sorted(engine.runner._compiled_prompt_logprobs) == [needed] and state.on_demand_compiled == 1
    assert threading.get_ident() not in compiles_by_thread, "a step compiled on the stepping thread"

    # The synchronous engine (a warm-up, no stepping thread of a server) waits the same way.
    monkeypatch.setattr(warmup.WarmupPlan, "_compile_prompt_logprobs", real)
    sync = make_engine(params, warmup=True)
    del compiles_by_thread[:]
    result = sync.generate([wanting], WANTING)[0]
    assert [e.token_id for e in result.prompt_logprobs] == [e.token_id for e in expected.prompt_logprobs]
    np.testing.assert_allclose([e.logprob for e in result.prompt_logprobs],
                               [e.logprob for e in expected.prompt_logprobs], atol=1e-6)
    assert threading.get_ident() not in compiles_by_thread and list(sync.runner._compiled_prompt_logprobs) == [needed]


def test_the_warmup_waits_while_the_engine_serves_and_goes_on_while_a_step_waits_for_a_shape():
    """ServingGate: a background warm-up starts its next shape only while the engine is idle or
    one of its steps waits for a shape (restarts' first requests got 2.5x slower than later ones
    from executables loading beside them; see bench/RESULTS.md)."""
    from jaxserve.executor.warmup import ServingGate

    serving = threading.Event()
    serving.set()
    gate = ServingGate(serving.is_set)

    def take_a_turn():
        with gate.turn():
            pass

    def waiter(target=take_a_turn) -> threading.Thread:
        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        return thread

    def still_waits(thread) -> bool:
        thread.join(timeout=0.3)
        return thread.is_alive()

    def went_on(thread) -> bool:
        thread.join(timeout=10)
        return not thread.is_alive()

    held = waiter()
    assert still_waits(held), "a shape started while the engine served"
    with gate.step_waits():
        assert went_on(held), "a step waiting for a shape did not let the warm-up go on"
    held = waiter()
    assert still_waits(held), "the gate stayed open after the step got its shape"
    serving.clear()
    assert went_on(held), "the warm-up did not go on once the engine was idle"

    # idle_threads (after a background warm-up's first phase): so many shapes at once while idle,
    # every thread while a step waits.
    gate.idle_threads = 1
    taken, release = threading.Event(), threading.Event()

    def hold_a_turn():
        with gate.turn():
            taken.set()
            release.wait(timeout=600)
    first = waiter(hold_a_turn)
    assert taken.wait(timeout=10)
    second = waiter()
    assert still_waits(second), "a second shape started on an idle engine limited to one"
    with gate.step_waits():
        assert went_on(second), "a step waiting for a shape did not get every thread"
    release.set()
    first.join(timeout=10)
    third = waiter()
    assert went_on(third), "the turn was not handed back"
