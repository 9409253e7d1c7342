"""Engine: continuous batching, preemption, prefix caching, compile count, seeded sampling, failed steps."""
import contextlib
import re
import time

import numpy as np
import pytest
from jax import monitoring

from jaxserve.config import ModelConfig
from jaxserve.core.request import SamplingParams
from jaxserve.engine import Engine, EngineConfig
from jaxserve.executor import sampler
from jaxserve.models import weights

pytestmark = pytest.mark.slow  # engines: out of `make test-quick`

TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2,
                   num_q_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                   eos_token_ids=(2,))
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def params():
    return weights.random_params(TINY, seed=1)


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


@contextlib.contextmanager
def recorded_compilations():
    """The list of jax's compile events (tracing included: any new shape, even one the persistent
    cache then serves) while the block runs."""
    events = []

    def listener(event, duration, **kwargs):
        if event in ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration"):
            events.append(event)

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        monitoring.unregister_event_duration_listener(listener)


def assert_all_pages_free(engine):
    assert engine.allocator.num_used_pages == 0
    assert not engine.has_unfinished()


def test_batch_invariance_with_staggered_arrivals_and_odd_chunks(params):
    seed = 0
    rng = np.random.default_rng(seed)
    prompts = random_prompts(rng, 10)
    reference = run_alone(make_engine(params, enable_prefix_caching=False), prompts)
    engine = make_engine(params, max_num_batched_tokens=13, enable_prefix_caching=False)
    assert run_staggered(engine, prompts) == reference, f"seed {seed}"
    assert_all_pages_free(engine)


def test_a_prompt_mostly_padding_in_its_bucket_runs_as_a_smaller_bucket_then_the_rest(params):
    seed = 5
    prompt = np.random.default_rng(seed).integers(3, TINY.vocab_size, 140).tolist()
    # Prefill buckets 256, 512: nothing smaller to cut 140 tokens to.
    uncut = make_engine(params, max_num_batched_tokens=512, prefill_buckets="256,512", enable_prefix_caching=False)
    expected = uncut.generate([prompt], GREEDY)[0].token_ids
    # 32, 64, .. 512: 128 tokens, then 12 in the 32-token bucket, 96 fewer than 256.
    engine = make_engine(params, max_num_batched_tokens=512, enable_prefix_caching=False)
    assert engine.generate([prompt], GREEDY)[0].token_ids == expected, f"seed {seed}"
    prefill = [(r.num_prefill_tokens, r.bucket_prefill_tokens) for r in engine.step_records if r.num_prefill_tokens]
    assert prefill == [(128, 128), (12, 32)]
    assert [(r.num_prefill_tokens, r.bucket_prefill_tokens)
            for r in uncut.step_records if r.num_prefill_tokens] == [(140, 256)]
    assert_all_pages_free(engine)


def test_preemption_keeps_outputs(params):
    seed = 1
    rng = np.random.default_rng(seed)
    prompts = random_prompts(rng, 8, 20, 50)
    params_long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ample = make_engine(params, enable_prefix_caching=False)
    expected = [r.token_ids for r in ample.generate(prompts, params_long)]
    tight = make_engine(params, num_pages=20, enable_prefix_caching=False)  # 19 usable pages of 8
    got = [r.token_ids for r in tight.generate(prompts, params_long)]
    assert got == expected, f"seed {seed}"
    assert tight.scheduler.num_preemptions > 0, f"seed {seed}"
    assert ample.scheduler.num_preemptions == 0
    assert_all_pages_free(tight)


def test_prefix_caching_same_outputs_and_shared_prefix_computed_once(params):
    seed = 2
    rng = np.random.default_rng(seed)
    system = rng.integers(3, TINY.vocab_size, 40).tolist()  # 5 full pages of 8
    prompts = [system + rng.integers(3, TINY.vocab_size, rng.integers(1, 10)).tolist() for _ in range(6)]
    off = make_engine(params, enable_prefix_caching=False)
    on = make_engine(params, enable_prefix_caching=True)
    expected = run_alone(off, prompts)
    assert run_alone(on, prompts) == expected, f"seed {seed}"
    computed_off = off.num_computed_tokens
    computed_on = on.num_computed_tokens
    # Every request after the first reuses the 40 cached system-prompt tokens.
    assert computed_off - computed_on == 40 * (len(prompts) - 1), f"seed {seed}"
    assert on.stats().prefix_cache_hit_tokens == 40 * (len(prompts) - 1), f"seed {seed}"
    assert_all_pages_free(on)


