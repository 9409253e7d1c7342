"""`jaxserve bench throughput` and `bench latency` on a tiny random model: the result fields and
their arithmetic, exact output lengths, the iterations and percentiles, flag errors (exit 2)."""
import json
import types

import pytest

from jaxserve.benchmarks import datasets, latency, offline, throughput
from jaxserve.commands import cli

pytestmark = pytest.mark.slow  # engines on the tiny model: out of `make test-quick`

# Small shapes, compiled as first used (no warm-up of every bucket): the file stays fast.
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=32, num_pages=64, page_size=8, max_model_len=64)
ENGINE_FLAGS = [f"--{k}={v}" for k, v in ENGINE.items()] + ["--nowarmup", "--disable_tqdm"]


@pytest.fixture(scope="module")
def engine(tiny_chat_model_dir):
    from jaxserve.engine import Engine, EngineConfig

    engine = Engine.from_model(tiny_chat_model_dir, EngineConfig(warmup=False, **ENGINE))
    offline.warm_engine(engine)
    return engine


def test_throughput_result_and_its_arithmetic(engine):
    requests = datasets.random_requests(6, 12, 6, range_ratio=0.5, seed=3, vocab_size=engine.model_config.vocab_size)
    assert len({r.prompt_len for r in requests}) > 1  # the lengths vary
    result = throughput.run_throughput(engine, requests)
    prompt = sum(r.prompt_len for r in requests)
    output = sum(r.expected_output_len for r in requests)
    assert result["num_requests"] == 6
    assert result["total_prompt_tokens"] == prompt and result["total_output_tokens"] == output
    assert result["total_num_tokens"] == prompt + output
    elapsed = result["elapsed_time"]
    assert elapsed > 0
    assert result["tokens_per_second"] == pytest.approx((prompt + output) / elapsed)
    assert result["requests_per_second"] == pytest.approx(6 / elapsed)
    assert result["output_tokens_per_second"] == pytest.approx(output / elapsed)
    steps = result["steps"]
    # Each prompt token is computed once, each output token but the last is fed back once.
    assert sum(k["num_tokens"] for k in steps["by_kind"].values()) == prompt + output - 6
    assert sum(k["num_steps"] for k in steps["by_kind"].values()) == steps["num_steps"] > 0
    assert set(steps["by_kind"]) <= {"decode", "prefill", "mixed"} and "decode" in steps["by_kind"]
    assert 0 < steps["device_seconds"] + steps["host_seconds"] <= elapsed
    assert 0 < steps["padding_efficiency"] <= 1
    text = "\n".join(throughput.summary_lines(result))
    assert "requests/s" in text and "decode" in text


def test_every_request_gives_exactly_its_output_length(engine):
    requests = datasets.random_requests(5, 8, 7, range_ratio=0.5, seed=4, vocab_size=engine.model_config.vocab_size)
    prompts = [offline.prompt_ids(engine, r) for r in requests]
    params = [offline.greedy_params(r.expected_output_len) for r in requests]
    run = offline.timed_generate(engine, prompts, params)
    assert [len(r.token_ids) for r in run.results] == [r.expected_output_len for r in requests]
    assert [r.prompt_token_ids for r in run.results] == prompts
    assert not any(e.has_unfinished() for e in offline.replicas(engine))


def test_latency_iterations_and_percentiles(engine):
    result = latency.run_latency(engine, batch_size=3, input_len=9, output_len=4, num_iters_warmup=1, num_iters=4)
    lat = result["latencies"]
    assert len(lat) == 4 and len(result["ttfts"]) == 4 and len(result["tpots"]) == 4
    assert result["avg_latency"] == pytest.approx(sum(lat) / 4)
    p = result["percentiles"]
    assert list(p) == ["10", "25", "50", "75", "90", "99"]
    assert min(lat) <= p["10"] <= p["50"] <= p["99"] <= max(lat)
    assert all(0 < t <= x for t, x in zip(result["ttfts"], lat))
    ttfts = sorted(result["ttfts"])
    assert result["ttft_ms_percentiles"]["50"] == pytest.approx(1e3 * (ttfts[1] + ttfts[2]) / 2)
    for t, x, tpot in zip(result["ttfts"], lat, result["tpots"]):
        assert tpot == pytest.approx((x - t) / 3)
    assert "Avg latency" in "\n".join(latency.summary_lines(result))


