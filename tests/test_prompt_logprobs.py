"""Prompt logprobs (vLLM's prompt_logprobs, completions' echo) against transformers' log_softmax of
the same tiny model: in one chunk, across chunked prefill, past the per-step row limit, with the
prefix cache on and through preemption."""
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from checkpoints.convert import convert_checkpoint
from checkpoints.load import load_config, load_params
from jaxserve.core.request import InvalidRequestError, SamplingParams
from jaxserve.core.step import MAX_PROMPT_LOGPROB_ROWS
from jaxserve.engine import Engine, EngineConfig
from tests.tiny_models import hf_logits, make_tiny_hf_model

pytestmark = pytest.mark.slow  # engines: out of `make test-quick`

# float32 on both sides; jax and torch sum in different orders: logits differ by ~1e-6, logprobs
# (after log_softmax over 128 tokens) by at most ~1e-5. A wrong row or target is off by >= 0.01.
ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompt_logprobs")
    model = make_tiny_hf_model(str(path / "hf"), vocab_size=128, seed=5)
    with torch.no_grad():  # spread the logits (a random head gives near-uniform ones): ranks and top-k mean something
        model.lm_head.weight.mul_(40.0)
    model.save_pretrained(str(path / "hf"), safe_serialization=True)
    convert_checkpoint(str(path / "hf"), str(path / "converted"))
    return model, load_config(str(path / "converted")), load_params(str(path / "converted"), jnp.float32)


def make_engine(tiny, **overrides):
    _, config, params = tiny
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=64, max_num_prefill_seqs=2, page_size=8, num_pages=200,
               max_model_len=256, warmup=False, enable_prefix_caching=False)
    cfg.update(overrides)
    return Engine(config, params, None, EngineConfig(**cfg))


def reference(model, prompt):
    """transformers' log_softmax for prompt tokens 1..: [len - 1, vocab] (float64)."""
    logits = hf_logits(model, np.asarray([prompt]))[0].astype(np.float64)  # [len, vocab]
    logits = logits - logits.max(-1, keepdims=True)
    return (logits - np.log(np.exp(logits).sum(-1, keepdims=True)))[:-1]


def assert_matches(model, prompt, entries, k, label):
    expected = reference(model, prompt)
    assert [e.token_id for e in entries] == list(prompt[1:]), label
    for i, entry in enumerate(entries):
        row = expected[i]
        target = prompt[i + 1]
        assert entry.logprob == pytest.approx(row[target], abs=ATOL), (label, i)
        # rank: 1 + tokens above the target (a token within ATOL of it may count either way)
        assert 1 + np.sum(row > row[target] + ATOL) <= entry.rank <= 1 + np.sum(row > row[target] - ATOL), (label, i)
        assert len(entry.top) == k, (label, i)
        ids = [t for t, _ in entry.top]
        values = [lp for _, lp in entry.top]
        np.testing.assert_allclose(values, np.sort(row)[::-1][:k], atol=ATOL, err_msg=f"{label} {i}")  # the k best
        np.testing.assert_allclose(row[ids], values, atol=ATOL, err_msg=f"{label} {i}")  # of those very tokens
        assert len(set(ids)) == k, (label, i)


def run(engine, requests, arrivals_per_step=2):
    """Adds (id, prompt, params) a few per step while others run; returns {id: FinishedRequest-like}."""
    pending, outputs = list(requests), {}
    while pending or engine.has_unfinished():
        for _ in range(arrivals_per_step):
            if pending:
                request_id, prompt, params = pending.pop(0)
                engine.add_request(request_id, prompt, params)
        for out in engine.step():
            record = outputs.setdefault(out.request_id, {"tokens": [], "prompt_logprobs": None, "deltas": 0})
            record["tokens"] += out.new_token_ids
            if out.prompt_logprobs is not None:
                assert record["prompt_logprobs"] is None, "prompt logprobs are sent once"
                record["prompt_logprobs"] = out.prompt_logprobs
            if out.finished:
                record["finish_reason"] = out.finish_reason
                record["num_cached_tokens"] = out.num_cached_tokens
    assert engine.allocator.num_used_pages == 0
    return outputs


def mixed_requests(rng, count, low, high, vocab=128):
    """Prompts of random lengths; most want prompt logprobs (k 0, 1 or 5), some do not; max_tokens 0, 1 or 4."""
    requests = []
    for i in range(count):
        prompt = rng.integers(3, vocab, int(rng.integers(low, high))).tolist()
        k = [None, 0, 1, 5][i % 4]
        max_tokens = [0, 1, 4][i % 3] if k is not None else 3
        requests.append((f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=k,
                                                         ignore_eos=True)))
    return requests


