"""Speculative decoding: proposers, verification steps, exactness (greedy and seeded), pages, compiles."""
import dataclasses

import numpy as np
import pytest
import scipy.stats

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.page_allocator import PageAllocator
from jaxserve.core.request import Request, RequestStatus, SamplingParams
from jaxserve.core.scheduler import Scheduler
from jaxserve.engine import Engine
from jaxserve.models import weights
from jaxserve.speculative import ngram, verification
from tests.test_engine import TINY, assert_all_pages_free, recorded_compilations, run_staggered_mixed

pytestmark = pytest.mark.slow  # engines (the host-side tests run with them): out of `make test-quick`

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# A smaller model with TINY's vocabulary: a draft that proposes badly.
SMALL_DRAFT = dataclasses.replace(TINY, num_layers=1, hidden_size=32, intermediate_size=48, num_q_heads=2,
                                  num_kv_heads=1)


@pytest.fixture(scope="module")
def params():
    return weights.random_params(TINY, seed=1)


@pytest.fixture(scope="module")
def draft_params():
    return weights.random_params(SMALL_DRAFT, seed=3)


def make_engine(params, proposer=None, draft_params=None, **overrides):
    """TINY with the given proposer: None, "ngram", "self" (the target as its own draft, which
    proposes what the target then draws) or "small" (a random one-layer draft)."""
    cfg = dict(max_num_seqs=8, max_num_batched_tokens=64, max_num_prefill_seqs=2, page_size=8,
               num_pages=96, max_model_len=256, warmup=False, num_speculative_tokens=4, prompt_lookup_min=1)
    cfg.update(overrides)
    draft = None
    if proposer == "ngram":
        cfg["speculative_method"] = "ngram"
    elif proposer in ("self", "small"):
        cfg.update(speculative_method="draft", speculative_model=proposer)
        draft = (TINY, params) if proposer == "self" else (SMALL_DRAFT, draft_params)
    return Engine(TINY, params, None, EngineConfig(**cfg), draft_model=draft)


def repetitive_prompts(rng, n, low=8, high=60):
    """Prompts of a repeated random phrase: the ngram proposer finds matches in them."""
    prompts = []
    for _ in range(n):
        phrase = rng.integers(3, TINY.vocab_size, rng.integers(3, 9)).tolist()
        prompts.append((phrase * 20)[:int(rng.integers(low, high))])
    return prompts


# ---- host side --------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = ngram.NgramProposer(min_n=1, max_n=3)
    # The suffix [7, 8] last occurred at index 5, followed by 1 2 3; [8] alone at 1 would give 9.
    assert proposer.propose_tokens([5, 8, 9, 4, 4, 7, 8, 1, 2, 3, 0, 7, 8], 3) == [1, 2, 3]
    assert proposer.propose_tokens([5, 8, 9, 4, 4, 7, 8, 1, 2, 3, 0, 7, 8], 10) == [1, 2, 3, 0, 7, 8]
    assert proposer.propose_tokens([1, 2, 3, 4], 3) == []  # nothing recurs
    assert ngram.NgramProposer(min_n=2, max_n=3).propose_tokens([1, 9, 2, 1], 3) == []  # [2, 1] is new
    assert proposer.propose_tokens([3, 3, 3], 2) == [3]  # the latest earlier match, then what follows it


def test_accepted_tokens_are_the_matching_draws_plus_one():
    assert verification.accepted_tokens([4, 5, 6], [4, 5, 9, 1]) == [4, 5, 9]
    assert verification.accepted_tokens([4, 5, 6], [4, 5, 6, 1]) == [4, 5, 6, 1]  # all, and the bonus draw
    assert verification.accepted_tokens([4, 5, 6], [8, 5, 6, 1]) == [8]
    assert verification.accepted_tokens([], [8]) == [8]


def decoding_request(scheduler, prompt_len=10, **params):
    """A request admitted, its prompt computed and one output token appended: decoding."""
    request = Request("r", list(range(3, 3 + prompt_len)), SamplingParams(**{"max_tokens": 20, **params}))
    scheduler.add_request(request)
    plan = scheduler.schedule()
    scheduler.update(plan, [50])
    assert request.num_tokens - request.num_computed_tokens == 1
    return request