def test_sharegpt_prompts_are_text_counted_with_the_tokenizer(engine, tmp_path):
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "What is a fox?"}, {"from": "gpt", "value": "An animal."}]},
        {"conversations": [{"from": "human", "value": "Only one turn"}]},  # skipped: no reply
        {"conversations": [{"from": "human", "value": "Say hi"}, {"from": "gpt", "value": "Hi there, friend!"}]},
    ]))
    fv = types.SimpleNamespace(dataset_name="sharegpt", dataset_path=str(data), num_prompts=2, output_len=None,
                               seed=0)
    requests = throughput.sample_requests(fv, engine)
    replies = {"What is a fox?": "An animal.", "Say hi": "Hi there, friend!"}
    assert sorted(r.prompt for r in requests) == sorted(replies)
    tok = engine.tokenizer
    assert all(r.expected_output_len == len(tok.encode(replies[r.prompt], add_special_tokens=False))
               for r in requests)
    result = throughput.run_throughput(engine, requests)
    assert result["total_output_tokens"] == sum(r.expected_output_len for r in requests)
    assert result["total_prompt_tokens"] == sum(len(tok.encode(r.prompt)) for r in requests)


def test_requests_over_the_context_are_refused(engine):
    prompts, params = [[200] * 60], [offline.greedy_params(10)]  # 70 tokens, max_model_len 64
    with pytest.raises(offline.BenchmarkError, match="request 0"):
        offline.check_requests(engine, prompts, params)


def test_cli_throughput_on_a_jsonl_file_and_latency(tiny_chat_model_dir, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "The quick brown fox", "output_tokens": 3}) + "\n"
                    + json.dumps({"prompt": "Hello there"}) + "\n")
    out = tmp_path / "t.json"
    assert cli.main(["jaxserve", "bench", "throughput", f"--model={tiny_chat_model_dir}", "--dataset_name=jsonl",
                     f"--dataset_path={data}", "--num_prompts=3", "--output_len=5", f"--output_json={out}",
                     *ENGINE_FLAGS]) == 0
    result = json.loads(out.read_text())
    assert result["num_requests"] == 3 and result["total_output_tokens"] == 3 + 5 + 3  # the file cycled
    assert result["total_num_tokens"] == result["total_prompt_tokens"] + 11
    assert "Throughput:" in capsys.readouterr().out

    out = tmp_path / "l.json"
    assert cli.main(["jaxserve", "bench", "latency", f"--model={tiny_chat_model_dir}", "--batch_size=2",
                     "--input_len=6", "--output_len=3", "--num_iters_warmup=0", "--num_iters=2",
                     f"--output_json={out}", *ENGINE_FLAGS]) == 0
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 2 and set(result["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert "Avg latency" in capsys.readouterr().out


@pytest.mark.parametrize("mode,args,message", [
    ("throughput", ["--input_len=-1"], "input_len"),
    ("throughput", ["--input_len=60", "--output_len=10"], "over --max_model_len=64"),
    ("throughput", ["--dataset_name=sharegpt"], "needs --dataset_path"),
    ("throughput", ["--dataset_name=jsonl", "--dataset_path=/nonexistent/p.jsonl"], "no such file"),
    ("throughput", ["--model=/nonexistent/model", "--input_len=10", "--output_len=5"], "cannot load"),
    ("latency", ["--output_len=0"], "output_len"),
    ("latency", ["--input_len=40", "--output_len=40"], "over --max_model_len=64"),
    ("latency", ["--num_iters=0"], "num_iters"),
])
def test_bad_flags_exit_2_without_a_traceback(capsys, mode, args, message):
    assert cli.main(["jaxserve", "bench", mode, *ENGINE_FLAGS, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("mode", ["throughput", "latency"])
def test_the_in_process_benchmarks_take_generates_cpu_batch_default(monkeypatch, capsys, mode):
    built = []

    def from_model(model, config):
        built.append(config)
        raise ValueError("not loaded in this test")
    monkeypatch.setattr(offline.Engine, "from_model", from_model)
    other_flags = [flag for flag in ENGINE_FLAGS if not flag.startswith(("--max_num_seqs", "--max_num_batched_tokens"))]
    assert cli.main(["jaxserve", "bench", mode, "--model=unused", "--input_len=8", "--output_len=4",
                     *other_flags]) == 2
    assert "not loaded in this test" in capsys.readouterr().err
    assert built[0].max_num_seqs == 64  # a server's default is 32
