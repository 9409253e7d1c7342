"""Smoke tests of the benchmarks on a tiny random model with the SmolLM2 tokenizer.

The serving load generator and the soak test each launch `jaxserve serve`; the one-minute soak
runs in the background while the other benchmarks run, and its report is checked last.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from bench import common, soak, throughput

pytestmark = pytest.mark.slow  # the benchmark scripts as subprocesses: out of `make test-quick`

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER_ARGS = "--max_num_seqs=4 --max_num_batched_tokens=64 --max_model_len=128"
# The serving benchmark's server: concurrency 1 and 2 need no more rows, and a 32-token budget (the
# chat prompts prefill in chunks) leaves it 4 step shapes to warm up instead of 7, while the soak
# runs beside it on the same two cores.
SERVING_SERVER_ARGS = "--max_num_seqs=2 --max_num_batched_tokens=32 --max_model_len=128"


def run_script(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


def failure(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"


@pytest.fixture(scope="module")
def tiny_model(tiny_chat_model_dir) -> str:
    """A converted tiny Llama with SmolLM2's 49152-token vocabulary and tokenizer (conftest)."""
    return tiny_chat_model_dir


@pytest.fixture(scope="module")
def soak_run(tiny_model, tmp_path_factory):
    """The one-minute soak, started in the background: (process, report path)."""
    out = str(tmp_path_factory.mktemp("soak") / "soak.json")
    process = subprocess.Popen(
        [sys.executable, "bench/soak.py", "--minutes=1", f"--model={tiny_model}", f"--server_args={SERVER_ARGS}",
         "--concurrency=6", "--max_disconnect_s=0.2", "--sample_s=2", "--hostile_every_s=2", f"--out={out}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield process, out
    if process.poll() is None:
        process.kill()
        process.wait()


def test_serving_runs_bench_serve_on_every_level(tiny_model, soak_run, tmp_path):
    out = tmp_path / "serving.json"
    result = run_script(["bench/serving.py", "--launch", f"--model={tiny_model}", f"--server_args={SERVING_SERVER_ARGS}",
                         "--concurrency=1,2", "--num_prompts=4", "--input_len=24", "--output_len=8",
                         "--llama_server=/nonexistent/llama-server", f"--out={out}"], 300)
    assert result.returncode == 0, failure(result)
    report = json.loads(out.read_text())
    sweep = report["servers"]["jaxserve"]
    assert [level["level"] for level in sweep["levels"]] == [1, 2]
    for level in sweep["levels"]:
        assert (level["completed"], level["failed"]) == (4, 0), level.get("first_error")
        assert level["total_output_tokens"] == 4 * 8  # ignore_eos: every request runs to max_tokens
        assert level["request_throughput"] > 0 and level["output_throughput"] > 0
        for metric in ("ttft", "tpot", "itl", "e2el"):
            assert 0 < level[f"median_{metric}_ms"] <= level[f"p99_{metric}_ms"], (metric, level)
        assert level["median_e2el_ms"] >= level["median_ttft_ms"]
    assert "llama.cpp skipped" in result.stderr  # the tiny model was not converted from a GGUF
    [row] = report["single_stream"]
    assert row["engine"] == "jaxserve" and row["median_ttft_ms"] == sweep["levels"][0]["median_ttft_ms"]
    assert "TTFT p50 ms" in result.stdout
    prompts = [json.loads(line) for line in (tmp_path / "serving_prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 4 and all(p["output_tokens"] == 8 for p in prompts)
    assert (tmp_path / "serving.png").is_file(), "matplotlib (the bench extra) should be installed"


def test_throughput_quick(tiny_model, soak_run, tmp_path):
    out = tmp_path / "throughput.json"
    result = run_script(["bench/throughput.py", "--quick", "--skip_hf", f"--model={tiny_model}", f"--out={out}"],
                        300)
    assert result.returncode == 0, failure(result)
    report = json.loads(out.read_text())
    assert report["warmup_s"] > 0 and report["num_shapes"] > 0
    vocab = 49152
    expected = {"fixed": throughput.fixed_workload(*throughput.QUICK["fixed"], vocab, 0),
                "mixed": throughput.mixed_workload(*throughput.QUICK["mixed"], vocab, 1)}
    for name, workload in expected.items():
        data = report["workloads"][name]
        run = data["jaxserve"]
        assert run["output_tokens"] == sum(m for _, m in workload)
        assert run["prompt_tokens"] == sum(len(p) for p, _ in workload)
        assert math.isclose(run["output_tokens_per_s"], run["output_tokens"] / run["wall_s"])
        breakdown = data["breakdown"]
        assert sum(k["steps"] for k in breakdown["by_kind"].values()) == run["num_steps"]
        assert sum(k["tokens"] for k in breakdown["by_kind"].values()) == \
            run["prompt_tokens"] + run["output_tokens"] - len(workload)  # the last token is never fed back
        assert 0 < breakdown["padding_efficiency"] <= 1
        assert 0 < breakdown["host_prep_s"] < breakdown["host_step_s"]  # from the engine's StepRecords
        assert data["flops"]["flops_per_s_device"] > 0 and data["matmul_flops_per_s"]
        assert data["transformers"] == []


def test_step_profile_quick(tiny_model, tmp_path):
    out = tmp_path / "step.json"
    result = run_script(["bench/step_profile.py", f"--model={tiny_model}", "--rows=4", "--min_context=5",
                         "--max_context=40", "--max_model_len=64", "--repeats=1", f"--out={out}"], 300)
    assert result.returncode == 0, failure(result)
    report = json.loads(out.read_text())
    assert set(report["step_s"]) == {"xla", "reference", "no attention"}
    assert all(seconds > 0 for seconds in report["step_s"].values())
    assert report["kv_bytes"] > 0 and report["copy_bytes_per_s"] > 0 and report["matmul_flops_per_s"] > 0
    assert 0 < report["matmul_fraction_bound"]
    assert "of the matmul rate" in result.stdout
    engine_step = report["engine_decode_step"]  # from the engine's StepRecords of full decode steps
    assert engine_step["num_steps"] == 1 and engine_step["bucket_decode_rows"] >= 4
    assert engine_step["device_s"] > 0 and engine_step["host_s"] > engine_step["pack_s"] > 0
    assert "engine decode step" in result.stdout


def test_soak_one_minute_passes(soak_run):
    process, out = soak_run
    output, _ = process.communicate(timeout=400)
    assert process.returncode == 0, output[-4000:]
    report = json.loads(open(out).read())
    assert report["passed"] and all(report["checks"].values())
    counts = report["counts"]
    assert counts["completed"] > 0 and counts["failed"] == 0
    assert counts["disconnected"] > 0, "the soak should exercise client disconnects"
    assert report["final"]["kv_pages_used"] == 0 and report["peak_kv_pages_used"] > 0
    assert report["server_finished"].get("abort", 0) > 0, "disconnects should abort engine requests"
    assert report["server_finished"].get("length", 0) > 0 and not report["server_finished"].get("error")
    assert len(report["samples"]) >= 10
    assert report["server_exit_code"] == 0
    assert report["hostile"]["sent"] >= 10 and report["hostile"]["unexpected"] == 0, report["hostile"]


def soak_verdict(rss_mib: list[float], final_pages: float, failed: int = 0, server_errors=None) -> dict:
    args = soak.parse_args(["--minutes=1"])
    run = soak.Soak("http://unused", 0, args)
    run.counts = dict(completed=10, disconnected=2, failed=failed)
    run.server_finished = dict(length=10.0, abort=2.0, **(server_errors or {}))
    run.samples = [dict(t=60.0 * i / len(rss_mib), rss_mib=r, kv_pages_used=3.0) for i, r in enumerate(rss_mib)]
    return run.verdict(dict(kv_pages_used=final_pages, running=0.0, waiting=0.0), 61.0)


def test_soak_counts_server_errors_outside_health():
    """/health's 503 while the server warms up is its answer, not a server error; a 500 anywhere is."""
    text = ('jaxserve_http_requests_total{model_name="m",route="/health",status="503"} 4.0\n'
            'jaxserve_http_requests_total{model_name="m",route="/v1/completions",status="200"} 9.0\n'
            'jaxserve_http_requests_total{model_name="m",route="/v1/completions",status="500"} 1.0\n')
    parsed = soak.parse_metrics(text)
    assert parsed["http_status"] == {"503": 4.0, "200": 9.0, "500": 1.0} and parsed["http_5xx"] == 1.0


def test_soak_verdict_catches_leaks_and_lost_pages():
    flat = [500.0] * 10 + [520.0] * 10
    assert soak_verdict(flat, 0.0)["passed"]
    growing = [500.0 + 10 * i for i in range(20)]  # +~25% over the second half
    assert not soak_verdict(growing, 0.0)["checks"]["memory_flat"]
    assert not soak_verdict(flat, 5.0)["checks"]["kv_pages_returned"]
    assert not soak_verdict(flat, 0.0, failed=1)["checks"]["no_failed_requests"]
    assert not soak_verdict(flat, 0.0, server_errors={"error": 1.0})["checks"]["no_server_errors"]


def test_summaries_match_numpy():
    import numpy as np

    values = [0.3, 5.0, 1.0, 2.5, 9.0, 4.0, 0.1]
    stats = common.summarize(values, 1000)
    assert math.isclose(stats["mean"], 1000 * np.mean(values))
    assert math.isclose(stats["p50"], 1000 * np.percentile(values, 50))
    assert math.isclose(stats["p99"], 1000 * np.percentile(values, 99))
    assert common.summarize([])["count"] == 0


def test_single_stream_quick(tiny_model, tmp_path):
    out = tmp_path / "single.json"
    result = run_script(["bench/single_stream.py", f"--model={tiny_model}", "--variants=float,int8+embed",
                         "--prompt_len=20", "--output_len=4", "--repeats=2", "--max_model_len=64", "--skip_hf",
                         f"--out={out}"], 300)
    assert result.returncode == 0, failure(result)
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"jaxserve float", "jaxserve int8+embed"}
    for row in results.values():
        assert row["ttft_ms"] > 0 and row["tpot_ms"] > 0 and len(row["ttft_ms_all"]) == 2
        assert row["decode_bucket_rows"] == [1]  # one stream decodes in the CPU's 1-row bucket
    assert results["jaxserve int8+embed"]["weights_bytes"] < results["jaxserve float"]["weights_bytes"]
    assert "TPOT ms" in result.stdout


def test_speculative_smoke(tiny_model, tmp_path):
    out = tmp_path / "speculative.json"
    result = run_script(["bench/speculative.py", "--smoke", f"--model={tiny_model}", f"--out={out}"], 300)
    assert result.returncode == 0, failure(result)
    report = json.loads(out.read_text())
    single = report["single_stream"]
    assert set(single) == {"none", "ngram k=2", "draft=target k=2"}
    for r in single.values():
        for cls in ("copy", "chat"):
            c = r["per_class"][cls]
            assert c["tpot_ms"] > 0 and c["num_requests"] == 1 and c["output_tokens"] == [8]
            assert c["greedy_identical"] == 1, (cls, c["differing"])  # greedy: speculation changes no token
        assert r["warmup_s"] > 0
    draft = single["draft=target k=2"]
    assert draft["per_class"]["all"]["verify_steps"] > 0 and draft["per_class"]["all"]["acceptance_rate"] > 0.5
    assert draft["step_kinds"]["verify"]["median_tokens_out"] > 1  # the target drafting for itself
    concurrency = report["concurrency"]
    assert set(concurrency) == {"max_num_seqs=2 none", "max_num_seqs=2 ngram k=2", "max_num_seqs=2 ngram k=2 disable>1"}
    for r in concurrency.values():
        for mix in ("copy", "chat"):
            assert r[mix]["output_tokens_per_s"] > 0 and r[mix]["greedy_identical"] == r[mix]["num_requests"] == 3
    assert "TPOT ms" in result.stdout and "output tok/s" in result.stdout
