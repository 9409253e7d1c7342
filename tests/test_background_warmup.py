"""The warm-up in the background (`jaxserve serve`'s: EngineConfig.background_warmup): requests
run while it compiles, a step whose shape is not ready runs in compiled shapes or waits for its
own (taken next) instead of compiling on the stepping thread, the progress is reported, and once
it ends serving compiles nothing. The prompt-logprob shapes compile last, or before ready with
warmup_prompt_logprobs."""
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
    for kind, key in engine.runner.executables.promised():
        engine.runner.executables.get(kind, key)  # raises what failed


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
    the shapes its warm-up threads handed to the compiler (an engine without a warm-up compiles
    on its stepping thread: not counted, not held)."""
    import types

    from jaxserve.executor import executables, warmup
    small = dict(max_num_batched_tokens=32, max_model_len=64)
    probe = make_engine(params, warmup=False, **small)
    first = [b for b in probe.runner.all_buckets() if not (b.num_decode and b.num_prefill_tokens)]
    first_total = len(first) + len({len(probe.runner.empty_batch(b)["logits_indices"]) for b in first})
    held, real, compiled = threading.Event(), executables.compile_fresh, []
    in_hand = threading.Event()  # set once a shape after the first phase waits for `held`

    def compile_fresh(lowered):
        if not threading.current_thread().name.startswith(warmup.COMPILE_THREAD_NAME):
            return real(lowered)
        if len(compiled) >= first_total:
            in_hand.set()
            held.wait(timeout=600)
        compiled.append(lowered)
        return real(lowered)

    monkeypatch.setattr(executables, "compile_fresh", compile_fresh)
    monkeypatch.setattr(executables, "default_directory", lambda: None)  # nothing saved: every shape compiles
    yield types.SimpleNamespace(start=lambda: make_engine(params, warmup=True, background_warmup=True, **small),
                                first_total=first_total, held=held, compiled=compiled, small=small,
                                in_hand=in_hand)
    held.set()


def run_in_thread(fn, timeout_s=300):
    """fn() on a thread of its own (a step that waits for a held shape would hang the test)."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), "a step waited for a shape the warm-up holds back"
    return result["value"]


def test_steps_whose_shapes_are_not_compiled_run_in_compiled_ones_with_the_same_tokens(held_after_the_first_phase,
                                                                                       params):
    """Right after ready only the first requests' shapes are compiled: a step of decoding rows
    beside prefill chunks runs as its two halves (and any step in a larger compiled bucket), so
    the first requests never wait for a compile, and get the tokens their own shapes give."""
    seed = 5
    prompts = random_prompts(np.random.default_rng(seed), 6, low=5, high=40)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=77, ignore_eos=True)
    small = held_after_the_first_phase.small
    reference = [run_staggered(make_engine(params, **small), prompts, p) for p in (GREEDY, seeded)]
    engine = held_after_the_first_phase.start()
    assert engine.runner.warmup_state.first_ready.wait(600)
    outputs = run_in_thread(lambda: [run_staggered(engine, prompts, p) for p in (GREEDY, seeded)])
    assert outputs == reference, f"seed {seed}"
    assert "mixed" in {record.kind for record in engine.step_records}, "no step had decoding rows beside prefill"
    assert len(held_after_the_first_phase.compiled) == held_after_the_first_phase.first_total  # none asked for
    assert engine.runner.executables.num_waits == 0
    held_after_the_first_phase.held.set()
    wait_for_every_shape(engine)  # (no compile of this engine's runs on into the next test)