def test_verification_step_takes_pages_for_proposals_and_returns_the_rejected_ones():
    allocator = PageAllocator(num_pages=16, page_size=4)
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, speculative_method="ngram",
                          num_speculative_tokens=6)
    scheduler = Scheduler(allocator, config, max_model_len=64)
    request = decoding_request(scheduler)  # 11 tokens, 10 computed: 3 pages
    assert len(request.page_ids) == 3
    request.spec_token_ids = [61, 62, 63, 64, 65, 66]
    plan = scheduler.schedule()
    assert plan.is_verify and plan.proposals == {"r": (61, 62, 63, 64, 65, 66)}
    batch = plan.to_batch()
    assert batch.verify[0].token_ids == (50, 61, 62, 63, 64, 65, 66) and batch.verify[0].start == 10
    assert len(request.page_ids) == 5  # positions 10 .. 16
    scheduler.update(plan, [[61, 62, 70, 0, 0, 0, 0]])  # two accepted, then the draw 70
    assert request.output_token_ids == [50, 61, 62, 70]
    assert request.num_computed_tokens == 13 and request.num_tokens == 14
    assert len(request.page_ids) == 4  # the page only the rejected proposals needed went back
    assert allocator.num_used_pages == 4
    assert scheduler.spec_stats.num_proposed_tokens == 6 and scheduler.spec_stats.num_accepted_tokens == 2
    assert scheduler.spec_stats.accepted_per_position == [1, 1, 0, 0, 0, 0]


def test_proposals_are_cut_to_the_request_limits_and_free_pages_never_by_preemption():
    allocator = PageAllocator(num_pages=5, page_size=4)  # 4 usable pages
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, speculative_method="ngram",
                          num_speculative_tokens=8)
    scheduler = Scheduler(allocator, config, max_model_len=64)
    request = decoding_request(scheduler, prompt_len=10, max_tokens=4)  # 1 output token; 3 more allowed
    request.spec_token_ids = [61, 62, 63, 64, 65]
    plan = scheduler.schedule()
    assert plan.proposals == {"r": (61, 62)}  # two proposals + the bonus draw = 3 tokens
    scheduler.update(plan, [[61, 62, 63]])
    assert request.output_token_ids == [50, 61, 62, 63] and request.status == RequestStatus.FINISHED_LENGTH

    request = decoding_request(scheduler, prompt_len=13, max_tokens=30)  # 14 tokens: all 4 pages
    request.spec_token_ids = [61, 62, 63, 64, 65]
    plan = scheduler.schedule()
    assert plan.proposals == {"r": (61, 62)}  # positions 13 .. 15: what the 4 pages hold
    assert scheduler.num_preemptions == 0


def test_no_verification_while_prompts_are_prefilled():
    allocator = PageAllocator(num_pages=32, page_size=4)
    config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, speculative_method="ngram")
    scheduler = Scheduler(allocator, config, max_model_len=64)
    request = decoding_request(scheduler)
    request.spec_token_ids = [61, 62]
    scheduler.add_request(Request("new", [5, 6, 7], SamplingParams(max_tokens=3)))
    plan = scheduler.schedule()
    assert not plan.is_verify and plan.decode == [request] and len(plan.prefill) == 1


# ---- the engine -------------------------------------------------------------------------------
@pytest.mark.parametrize("proposer", ["ngram", "self", "small"])
def test_greedy_output_is_unchanged_with_staggered_arrivals_chunks_preemption_and_prefix_caching(
        params, draft_params, proposer):
    seed = 11
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, TINY.vocab_size, 16).tolist()  # a common prefix: prefix-cache hits
    prompts = [shared + p if i % 2 else p for i, p in enumerate(repetitive_prompts(rng, 12, 8, 70))]
    sampling = [dataclasses.replace(GREEDY, max_tokens=int(rng.integers(1, 40))) for _ in prompts]
    reference = run_staggered_mixed(make_engine(params), prompts, sampling)
    # Few pages: preemption; a small token budget: prompts in chunks.
    engine = make_engine(params, proposer, draft_params, num_pages=28, max_num_batched_tokens=24)
    outputs = run_staggered_mixed(engine, prompts, sampling)
    assert outputs == reference, f"seed {seed}"
    stats = engine.stats()
    assert engine.scheduler.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0, f"seed {seed}"
    assert stats.spec_verify_steps > 0 and stats.spec_proposed_tokens > 0, f"seed {seed}"
    if proposer == "self":  # the target proposes what it then draws
        assert stats.spec_accepted_tokens >= 0.9 * stats.spec_proposed_tokens, f"seed {seed}"
    if proposer == "small":
        assert stats.spec_accepted_tokens < stats.spec_proposed_tokens, f"seed {seed}"
    assert_all_pages_free(engine)


