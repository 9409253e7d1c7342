"""The warm-up in the background (`jaxserve serve`'s: EngineConfig.background_warmup): requests
run while it compiles, a step whose shape is not ready waits for it instead of compiling on the
stepping thread, the progress is reported, and once it ends serving compiles nothing."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from jax import monitoring

from tests.test_engine import GREEDY, TINY, make_engine, random_prompts, recorded_compilations, run_staggered


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