@pytest.mark.parametrize("name,overrides,low,high", [
    ("one chunk", dict(max_num_batched_tokens=256), 2, 120),
    ("chunked prefill", dict(max_num_batched_tokens=13), 2, 120),
    ("row limit", dict(max_num_batched_tokens=512, max_model_len=256), 150, 250),
    ("preemption", dict(max_num_batched_tokens=24, num_pages=14), 40, 90),
])
def test_prompt_logprobs_match_transformers(tiny, name, overrides, low, high):
    seed = 7
    model = tiny[0]
    requests = mixed_requests(np.random.default_rng(seed), 10, low, high)
    engine = make_engine(tiny, **overrides)
    outputs = run(engine, requests)
    for request_id, prompt, params in requests:
        record = outputs[request_id]
        if params.prompt_logprobs is None:
            assert record["prompt_logprobs"] is None, (name, request_id)
            continue
        assert_matches(model, prompt, record["prompt_logprobs"], params.prompt_logprobs, f"{name} {request_id} seed {seed}")
        assert len(record["tokens"]) == params.max_tokens, (name, request_id)
        assert record["finish_reason"] == "length"
    if name == "preemption":
        assert engine.scheduler.num_preemptions > 0, f"seed {seed}"
    if name == "row limit":  # two 150+ token prompts cannot both be computed in one step
        assert engine.scheduler.max_prompt_logprob_rows == MAX_PROMPT_LOGPROB_ROWS
        assert max(r.num_prefill_tokens for r in engine.step_records) <= 512


def test_a_cached_prefix_is_recomputed_for_prompt_logprobs(tiny):
    """A request that wants prompt logprobs does not take the prefix cache's pages (they have no
    logits): it computes its whole prompt, exact; requests without them still hit the cache."""
    seed = 8
    model = tiny[0]
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 128, 48).tolist()  # 6 full pages of 8
    prompts = [shared + rng.integers(3, 128, 10).tolist() for _ in range(3)]
    engine = make_engine(tiny, enable_prefix_caching=True)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = run(engine, [("warm", prompts[0], greedy)])
    wanting = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    outputs = run(engine, [("with", prompts[1], wanting), ("without", prompts[2], greedy)], arrivals_per_step=1)
    assert outputs["with"]["num_cached_tokens"] == 0, f"seed {seed}"
    assert outputs["without"]["num_cached_tokens"] == 48, f"seed {seed}"
    assert_matches(model, prompts[1], outputs["with"]["prompt_logprobs"], 3, f"seed {seed}")
    # The same prompt again, now fully cached: still computed, still exact, same greedy tokens.
    again = run(engine, [("again", prompts[0], wanting)])["again"]
    assert again["num_cached_tokens"] == 0 and again["tokens"] == first["warm"]["tokens"]
    assert_matches(model, prompts[0], again["prompt_logprobs"], 3, f"seed {seed}")


def test_the_sampled_token_logprob_is_the_prompt_logprob_of_the_same_token(tiny):
    """The sampler's logprob of a greedy token equals the prompt path's logprob of that token as
    the next prompt token (two device functions, one head); and asking for prompt logprobs does
    not change the greedy output."""
    seed = 9
    prompt = np.random.default_rng(seed).integers(3, 128, 30).tolist()
    engine = make_engine(tiny)
    plain = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2))[0]
    with_prompt = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True,
                                                           prompt_logprobs=2))[0]
    assert with_prompt.token_ids == plain.token_ids, f"seed {seed}"
    extended = engine.generate([prompt + plain.token_ids[:1]],
                               SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert extended.token_ids == [] and extended.finish_reason == "length"
    last = extended.prompt_logprobs[-1]
    assert last.token_id == plain.token_ids[0] and last.rank == 1
    assert last.logprob == pytest.approx(plain.logprobs[0].logprob, abs=1e-5)
    assert [t for t, _ in last.top] == [t for t, _ in plain.logprobs[0].top]
    np.testing.assert_allclose([lp for _, lp in last.top], [lp for _, lp in plain.logprobs[0].top], atol=1e-5)


def test_admission_bounds_of_prompt_logprobs(tiny):
    engine = make_engine(tiny, max_logprobs=5)
    prompt = [5, 6, 7]
    cases = [(SamplingParams(prompt_logprobs=6), "prompt_logprobs"),
             (SamplingParams(prompt_logprobs=-1), "prompt_logprobs"),
             (SamplingParams(prompt_logprobs=True), "prompt_logprobs"),
             (SamplingParams(max_tokens=0), "max_tokens")]
    for params, param in cases:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request("bad", prompt, params)
        assert info.value.param == param
    engine.add_request("ok", prompt, SamplingParams(max_tokens=0, prompt_logprobs=5))
    assert not engine.step()[0].new_token_ids
    assert engine.allocator.num_used_pages == 0


def test_a_prompt_that_fills_the_context_runs_with_max_tokens_0(tiny):
    """echo with max_tokens 0 (the prompt's logprobs alone) may use the whole context; a completion may not."""
    model, _, _ = tiny
    engine = make_engine(tiny, max_model_len=64)
    prompt = np.random.default_rng(3).integers(3, 128, 64).tolist()
    result = engine.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=1))[0]
    assert result.token_ids == [] and len(result.prompt_logprobs) == 63
    assert_matches(model, prompt, result.prompt_logprobs, 1, "full context")
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("x", prompt, SamplingParams(max_tokens=1))
    assert info.value.param == "prompt"
    assert engine.allocator.num_used_pages == 0