@pytest.mark.parametrize("proposer", ["ngram", "self"])
def test_seeded_sampling_gives_the_same_tokens_with_and_without_speculation(params, draft_params, proposer):
    """Each emitted token is the target's draw with the key of its output step: the same output."""
    seed = 12
    rng = np.random.default_rng(seed)
    prompts = repetitive_prompts(rng, 10)
    sampling = [SamplingParams(max_tokens=20, temperature=float(rng.choice([0.7, 1.0])), seed=int(rng.integers(1e6)),
                               top_k=int(rng.choice([0, 8])), top_p=float(rng.choice([1.0, 0.9])),
                               min_p=float(rng.choice([0.0, 0.05])),
                               repetition_penalty=float(rng.choice([1.0, 1.3])),
                               frequency_penalty=float(rng.choice([0.0, 0.5])),
                               min_tokens=int(rng.integers(0, 5)), logit_bias={7: 3.0} if i % 3 == 0 else None,
                               ignore_eos=bool(i % 2)) for i in range(len(prompts))]
    reference = run_staggered_mixed(make_engine(params), prompts, sampling)
    engine = make_engine(params, proposer, draft_params)
    assert run_staggered_mixed(engine, prompts, sampling) == reference, f"seed {seed}"
    stats = engine.stats()
    assert stats.spec_proposed_tokens > 0, f"seed {seed}"
    if proposer == "self":  # the draft draws with the target's keys: it proposes the target's draws
        assert stats.spec_accepted_tokens >= 0.9 * stats.spec_proposed_tokens, f"seed {seed}"
    assert_all_pages_free(engine)


def test_stop_tokens_and_max_tokens_inside_accepted_proposals(params):
    """A stop token among a step's accepted tokens ends the request there; the draws after it are dropped."""
    rng = np.random.default_rng(13)
    prompts = repetitive_prompts(rng, 6, 20, 50)
    base = make_engine(params)
    spec = make_engine(params, "self")
    for prompt in prompts:
        full = base.generate([prompt], GREEDY)[0].token_ids
        stop = full[9]
        params_stop = dataclasses.replace(GREEDY, stop_token_ids=[stop])
        expected = base.generate([prompt], params_stop)[0]
        got = spec.generate([prompt], params_stop)[0]
        assert got.token_ids == expected.token_ids == full[:full.index(stop) + 1]
        assert got.finish_reason == expected.finish_reason == "stop"
        for max_tokens in (1, 2, 7):
            assert spec.generate([prompt], dataclasses.replace(GREEDY, max_tokens=max_tokens))[0].token_ids == \
                full[:max_tokens]
    assert spec.stats().spec_accepted_tokens > 0
    assert_all_pages_free(spec)


def test_logprobs_of_accepted_tokens_match_plain_decoding(params):
    prompt = repetitive_prompts(np.random.default_rng(14), 1, 30, 31)[0]
    sp = dataclasses.replace(GREEDY, max_tokens=12, logprobs=3)
    expected = make_engine(params).generate([prompt], sp)[0]
    engine = make_engine(params, "self")
    got = engine.generate([prompt], sp)[0]
    assert engine.stats().spec_accepted_tokens > 0
    assert got.token_ids == expected.token_ids
    for a, b in zip(got.logprobs, expected.logprobs):
        assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
        np.testing.assert_allclose([a.logprob] + [lp for _, lp in a.top], [b.logprob] + [lp for _, lp in b.top],
                                   atol=1e-4)