def test_penalties_and_plain_requests_right_after_ready_share_the_first_samplers(held_after_the_first_phase,
                                                                               params):
    """The first phase compiles each first bucket's sampler in its variant with penalties, which
    serves every request (neutral penalties change no logit): right after ready a request with
    penalties waits for no compile either, and plain and penalised requests get the tokens they
    get from a fully warmed engine."""
    seed = 6
    prompts = random_prompts(np.random.default_rng(seed), 4, low=5, high=30)
    penalised = SamplingParams(max_tokens=10, temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5,
                               repetition_penalty=1.3, ignore_eos=True)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, seed=11, ignore_eos=True)
    small = held_after_the_first_phase.small
    reference = [run_staggered(make_engine(params, **small), prompts, p) for p in (GREEDY, seeded, penalised)]
    assert reference[2] != reference[0], "the penalties change nothing: the test would prove nothing"
    engine = held_after_the_first_phase.start()
    assert engine.runner.warmup_state.first_ready.wait(600)
    cache = engine.runner.executables
    assert cache.keys("sample") and all(penalties for _, penalties, _ in cache.keys("sample"))
    outputs = run_in_thread(lambda: [run_staggered(engine, prompts, p) for p in (GREEDY, seeded, penalised)])
    assert outputs == reference, f"seed {seed}"
    assert len(held_after_the_first_phase.compiled) == held_after_the_first_phase.first_total  # none asked for
    assert cache.num_waits == 0
    held_after_the_first_phase.held.set()
    wait_for_every_shape(engine)


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
        # A shape of the second phase is compiling when the server stops (on a loaded machine the
        # warm-up thread may not have taken one yet right after ready).
        assert held_after_the_first_phase.in_hand.wait(600)
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


def test_a_step_that_needs_a_shape_still_queued_gets_it_next(held_after_the_first_phase, params, monkeypatch):
    """A request asking for prompt logprobs before their shapes (compiled last) are: its step
    waits below the scheduler, and the warm-up takes that shape before the ones queued ahead."""
    from jaxserve.executor import executable_cache
    seed = 4
    wanting = random_prompts(np.random.default_rng(seed), 1, low=6, high=9)[0]  # one step's rows: the smallest shape
    expected = make_engine(params, **held_after_the_first_phase.small).generate([wanting], WANTING)[0]
    assert len(expected.prompt_logprobs) == len(wanting) - 1
    put_order, real_put = [], executable_cache.ExecutableCache.put

    def put(self, kind, key, compiled):
        put_order.append((kind, key))
        real_put(self, kind, key, compiled)

    monkeypatch.setattr(executable_cache.ExecutableCache, "put", put)
    engine = held_after_the_first_phase.start()
    assert engine.runner.warmup_state.first_ready.wait(600)
    cache, first_total = engine.runner.executables, held_after_the_first_phase.first_total
    needed = next(b for b in engine.runner.prompt_logprob_buckets if b >= len(wanting) - 1)
    queued_before = [key for key in cache.promised() if not cache.ready(*key)].index(("prompt_logprobs", needed))
    assert queued_before > os.cpu_count(), "the shape would come soon anyway: the test would prove nothing"
    stepping, result = [], []
    thread = threading.Thread(target=lambda: (stepping.append(threading.get_ident()),
                                              result.append(engine.generate([wanting], WANTING)[0])), daemon=True)
    thread.start()
    for _ in range(3000):
        if cache.waiting:
            break
        thread.join(0.01)
    assert cache.waiting == 1, "the step did not wait for its prompt-logprob shape"
    held_after_the_first_phase.held.set()
    thread.join(600)
    assert result, "the request never finished"
    assert put_order.index(("prompt_logprobs", needed)) <= first_total + (os.cpu_count() or 1), put_order
    entries = result[0].prompt_logprobs
    assert [(e.token_id, e.rank, [t for t, _ in e.top]) for e in entries] == [
        (e.token_id, e.rank, [t for t, _ in e.top]) for e in expected.prompt_logprobs], f"seed {seed}"
    np.testing.assert_allclose([e.logprob for e in entries], [e.logprob for e in expected.prompt_logprobs], atol=1e-6)
    assert result[0].token_ids == expected.token_ids
    wait_for_every_shape(engine)
    assert sorted(cache.keys("prompt_logprobs")) == list(engine.runner.prompt_logprob_buckets)


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