@pytest.mark.parametrize("warmup", [True, False])
def test_no_compilation_after_warmup(params, warmup):
    engine = make_engine(params, warmup=warmup, max_num_seqs=8, max_num_batched_tokens=32)
    seed = 3
    with recorded_compilations() as compiles:
        rng = np.random.default_rng(seed)
        prompts = random_prompts(rng, 50, 1, 120)
        sampling = []
        for _ in prompts:  # every sampler variant: with and without penalties; logit biases, min_tokens masks
            max_tokens = int(rng.integers(1, 40))
            sampling.append(SamplingParams(
                max_tokens=max_tokens, temperature=float(rng.choice([0.0, 0.8])), top_k=int(rng.choice([0, 5])),
                top_p=float(rng.choice([1.0, 0.9])), logprobs=int(rng.choice([0, 3])) if rng.random() < 0.3 else None,
                repetition_penalty=1.2 if rng.random() < 0.2 else 1.0, ignore_eos=bool(rng.random() < 0.7),
                logit_bias={int(rng.integers(3, 256)): float(rng.choice([-5.0, 5.0]))} if rng.random() < 0.2 else None,
                min_tokens=int(rng.integers(0, min(max_tokens, 4)))))
        run_step, variants = engine.runner.run_step, set()

        def recording_run_step(bucket, arrays, inputs, *args, **kwargs):
            variants.add((sampler.has_histories(inputs), sampler.has_bias(inputs)))
            return run_step(bucket, arrays, inputs, *args, **kwargs)
        engine.runner.run_step = recording_run_step
        results = run_staggered_mixed(engine, prompts, sampling)
    assert all(r for r in results), f"seed {seed}"
    assert variants == {(False, True), (True, True)}, f"seed {seed}"  # the bias stage always runs (sampler.ALWAYS_BIAS)
    if warmup:
        assert compiles == [], f"seed {seed}"
    else:  # the counter sees compilations when there was no warm-up
        assert compiles, f"seed {seed}"
    assert_all_pages_free(engine)


def test_no_compilation_after_warmup_with_grammar_and_prompt_logprob_rows():
    """Structured-output rows (their bitmasks), prompt-logprob rows (any count up to the step's
    limit), logprobs and penalties in every mix: all served by the warmed-up shapes."""
    from checkpoints import default_model, load
    from jaxserve.core.structured_output import StructuredOutputParams
    tokenizer = load.load_tokenizer(default_model.resolve_model("smollm2"))
    config = ModelConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, num_layers=1,
                         num_q_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=256,
                         eos_token_ids=(tokenizer.eos_token_id,))
    engine = Engine(config, weights.random_params(config, seed=2), tokenizer, EngineConfig(
        max_num_seqs=8, max_num_batched_tokens=32, max_num_prefill_seqs=2, page_size=8, num_pages=64,
        max_model_len=128, warmup=True, warmup_prompt_logprobs=True))  # prompt-logprob shapes at start too
    constraints = [StructuredOutputParams("regex", "[a-z]{1,12}", "guided_regex"),
                   StructuredOutputParams("choice", ["red", "green"], "guided_choice"),
                   StructuredOutputParams("json_schema", {"type": "array", "items": {"type": "integer"},
                                                          "maxItems": 3}, "guided_json")]
    seed = 13
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, 1000, rng.integers(1, 100)).tolist() for _ in range(30)]
    sampling = [SamplingParams(
        max_tokens=int(rng.integers(0 if i % 5 == 0 else 1, 20)), temperature=float(rng.choice([0.0, 1.0])),
        structured_output=constraints[i % 4] if i % 4 < 3 and i % 5 else None,
        prompt_logprobs=int(rng.choice([0, 3])) if i % 5 == 0 or rng.random() < 0.3 else None,
        logprobs=int(rng.choice([0, 2])) if rng.random() < 0.3 else None,
        repetition_penalty=float(rng.choice([1.0, 1.1])), ignore_eos=True) for i in range(len(prompts))]
    outputs = {i: {"tokens": [], "prompt_logprobs": None} for i in range(len(prompts))}
    pending = list(enumerate(zip(prompts, sampling)))
    with recorded_compilations() as compiles:
        while pending or engine.has_unfinished():
            for _ in range(3):
                if pending:
                    i, (p, sp) = pending.pop(0)
                    engine.add_request(str(i), p, sp)
            for out in engine.step():
                outputs[int(out.request_id)]["tokens"] += out.new_token_ids
                if out.prompt_logprobs is not None:
                    outputs[int(out.request_id)]["prompt_logprobs"] = out.prompt_logprobs
                if out.finished:
                    outputs[int(out.request_id)]["finish_reason"] = out.finish_reason
    assert compiles == [], f"seed {seed}"
    for i, (prompt, params) in enumerate(zip(prompts, sampling)):  # the mix did happen
        out = outputs[i]
        assert out["finish_reason"] in ("stop", "length"), (i, seed)
        if params.prompt_logprobs is not None:
            assert len(out["prompt_logprobs"]) == len(prompt) - 1, (i, seed)
        if params.structured_output is not None and params.structured_output.kind == "regex":
            assert re.fullmatch("[a-z]{0,12}", tokenizer.decode(out["tokens"], skip_special_tokens=True)), (i, seed)
    assert sum(p.structured_output is not None for p in sampling) >= 10
    assert sum(p.prompt_logprobs is not None for p in sampling) >= 6
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
    seed = 4
    rng = np.random.default_rng(seed)
    prompts = random_prompts(rng, 4)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    engine = make_engine(params)
    alone = run_alone(engine, prompts, seeded)
    together = [r.token_ids for r in engine.generate(prompts, seeded)]
    assert together == alone, f"seed {seed}"
    other_seed = SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    assert run_alone(engine, prompts, other_seed) != alone, f"seed {seed}"


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