def test_no_compilation_after_warmup_with_speculation(params, draft_params):
    seed = 15
    rng = np.random.default_rng(seed)
    prompts = repetitive_prompts(rng, 20, 4, 90)
    sampling = [SamplingParams(max_tokens=int(rng.integers(1, 30)), temperature=float(rng.choice([0.0, 0.8])),
                               seed=i, repetition_penalty=1.2 if i % 4 == 0 else 1.0,
                               logit_bias={5: 1.0} if i % 5 == 0 else None, logprobs=2 if i % 3 == 0 else None,
                               ignore_eos=True) for i in range(len(prompts))]
    for proposer in ("ngram", "small"):
        engine = make_engine(params, proposer, draft_params, warmup=True, max_num_batched_tokens=48)
        with recorded_compilations() as compiles:
            outputs = run_staggered_mixed(engine, prompts, sampling)
        assert compiles == [], f"{proposer}, seed {seed}"
        assert all(outputs) and engine.stats().spec_verify_steps > 0, f"{proposer}, seed {seed}"
        kinds = {record.kind for record in engine.step_records}
        assert "verify" in kinds and "decode" in kinds, f"{proposer}, seed {seed}"
        assert_all_pages_free(engine)


def test_no_speculation_in_steps_with_more_running_sequences_than_speculative_disable_by_batch_size(params):
    """With the bound at 2, a step of 3 or 4 running sequences decodes plainly and one of 1 or 2
    verifies; without it the same requests verify at 3 and 4 too (so the bound is what stops them)."""
    seed = 17
    rng = np.random.default_rng(seed)
    prompts = repetitive_prompts(rng, 4, 30, 40)
    sampling = [dataclasses.replace(GREEDY, max_tokens=n) for n in (8, 16, 24, 32)]  # they end one after another

    def run(bound):
        engine = make_engine(params, "ngram", speculative_disable_by_batch_size=bound)
        outputs = engine.generate(prompts, sampling)
        rows = {kind: {r.num_decode_rows for r in engine.step_records if r.kind == kind}
                for kind in ("decode", "verify")}
        assert_all_pages_free(engine)
        return [o.token_ids for o in outputs], rows

    unbounded, unbounded_rows = run(None)
    assert max(unbounded_rows["verify"]) > 2, f"seed {seed}: {unbounded_rows}"
    bounded, rows = run(2)
    assert rows["verify"] and max(rows["verify"]) <= 2, f"seed {seed}: {rows}"
    assert {3, 4} <= rows["decode"], f"seed {seed}: {rows}"  # such steps ran, without speculation
    assert bounded == unbounded


# ---- the distribution ----------------------------------------------------------------------
SMALL_VOCAB = ModelConfig(vocab_size=12, hidden_size=32, intermediate_size=48, num_layers=2, num_q_heads=2,
                          num_kv_heads=1, head_dim=16, max_position_embeddings=128)


