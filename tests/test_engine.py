"""Engine: continuous batching, preemption, prefix caching, compile count, seeded sampling."""
import numpy as np
import pytest
from jax import monitoring

from jaxserve.config import ModelConfig
from jaxserve.engine import Engine, EngineConfig
from jaxserve.models import llama
from jaxserve.request import SamplingParams

TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
                   num_q_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                   eos_token_ids=(2,))
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def params():
    return llama.random_params(TINY, seed=1)


def make_engine(params, **overrides):
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=64, max_num_prefill_seqs=2, page_size=8,
               num_pages=96, max_model_len=256, warmup=False)
    cfg.update(overrides)
    return Engine(TINY, params, None, EngineConfig(**cfg))


def random_prompts(rng, n, low=1, high=60):
    return [rng.integers(3, TINY.vocab_size, rng.integers(low, high)).tolist() for _ in range(n)]


def run_alone(engine, prompts, params=GREEDY):
    return [engine.generate([p], params)[0].token_ids for p in prompts]


def run_staggered(engine, prompts, params=GREEDY, arrivals_per_step=2):
    """Adds a couple of requests per step while others run; returns outputs in prompt order."""
    outputs = {i: [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished():
        for _ in range(arrivals_per_step):
            if pending:
                i, p = pending.pop(0)
                engine.add_request(str(i), p, params)
        for out in engine.step():
            outputs[int(out.request_id)].extend(out.new_token_ids)
    return [outputs[i] for i in range(len(prompts))]


def assert_all_pages_free(engine):
    assert engine.allocator.num_used_pages == 0
    assert not engine.has_unfinished()


def test_batch_invariance_with_staggered_arrivals_and_odd_chunks(params):
    rng = np.random.default_rng()
    prompts = random_prompts(rng, 10)
    reference = run_alone(make_engine(params, enable_prefix_caching=False), prompts)
    engine = make_engine(params, max_num_batched_tokens=13, enable_prefix_caching=False)
    assert run_staggered(engine, prompts) == reference
    assert_all_pages_free(engine)


def test_preemption_keeps_outputs(params):
    rng = np.random.default_rng()
    prompts = random_prompts(rng, 8, 20, 50)
    params_long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ample = make_engine(params, enable_prefix_caching=False)
    expected = [r.token_ids for r in ample.generate(prompts, params_long)]
    tight = make_engine(params, num_pages=20, enable_prefix_caching=False)  # 19 usable pages of 8
    got = [r.token_ids for r in tight.generate(prompts, params_long)]
    assert got == expected
    assert tight.scheduler.num_preemptions > 0
    assert ample.scheduler.num_preemptions == 0
    assert_all_pages_free(tight)


def test_prefix_caching_same_outputs_and_shared_prefix_computed_once(params):
    rng = np.random.default_rng()
    system = rng.integers(3, TINY.vocab_size, 40).tolist()  # 5 full pages of 8
    prompts = [system + rng.integers(3, TINY.vocab_size, rng.integers(1, 10)).tolist() for _ in range(6)]
    off = make_engine(params, enable_prefix_caching=False)
    on = make_engine(params, enable_prefix_caching=True)
    expected = run_alone(off, prompts)
    assert run_alone(on, prompts) == expected
    computed_off = off.num_computed_tokens
    computed_on = on.num_computed_tokens
    # Every request after the first reuses the 40 cached system-prompt tokens.
    assert computed_off - computed_on == 40 * (len(prompts) - 1)
    assert on.stats().prefix_cache_hit_tokens == 40 * (len(prompts) - 1)
    assert_all_pages_free(on)


@pytest.mark.parametrize("warmup", [True, False])
def test_no_compilation_after_warmup(params, warmup):
    engine = make_engine(params, warmup=warmup, max_num_seqs=8, max_num_batched_tokens=32)
    compiles = []

    def listener(event, duration, **kwargs):
        # Tracing happens for any new shape, even one the persistent cache then serves.
        if event in ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration"):
            compiles.append(event)

    monitoring.register_event_duration_secs_listener(listener)
    try:
        rng = np.random.default_rng()
        prompts = random_prompts(rng, 50, 1, 120)
        sampling = [SamplingParams(max_tokens=int(rng.integers(1, 40)), temperature=float(rng.choice([0.0, 0.8])),
                                   top_k=int(rng.choice([0, 5])), top_p=float(rng.choice([1.0, 0.9])),
                                   logprobs=int(rng.choice([0, 3])) if rng.random() < 0.3 else None,
                                   repetition_penalty=float(rng.choice([1.0, 1.2])), ignore_eos=True)
                    for _ in prompts]
        results = run_staggered_mixed(engine, prompts, sampling)
    finally:
        monitoring.unregister_event_duration_listener(listener)
    assert all(r for r in results)
    if warmup:
        assert compiles == []
    else:  # the counter sees compilations when there was no warm-up
        assert compiles
    assert_all_pages_free(engine)


def run_staggered_mixed(engine, prompts, sampling):
    outputs = {i: [] for i in range(len(prompts))}
    pending = list(enumerate(zip(prompts, sampling)))
    while pending or engine.has_unfinished():
        for _ in range(3):
            if pending:
                i, (p, sp) = pending.pop(0)
                engine.add_request(str(i), p, sp)
        for out in engine.step():
            outputs[int(out.request_id)].extend(out.new_token_ids)
    return [outputs[i] for i in range(len(prompts))]


def test_seeded_sampling_is_reproducible_and_batch_independent(params):
    rng = np.random.default_rng()
    prompts = random_prompts(rng, 4)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    engine = make_engine(params)
    alone = run_alone(engine, prompts, seeded)
    together = [r.token_ids for r in engine.generate(prompts, seeded)]
    assert together == alone
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    assert run_alone(engine, prompts, other_seed) != alone


def test_stops_on_eos_and_stop_token_ids(params):
    engine = make_engine(params)
    prompt = [5, 6, 7, 8]
    free = engine.generate([prompt], GREEDY)[0].token_ids
    stop_at = free[3]
    first = free.index(stop_at)
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                  stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free[:first + 1]
    engine.eos_token_ids = frozenset([stop_at])
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert out.finish_reason == "stop" and out.token_ids == free[:first + 1]
    out = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == free


def test_abort_frees_pages_at_once(params):
    engine = make_engine(params)
    engine.add_request("a", list(range(3, 40)), GREEDY)
    engine.add_request("b", list(range(3, 20)), GREEDY)
    engine.step()
    assert engine.allocator.num_used_pages > 0
    out = engine.abort("a")
    assert out.finished and out.finish_reason == "abort"
    engine.abort("b")
    assert_all_pages_free(engine)


def test_logprobs_are_returned_per_token(params):
    engine = make_engine(params)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3,
                                                       ignore_eos=True))[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0.0
        assert len(lp.top) == 3 and lp.top[0][0] == tok  # greedy: the sampled token is the best
        assert lp.top[0][1] == pytest.approx(lp.logprob, abs=1e-5)


def test_bad_requests_are_refused_with_clear_errors(params):
    engine = make_engine(params)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("long", [3] * 300, GREEDY)
    with pytest.raises(ValueError, match="vocab|\\[0, 256\\)"):
        engine.add_request("oov", [3, 999], GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("p", [3], SamplingParams(top_p=1.5))
    assert_all_pages_free(engine)