def test_the_finished_delta_carries_the_phase_times_of_its_request(params):
    engine = make_engine(params, max_num_seqs=1)  # b waits for a to finish; c is aborted while it waits
    for request_id in "abc":
        engine.add_request(request_id, list(range(3, 13)), SamplingParams(max_tokens=4, temperature=0.0,
                                                                           ignore_eos=True))
    finished = {"c": engine.abort("c")}
    while engine.has_unfinished():
        for out in engine.step():
            assert (out.metrics is not None) == out.finished
            if out.finished:
                finished[out.request_id] = out
    a, b, c = (finished[r].metrics for r in "abc")
    for m in (a, b):
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.inference_seconds == pytest.approx(m.prefill_seconds + m.decode_seconds)
    assert b.first_scheduled_time >= a.finished_time and b.queue_seconds >= a.inference_seconds
    assert c.first_scheduled_time is None and c.first_token_time is None and c.finished_time >= c.arrival_time
    assert (c.queue_seconds, c.prefill_seconds, c.decode_seconds, c.inference_seconds) == (None,) * 4


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
    with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
        engine.add_request("long", [3] * 300, GREEDY)
    with pytest.raises(ValueError, match="vocab|\\[0, 256\\)"):
        engine.add_request("oov", [3, 999], GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        engine.add_request("p", [3], SamplingParams(top_p=1.5))
    assert_all_pages_free(engine)


def _run_to_end(engine, outputs=None):
    outputs = {} if outputs is None else outputs
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def _tokens(deltas):
    return [t for out in deltas for t in out.new_token_ids]


def test_a_failed_device_step_fails_only_its_requests_and_the_engine_recovers(params, caplog):
    """A device fault in a step that held only `victim` (and consumed the donated KV cache): the
    victim ends with an error; `bystander`, running but not in that step, is recomputed and ends
    exactly as alone; a later request sharing the victim's prefix does not read its lost pages."""
    import jax
    seed = 12
    rng = np.random.default_rng(seed)
    victim_prompt, bystander_prompt = random_prompts(rng, 2, low=20, high=40)
    later_prompt = victim_prompt[:16] + [7, 8, 9]  # two full pages of the victim's prefix
    alone = run_alone(make_engine(params), [bystander_prompt, later_prompt])
    engine = make_engine(params, enable_prefix_caching=True)
    engine.add_request("victim", victim_prompt, GREEDY)
    engine.add_request("bystander", bystander_prompt, GREEDY)
    outputs = {}
    for _ in range(3):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert len(_tokens(outputs["bystander"])) >= 2 and engine.allocator.num_cached_pages > 0

    schedule, run_step = engine.scheduler.schedule, engine.runner.run_step

    def victim_only():
        plan = schedule()
        plan.decode = [r for r in plan.decode if r.request_id == "victim"]
        return plan

    def device_fault(*args):
        for leaf in jax.tree_util.tree_leaves(engine.runner.kv_cache):
            leaf.delete()  # what a failed call that took the donated cache leaves behind
        raise RuntimeError("injected device fault")

    engine.scheduler.schedule, engine.runner.run_step = victim_only, device_fault
    with caplog.at_level("ERROR", logger="jaxserve.engine"):
        failed = engine.step()
    engine.scheduler.schedule, engine.runner.run_step = schedule, run_step
    assert [(o.request_id, o.finished, o.finish_reason) for o in failed] == [("victim", True, "error")]
    assert "injected device fault" in failed[0].error
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and re.fullmatch(r"engine step failed \(1 decode rows, 0 prefill chunks of 0 tokens, "
                                             r"\d+ pages in the widest row\); failing its 1 requests", errors[0])
    assert engine.stats().num_step_failures == 1 and engine.last_step_error == "RuntimeError: injected device fault"

    _run_to_end(engine, outputs)
    assert _tokens(outputs["bystander"]) == alone[0], f"seed {seed}"
    engine.add_request("later", later_prompt, GREEDY)
    assert _tokens(_run_to_end(engine)["later"]) == alone[1], f"seed {seed}"
    assert_all_pages_free(engine)


def test_a_request_whose_inputs_cannot_be_packed_fails_alone(params):
    """Should a value that admission let through still not fit its array, only its request fails."""
    from jaxserve.core.request import Request
    prompt = [5, 6, 7, 8, 9]
    alone = run_alone(make_engine(params), [prompt])[0]
    engine = make_engine(params)
    engine.add(Request("bad", [3, 4], SamplingParams(max_tokens=4, top_k=2**31)))  # not checked: overflows int32
    engine.add_request("good", prompt, GREEDY)
    outputs = _run_to_end(engine)
    assert [(o.finish_reason, o.error.split(":")[0]) for o in outputs["bad"]] == [
        ("error", "the request could not be run")]
    assert "OverflowError" in outputs["bad"][0].error
    assert _tokens(outputs["good"]) == alone
    assert engine.num_step_failures == 0
    assert_all_pages_free(engine)


def test_the_runner_works_from_a_scheduled_batch_alone(params):
    """The runner needs nothing but the plain step data: batches written by hand (no scheduler, no
    Request) give the engine's greedy tokens."""
    from jaxserve.core.step import RowParams, ScheduledBatch, ScheduledRow
    prompt = list(range(5, 15))  # 10 tokens: two pages of 8
    expected = make_engine(params).generate([prompt], SamplingParams(max_tokens=3, temperature=0.0,
                                                                     ignore_eos=True))[0].token_ids
    runner = make_engine(params).runner
    pages = (3, 7)  # any pages: the runner writes and reads where the batch says
    greedy = RowParams(SamplingParams(temperature=0.0))
    out = runner.execute(ScheduledBatch(prefill=(ScheduledRow("a", tuple(prompt), 0, pages, greedy),)))
    assert (out.bucket.num_decode, out.bucket.num_prefill_tokens) == (0, 32) and out.logprobs is None
    got = [int(out.token_ids[0])]
    for position in (10, 11):
        row = ScheduledRow("a", (got[-1],), position, pages, greedy)
        got.append(int(runner.execute(ScheduledBatch(decode=(row,))).token_ids[0]))
    assert got == expected


def test_each_step_leaves_one_record_of_its_shape_work_and_times(params, caplog):
    from serve.metrics import ServerMetrics
    engine = make_engine(params)
    heard, metrics = [], ServerMetrics(engine.stats)
    engine.add_step_listener(heard.append)
    engine.add_step_listener(metrics.observe_step)
    engine.add_step_listener(lambda record: 1 / 0)  # a failing listener is logged; the step goes on
    engine.add_request("a", list(range(3, 13)), GREEDY)  # 10 tokens
    engine.step()
    engine.add_request("b", list(range(20, 40)), GREEDY)  # 20 tokens
    with caplog.at_level("ERROR", logger="jaxserve.engine"):
        outputs = engine.step()  # a decodes its first output token (position 10), b's prompt prefills
    assert sorted(o.request_id for o in outputs) == ["a", "b"]
    assert "a step listener failed" in caplog.text
    prefill, mixed = engine.step_records
    assert heard == [prefill, mixed]
    assert (prefill.kind, prefill.num_decode_rows, prefill.num_prefill_rows, prefill.num_tokens) == ("prefill", 0, 1, 10)
    assert (mixed.kind, mixed.bucket_decode_rows, mixed.bucket_prefill_tokens, mixed.bucket_pages) == ("mixed", 8, 32, 32)
    assert (mixed.num_decode_rows, mixed.num_prefill_rows, mixed.num_prefill_tokens, mixed.num_tokens) == (1, 1, 20, 21)
    assert mixed.num_attention_pairs == 11 + 20 * 21 // 2 and mixed.num_padded_tokens == 40
    assert mixed.device_seconds > 0 and 0 < mixed.pack_seconds < mixed.host_seconds
    assert mixed.seconds == mixed.device_seconds + mixed.host_seconds
    assert engine.time_in_steps == prefill.device_seconds + mixed.device_seconds

    text = metrics.render()[0].decode()
    assert 'jaxserve_step_duration_seconds_count{kind="mixed",model_name="model"} 1.0' in text
    assert 'jaxserve_step_duration_seconds_count{kind="prefill",model_name="model"} 1.0' in text
    assert 'jaxserve_step_tokens_sum{kind="mixed",model_name="model"} 21.0' in text
    assert 'jaxserve_step_padded_tokens_total{model_name="model"} 72.0' in text  # 32 + 40
    engine.remove_step_listener(heard.append)
    _run_to_end(engine)
    assert len(heard) == 2 and len(engine.step_records) > 2


def test_priced_step_records_carry_the_roofline_estimate_the_host_gap_and_utilization(params):
    from jaxserve.core import diagnosis
    from jaxserve.executor.step_pricing import StepPricer
    engine = make_engine(params, memory_bandwidth_gbps=10.0, peak_tflops=0.1)
    pricer = StepPricer.for_engine(engine)
    assert pricer.ceilings is not None and pricer.ceilings.memory_bandwidth == 10e9
    engine.add_request("a", list(range(3, 13)), GREEDY)  # 10 tokens
    engine.step()
    time.sleep(0.05)  # the loop dawdles while "a" still has tokens to decode
    engine.step()
    assert all(r.estimated_bytes == 0 and r.bandwidth_utilization is None for r in engine.step_records)  # unpriced
    prefill, decode = map(pricer.price, engine.step_records)
    assert prefill.host_gap_seconds == 0.0 and decode.host_gap_seconds >= 0.05
    expected = pricer.costs.step(num_tokens=1, kv_tokens_read=10, attention_pairs=11)
    assert (decode.estimated_bytes, decode.estimated_flops) == (expected.bytes, expected.flops)
    assert decode.bandwidth_utilization == pytest.approx(expected.bytes / decode.device_seconds / 10e9)
    assert decode.compute_utilization == pytest.approx(expected.flops / decode.device_seconds / 0.1e12)
    assert decode.achieved_bytes_per_second == pytest.approx(expected.bytes / decode.device_seconds)
    verdict = diagnosis.diagnose_steps([prefill, decode])
    assert verdict.num_steps == 2 and verdict.host_gap_seconds >= 0.05
    # A listener wrapped by the pricer gets priced records, and is removed by the listener's own name.
    heard = []
    engine.add_step_listener(pricer.priced(heard.append))
    engine.step()
    assert heard[0].estimated_bytes > 0 and heard[0].bandwidth_utilization is not None
    engine.remove_step_listener(heard.append)
    engine.step()
    assert len(heard) == 1
    # Without ceilings (a CPU told nothing), rates but no utilization.
    plain = make_engine(params)
    plain_pricer = StepPricer.for_engine(plain)
    plain.add_request("b", [5, 6, 7], GREEDY)
    plain.step()
    record = plain_pricer.price(plain.step_records[0])
    assert plain_pricer.ceilings is None and record.bandwidth_utilization is None and record.estimated_bytes > 0
    # Multi-step decoding: 4 passes over the weights in one call, contexts 10, 11, 12, 13.
    multi = make_engine(params, num_scheduler_steps=4)
    multi_pricer = StepPricer.for_engine(multi)
    multi.add_request("c", list(range(3, 13)), GREEDY)
    multi.step()
    multi.step()
    record = multi_pricer.price(multi.step_records[-1])
    passes = [multi_pricer.costs.step(1, 10 + k, 11 + k) for k in range(4)]
    assert record.num_tokens == 4 and record.estimated_bytes == sum(p.bytes for p in passes)
    assert record.estimated_flops == sum(p.flops for p in passes)