def _truncated(logprobs: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """The sampling distribution of raw logprobs (temperature 1) after top-k then top-p."""
    probs = np.exp(logprobs - logprobs.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(len(probs), bool)
    keep[order[:top_k or len(probs)]] = True
    kept = np.where(keep, probs, 0.0) / probs[keep].sum()
    mass_before = np.cumsum(kept[order]) - kept[order]
    nucleus = np.zeros(len(probs), bool)
    nucleus[order[(mass_before < top_p) & (kept[order] > 0)]] = True
    out = np.where(nucleus, kept, 0.0)
    return out / out.sum()


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 0.8)])
def test_sampled_tokens_follow_the_target_distribution(top_k, top_p):
    """Chi-square: the second and third output tokens over many seeds, with a random draft (its
    proposals are accepted sometimes, rejected sometimes), against the target's exact distribution
    of the second token and, after the most frequent pair, of the third."""
    seed = 16
    target_params = weights.random_params(SMALL_VOCAB, seed=4)
    draft_config = dataclasses.replace(SMALL_VOCAB, num_layers=1)
    cfg = dict(max_num_seqs=32, max_num_batched_tokens=128, max_num_prefill_seqs=8, page_size=4, num_pages=512,
               max_model_len=32, warmup=False, max_logprobs=SMALL_VOCAB.vocab_size)
    engine = Engine(SMALL_VOCAB, target_params, None, EngineConfig(
        **cfg, speculative_method="draft", speculative_model="draft", num_speculative_tokens=2),
        draft_model=(draft_config, weights.random_params(draft_config, seed=5)))
    plain = Engine(SMALL_VOCAB, target_params, None, EngineConfig(**cfg))
    prompt = [1, 5, 7, 2]
    num_samples = 1504
    sampling = SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, top_p=top_p, ignore_eos=True)
    results = []
    for batch in range(0, num_samples, 32):  # a batch at a time: its decode steps all verify
        results += engine.generate([prompt] * 32, [dataclasses.replace(sampling, seed=seed * 10**6 + i)
                                                   for i in range(batch, batch + 32)])
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_proposed_tokens, f"seed {seed}"

    def distribution(context):
        [out] = plain.generate([context], dataclasses.replace(sampling, max_tokens=1, logprobs=SMALL_VOCAB.vocab_size))
        logprobs = np.full(SMALL_VOCAB.vocab_size, -np.inf)
        for token_id, logprob in out.logprobs[0].top:
            logprobs[token_id] = logprob
        return _truncated(logprobs, top_k, top_p)

    tokens = np.array([r.token_ids for r in results])  # [samples, 3]
    first = distribution(prompt)
    second = sum(first[t] * distribution(prompt + [t]) for t in range(SMALL_VOCAB.vocab_size) if first[t] > 0)
    pair_counts = {}
    for t1, t2, _ in tokens:
        pair_counts[t1, t2] = pair_counts.get((t1, t2), 0) + 1
    pair = max(pair_counts, key=pair_counts.get)
    after_pair = tokens[(tokens[:, 0] == pair[0]) & (tokens[:, 1] == pair[1]), 2]
    for observed, expected in ((tokens[:, 1], second), (after_pair, distribution(prompt + [int(t) for t in pair]))):
        counts = np.bincount(observed, minlength=SMALL_VOCAB.vocab_size)
        assert counts[expected == 0].sum() == 0, f"seed {seed}: a token outside the target's support"
        cells = expected > 0
        _, p_value = scipy.stats.chisquare(counts[cells], expected[cells] * len(observed))
        assert p_value > 1e-3, f"seed {seed}: chi-square p = {p_value:.2g}"


# ---- SmolLM2, the CLI and /metrics ------------------------------------------------------------
COPY_PROMPTS = [
    "Repeat this sentence exactly: the lighthouse keeper counted forty ships before the storm reached the bay.",
    "Fix the typo and return the whole function:\ndef add_numbers(a, b):\n    retrun a + b\n",
    "Quote the first line of this poem, then explain it: 'Snow falls on the quiet hill, / the river holds its breath.'",
]


def test_smollm2_greedy_output_is_unchanged_on_real_prompts():
    import jax.numpy as jnp

    from checkpoints import default_model, load
    from serve.prompts import encode_chat
    model_dir = default_model.resolve_model("smollm2")
    config, tokenizer = load.load_config(model_dir), load.load_tokenizer(model_dir)
    params = load.load_params(model_dir, jnp.float32)
    prompts = [encode_chat(tokenizer, [{"role": "user", "content": text}]) for text in COPY_PROMPTS]
    greedy = SamplingParams(max_tokens=40, temperature=0.0)
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=128, num_pages=64, max_model_len=256, warmup=False)
    plain = Engine(config, params, tokenizer, EngineConfig(**cfg))
    spec = Engine(config, params, tokenizer, EngineConfig(**cfg, speculative_method="ngram", num_speculative_tokens=4))
    expected = plain.generate(prompts, greedy)
    got = spec.generate(prompts, greedy)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    assert [r.text for r in got] == [r.text for r in expected]
    stats = spec.stats()
    assert stats.spec_accepted_tokens > 0.3 * stats.spec_proposed_tokens  # copying: most proposals hold
    assert_all_pages_free(spec)


