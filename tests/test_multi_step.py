"""Multi-step decoding: n decode steps per device call, the same tokens as one step at a time."""
import dataclasses

import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.core.page_allocator import PageAllocator
from jaxserve.core.request import Request, SamplingParams
from jaxserve.core.scheduler import Scheduler
from tests.test_engine import (TINY, assert_all_pages_free, make_engine, random_prompts, recorded_compilations,
                               run_staggered_mixed)

pytestmark = pytest.mark.slow  # engines: out of `make test-quick`


@pytest.fixture(scope="module")
def params():
    from jaxserve.models import weights
    return weights.random_params(TINY, seed=1)


def mixed_sampling(rng, n):
    """Greedy and seeded rows, min_tokens and logit biases (which multi-step steps carry), and
    some rows with penalties or logprobs (which make their steps one at a time)."""
    sampling = []
    for i in range(n):
        max_tokens = int(rng.integers(1, 40)) if i not in (3, 5) else 5  # rows 3 and 5: single steps, briefly
        sampling.append(SamplingParams(
            max_tokens=max_tokens, temperature=float(rng.choice([0.0, 0.9])), seed=i, top_k=int(rng.choice([0, 7])),
            min_tokens=int(rng.integers(0, min(max_tokens, 6))), logit_bias={9: 2.0} if i % 4 == 0 else None,
            repetition_penalty=1.2 if i == 3 else 1.0, logprobs=2 if i == 5 else None,
            stop_token_ids=[int(rng.integers(3, TINY.vocab_size))] if i % 3 == 0 else [],
            ignore_eos=bool(i % 2)))
    return sampling


@pytest.mark.parametrize("num_steps", [4, 8])
def test_same_tokens_as_one_step_at_a_time(params, num_steps):
    """Staggered arrivals, chunked prefill, preemption, prefix caching, stop tokens inside a call."""
    seed = 21 + num_steps
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, TINY.vocab_size, 16).tolist()
    prompts = [shared + p if i % 2 else p for i, p in enumerate(random_prompts(rng, 16, 1, 60))]
    sampling = mixed_sampling(rng, len(prompts))
    reference = run_staggered_mixed(make_engine(params), prompts, sampling)
    engine = make_engine(params, num_scheduler_steps=num_steps, num_pages=30, max_num_batched_tokens=24)
    assert run_staggered_mixed(engine, prompts, sampling) == reference, f"seed {seed}"
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0, f"seed {seed}"
    calls = [r for r in engine.step_records if r.kind == "decode" and r.num_output_tokens > r.num_decode_rows]
    assert calls, f"seed {seed}: no step drew several tokens per row"
    assert max(r.num_output_tokens for r in calls) <= num_steps * engine.config.max_num_seqs
    assert_all_pages_free(engine)


def test_stops_and_max_tokens_inside_a_multi_step_call(params):
    rng = np.random.default_rng(23)
    prompts = random_prompts(rng, 5, 5, 30)
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    plain, multi = make_engine(params), make_engine(params, num_scheduler_steps=8)
    for prompt in prompts:
        full = plain.generate([prompt], greedy)[0].token_ids
        stop = full[10]
        got = multi.generate([prompt], dataclasses.replace(greedy, stop_token_ids=[stop]))[0]
        assert got.token_ids == full[:full.index(stop) + 1] and got.finish_reason == "stop"
        for max_tokens in (1, 3, 13):
            got = multi.generate([prompt], dataclasses.replace(greedy, max_tokens=max_tokens))[0]
            assert got.token_ids == full[:max_tokens] and got.finish_reason == "length"
    assert_all_pages_free(multi)


def test_steps_are_cut_to_limits_and_free_pages_without_preemption():
    def scheduler_with(*requests):
        allocator = PageAllocator(num_pages=9, page_size=4)  # 8 usable pages
        scheduler = Scheduler(allocator, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                                      num_scheduler_steps=8), max_model_len=64)
        for request in requests:
            scheduler.add_request(request)
        scheduler.update(scheduler.schedule(), [50 + i for i in range(len(requests))])  # prompts computed
        return scheduler, allocator

    short = Request("short", list(range(3, 8)), SamplingParams(max_tokens=4))
    other = Request("other", list(range(3, 13)), SamplingParams(max_tokens=40))
    scheduler, _ = scheduler_with(short, other)
    plan = scheduler.schedule()
    assert plan.num_steps == 3 and plan.to_batch().num_steps == 3  # short may add 3 more tokens
    scheduler.update(plan, [[60, 61, 62], [70, 71, 72]])
    assert short.output_token_ids == [50, 60, 61, 62] and short.is_finished
    assert other.output_token_ids == [51, 70, 71, 72] and other.num_computed_tokens == 13

    # 10 + 15 prompt tokens hold 3 + 4 pages, 1 is free: 2 steps fit (a 3rd would need 2 pages).
    other = Request("other", list(range(3, 13)), SamplingParams(max_tokens=40))
    filler = Request("filler", list(range(3, 18)), SamplingParams(max_tokens=40))
    scheduler, allocator = scheduler_with(other, filler)
    assert allocator.num_free_pages == 1
    plan = scheduler.schedule()
    assert plan.num_steps == 2 and allocator.num_free_pages == 0 and scheduler.num_preemptions == 0


@pytest.mark.parametrize("change, message", [
    (dict(num_scheduler_steps=0), "num_scheduler_steps must be in"),
    (dict(num_scheduler_steps=65), "num_scheduler_steps must be in"),
])
def test_bad_step_counts_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        Scheduler(PageAllocator(8, 4), EngineConfig(**change), max_model_len=16)


def test_no_compilation_after_warmup_with_multi_step(params):
    seed = 24
    rng = np.random.default_rng(seed)
    prompts = random_prompts(rng, 20, 1, 100)
    sampling = mixed_sampling(rng, len(prompts))
    engine = make_engine(params, warmup=True, num_scheduler_steps=6, max_num_batched_tokens=32)
    with recorded_compilations() as compiles:
        outputs = run_staggered_mixed(engine, prompts, sampling)
    assert compiles == [], f"seed {seed}"
    assert all(outputs) and any(r.num_output_tokens > r.num_decode_rows for r in engine.step_records), f"seed {seed}"
    assert_all_pages_free(engine)