def test_generate_cli_speculates_and_reports_the_acceptance_rate(tiny_chat_model_dir, tmp_path, capsys):
    from tests.test_generate_cli import generate, write_lines
    inp = write_lines(tmp_path / "in.jsonl", ['{"id": 1, "prompt": "a b c a b c a b c a b c"}'])
    out = tmp_path / "out.jsonl"
    assert generate(tiny_chat_model_dir, inp, out, "--max_tokens=12", "--ignore_eos") == 0
    expected = out.read_text()
    # The model as its own draft (loaded from --speculative_model): every proposal is accepted.
    out.unlink()
    assert generate(tiny_chat_model_dir, inp, out, "--max_tokens=12", "--ignore_eos", "--speculative_method=draft",
                    f"--speculative_model={tiny_chat_model_dir}", "--num_speculative_tokens=3") == 0
    assert out.read_text() == expected
    err = capsys.readouterr().err
    assert "speculative decoding:" in err and "proposed tokens accepted (100.0%)" in err
    assert generate(tiny_chat_model_dir, inp, tmp_path / "out2.jsonl", "--speculative_method=draft") == 2
    assert "needs speculative_model" in capsys.readouterr().err


def test_metrics_count_proposed_and_accepted_tokens():
    from prometheus_client import generate_latest

    from jaxserve.core.outputs import EngineStats
    from serve.metrics import ServerMetrics
    stats = EngineStats(num_running=0, num_waiting=0, kv_pages_used=0, kv_pages_total=10, num_preemptions=0,
                        prefix_cache_queried_tokens=0, prefix_cache_hit_tokens=0, spec_verify_steps=5,
                        spec_proposed_tokens=20, spec_accepted_tokens=7, spec_accepted_per_position=(4, 2, 1, 0))
    text = generate_latest(ServerMetrics(lambda: stats, "m").registry).decode()
    assert 'jaxserve_spec_decode_num_draft_tokens_total{model_name="m"} 20.0' in text
    assert 'jaxserve_spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text
    assert 'jaxserve_spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0' in text


def test_streaming_through_the_server_with_speculation():
    """Several tokens per delta reach the client as the same text, logprobs and usage as without."""
    import openai

    from checkpoints import default_model, load
    from tests.test_server_engine import LiveServer
    tokenizer = load.load_tokenizer(default_model.resolve_model("smollm2"))
    config = ModelConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_layers=2,
                         num_q_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                         eos_token_ids=(tokenizer.eos_token_id,))
    model_params = weights.random_params(config, seed=3)
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, num_pages=128, max_model_len=256,
               warmup=False)
    plain = Engine(config, model_params, tokenizer, EngineConfig(**cfg))
    spec = Engine(config, model_params, tokenizer, EngineConfig(**cfg, speculative_method="draft",
                                                                 speculative_model="self", num_speculative_tokens=4),
                  draft_model=(config, model_params))
    prompt = "The quick brown fox jumps over the lazy dog"
    expected = plain.generate([plain.tokenizer.encode(prompt)], SamplingParams(max_tokens=24, temperature=0.0,
                                                                               ignore_eos=True, logprobs=2))[0]
    server = LiveServer(spec)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
        chunks = list(client.completions.create(model="model", prompt=prompt, max_tokens=24, temperature=0.0,
                                                stream=True, logprobs=2, extra_body={"ignore_eos": True},
                                                stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert text == expected.text and len(tokens) == 24
        assert chunks[-1].usage.completion_tokens == 24
        stop = expected.text[len(expected.text) // 2:len(expected.text) // 2 + 4]
        stopped = client.completions.create(model="model", prompt=prompt, max_tokens=24, temperature=0.0, stop=[stop],
                                            extra_body={"ignore_eos": True})
        assert stopped.choices[0].text == expected.text[:expected.text.index(stop)]
        assert stopped.choices[0].finish_reason == "stop"
        assert server.metric("jaxserve_spec_decode_num_accepted_tokens_total") > 0
    finally:
        server.close()
    assert_all_pages_free(spec)
