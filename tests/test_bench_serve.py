"""`jaxserve bench serve` against a fake OpenAI-compatible server on a loopback port (no model, no jax).

The metrics arithmetic is checked exactly on recorded timelines (results.request_metrics and
summarize are pure functions of the timestamps); the end-to-end runs check what only a server shows
(pacing, concurrency, errors, the JSON and the plot) with coarse timing bounds: asyncio.sleep never
returns early, so a delay the fake server sleeps is a lower bound, and the upper bounds leave
100 ms or more for a loaded machine.
"""
from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time

import numpy as np
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxserve.benchmarks import runner, sweep
from jaxserve.benchmarks.client import RequestRecord
from jaxserve.benchmarks.results import (parse_goodput, parse_metric_names, parse_percentiles, percentile_key,
                                         request_metrics, summarize)
from jaxserve.benchmarks.server_metrics import step_metrics_delta
from jaxserve.commands import cli

def step_metrics_text(steps: int) -> str:
    """A server's /metrics after `steps` steps, as prometheus_client writes it."""
    registry = CollectorRegistry()
    gap = Histogram("jaxserve_step_host_gap_seconds", "Host time between steps.", registry=registry)
    device = Counter("jaxserve_step_device_seconds", "Device time by kind.", ["kind"], registry=registry)
    Gauge("jaxserve_step_bandwidth_utilization", "Fraction of the bandwidth.", registry=registry).set(0.5)
    Counter("other_requests", "Not a step metric.", registry=registry).inc(7)
    for _ in range(steps):
        gap.observe(0.002)
    device.labels(kind="decode").inc(steps)
    device.labels(kind="prefill").inc(1.5)
    return generate_latest(registry).decode()


class FakeOpenAI:
    """An OpenAI-compatible streaming server in a thread. Each request streams `max_tokens` text
    chunks `token_delay_s` apart after a first-chunk delay of `first_delay_s` x (streams in flight),
    then a usage chunk and [DONE]; `mode` breaks it on purpose."""

    def __init__(self, *, token_delay_s=0.005, first_delay_s=0.005, mode="ok", usage=True, metrics=False):
        self.token_delay_s, self.first_delay_s, self.mode, self.usage = token_delay_s, first_delay_s, mode, usage
        self.metrics = metrics
        self.bodies: list[dict] = []
        self.arrivals: list[float] = []
        self.active = self.peak = self.served = 0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=10)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _start(self) -> int:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._stream)
        app.router.add_post("/v1/chat/completions", self._stream)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def _models(self, request):
        return web.json_response({"data": [{"id": "fake"}]})

    async def _metrics(self, request):
        if not self.metrics:
            raise web.HTTPNotFound()
        return web.Response(text=step_metrics_text(self.served))

    async def _stream(self, request):
        self.arrivals.append(time.perf_counter())
        body = await request.json()
        self.bodies.append(body)
        number = len(self.bodies)
        if self.mode == "drop_always" or (self.mode == "drop_every_2" and number % 2 == 1):
            request.transport.close()  # the connection closes before any response
            return web.Response()
        if self.mode == "400" or (self.mode == "500_every_2" and number % 2 == 0):
            status = 400 if self.mode == "400" else 500
            return web.json_response({"error": {"message": f"boom {status}"}}, status=status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await self._chunks(response, body, request.path.endswith("chat/completions"))
        finally:
            self.active -= 1
        return response

    async def _chunks(self, response, body, chat):
        await asyncio.sleep(self.first_delay_s * self.active)
        count = body.get("max_completion_tokens" if chat else "max_tokens")
        for i in range(count):
            if i:
                await asyncio.sleep(self.token_delay_s)
            choice = {"index": 0, "delta": {"content": "ab"}} if chat else {"index": 0, "text": "ab"}
            await response.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
        if self.mode == "not_json":
            await response.write(b"data: {not json\n\n")
            return
        if self.mode == "cut_mid_stream":
            response.force_close()
            response._req.transport.close()
            return
        if self.usage:
            usage = {"prompt_tokens": 3, "completion_tokens": count, "total_tokens": 3 + count}
            await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        self.served += 1
        if self.mode != "no_done":
            await response.write(b"data: [DONE]\n\n")

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def fake():
    servers = []

    def make(**kwargs) -> FakeOpenAI:
        servers.append(FakeOpenAI(**kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


def bench(url: str, *args: str) -> int:
    return cli.main(["jaxserve", "bench", "serve", f"--base_url={url}", "--disable_tqdm", "--random_vocab_size=500",
                     *args])


def record(start, chunks, end, usage=None, text="", prompt_len=5, error=None) -> RequestRecord:
    return RequestRecord(prompt_len, start, list(chunks), end, text, usage, error)


# --- the arithmetic, exactly --------------------------------------------------------------------

def test_request_metrics_from_a_timeline():
    m = request_metrics(record(10.0, [10.1, 10.15, 10.3], 10.35, usage=4))
    assert m.ttft == pytest.approx(0.1) and m.e2el == pytest.approx(0.35)
    assert m.tpot == pytest.approx((0.35 - 0.1) / 3)  # (e2el - ttft) / (tokens - 1), 4 tokens in 3 chunks
    assert m.itls == pytest.approx([0.05, 0.15]) and m.output_len == 4 and m.output_token_source == "usage"
    by_tokenizer = request_metrics(record(0.0, [0.2], 0.3, text="a b c"), count_tokens=lambda t: len(t.split()))
    assert (by_tokenizer.output_len, by_tokenizer.output_token_source) == (3, "tokenizer")
    assert by_tokenizer.tpot == pytest.approx(0.05)
    one = request_metrics(record(0.0, [0.2], 0.25))
    assert (one.output_len, one.output_token_source, one.tpot, one.itls) == (1, "chunks", None, [])


def test_summary_statistics_goodput_and_failures():
    records = [record(0.0, [0.1, 0.2, 0.3], 0.3, usage=3),   # ttft 100, tpot 100, e2el 300 ms
               record(0.0, [0.2, 0.25, 0.3], 0.3, usage=3),  # ttft 200, tpot 50, e2el 300
               record(0.0, [0.4, 0.42, 0.44], 0.44, usage=3),  # ttft 400, tpot 20, e2el 440
               record(0.0, [], 0.1, error="HTTP 500: boom")]
    result, metrics = summarize(records, 2.0, percentiles=[50, 99, 99.9], slos={"ttft": 250, "tpot": 60})
    assert (result["completed"], result["failed"], result["first_error"]) == (3, 1, "HTTP 500: boom")
    assert result["total_input_tokens"] == 15 and result["total_output_tokens"] == 9
    assert result["request_throughput"] == 1.5 and result["output_throughput"] == 4.5
    assert result["total_token_throughput"] == 12.0
    ttfts = np.array([100.0, 200.0, 400.0])
    assert result["mean_ttft_ms"] == pytest.approx(700 / 3) and result["median_ttft_ms"] == pytest.approx(200)
    assert result["std_ttft_ms"] == pytest.approx(float(np.std(ttfts)))
    assert result["p99_ttft_ms"] == pytest.approx(200 + 0.98 * 200)  # linear between the 2nd and 3rd
    assert result["p50_ttft_ms"] == pytest.approx(200) and "p99.9_ttft_ms" in result
    assert result["mean_itl_ms"] == pytest.approx(np.mean([100, 100, 50, 50, 20, 20]))
    assert result["request_goodput"] == 0.5  # only the second meets ttft <= 250 and tpot <= 60
    assert len(metrics) == 3


def test_summary_without_values_is_null():
    result, _ = summarize([record(0.0, [], 0.1, error="x")], 1.0)
    assert result["completed"] == 0 and result["mean_ttft_ms"] is None and result["p99_e2el_ms"] is None


def test_flag_parsers():
    assert parse_goodput("ttft:800, tpot:80,e2el:1e4") == {"ttft": 800.0, "tpot": 80.0, "e2el": 10000.0}
    for bad in ("ttft", "itl:5", "ttft:fast", "tpot:0"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    assert parse_percentiles("50,99.9") == [50.0, 99.9] and percentile_key(99.9) == "p99.9"
    with pytest.raises(ValueError):
        parse_percentiles("0,50")
    with pytest.raises(ValueError, match="percentile_metrics"):
        parse_metric_names("ttft,latency")


def test_arrival_offsets_follow_rate_and_burstiness():
    assert not runner.arrival_offsets(5, math.inf).any()
    offsets = runner.arrival_offsets(20001, 10.0, 1.0, seed=3)
    gaps = np.diff(offsets)
    assert offsets[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)  # mean 1 / rate
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # Poisson: coefficient of variation 1
    bursty = np.diff(runner.arrival_offsets(20001, 10.0, 0.25, seed=3))
    assert bursty.mean() == pytest.approx(0.1, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # gamma shape k: CV 1 / sqrt(k)
    assert np.array_equal(runner.arrival_offsets(9, 4.0, 2.0, seed=1), runner.arrival_offsets(9, 4.0, 2.0, seed=1))


def test_sweep_verdict_and_cost():
    assert sweep.cost_per_million_output_tokens(3.6, 100.0) == pytest.approx(10.0)  # 3.6/3600/100*1e6
    assert sweep.cost_per_million_output_tokens(3.6, 0.0) is None
    assert sweep.best_level([1, 8, 16], [True, True, False]) == 8
    assert sweep.best_level([1, 8], [False, False]) is None
    fast = [request_metrics(record(0.0, [0.05, 0.06], 0.06, usage=2))]
    ok = {"failed": 0, "completed": 1}
    assert sweep.level_meets_slos(ok, fast, {"ttft": 60, "tpot": 20})
    assert not sweep.level_meets_slos(ok, fast, {"ttft": 40})
    assert not sweep.level_meets_slos({"failed": 1, "completed": 1}, fast, {"ttft": 60})
    assert not sweep.level_meets_slos(ok, fast, {})


def test_step_metrics_delta():
    section = step_metrics_delta(step_metrics_text(2), step_metrics_text(6))
    assert section["jaxserve_step_host_gap_seconds"] == pytest.approx({"sum": 0.008, "count": 4, "mean": 0.002})
    assert section["jaxserve_step_bandwidth_utilization"] == {"value": 0.5}
    device = section["jaxserve_step_device_seconds"]
    assert device["delta"] == pytest.approx(4)
    assert device["by_labels"] == {"kind=decode": {"delta": 4.0}, "kind=prefill": {"delta": 0.0}}  # whole and 1.5
    assert not any(name.endswith("_created") for name in section)
    assert "other_requests" not in section and "other_requests_total" not in section
    assert step_metrics_delta("other_requests_total 1\n", "other_requests_total 2\n") is None
    assert step_metrics_delta(None, None) is None


# --- end to end against the fake server ---------------------------------------------------------

def test_timings_result_json_and_details(fake, tmp_path, capsys):
    server = fake(token_delay_s=0.05, first_delay_s=0.05)
    out = tmp_path / "result.json"
    code = bench(server.url, "--num_prompts=3", "--random_input_len=8", "--random_output_len=4",
                 "--max_concurrency=1", "--metric_percentiles=50,99", f"--result_json={out}", "--save_detailed",
                 "--goodput=ttft:5000", "--hour_usd=2.5", "--num_warmups=1")
    assert code == 0
    assert len(server.bodies) == 4  # one warm-up, three timed
    result = json.loads(out.read_text())
    for key in ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
                "output_throughput", "total_token_throughput", "request_goodput", "max_concurrency", "request_rate",
                "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
                "p99_itl_ms", "p99_e2el_ms", "output_token_source", "ttfts", "itls", "e2els", "input_lens",
                "output_lens", "errors", "cost_per_million_output_tokens_usd"):
        assert key in result, key
    assert (result["completed"], result["failed"], result["max_concurrency"]) == (3, 0, 1)
    assert result["request_rate"] == "inf" and result["output_token_source"] == "usage"
    assert result["total_output_tokens"] == 12 and result["output_lens"] == [4, 4, 4]
    assert result["errors"] == ["", "", ""] and [len(itl) for itl in result["itls"]] == [3, 3, 3]
    # the fake sleeps 50 ms before the first chunk and between chunks: lower bounds; +100 ms for load
    assert 49 <= result["mean_ttft_ms"] < 150 and 49 <= result["mean_itl_ms"] < 150
    assert 49 <= result["mean_tpot_ms"] < 150 and 199 <= result["mean_e2el_ms"] < 500
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["cost_per_million_output_tokens_usd"] == pytest.approx(2.5 / 3600 / result["output_throughput"] * 1e6)
    body = server.bodies[-1]
    assert body["model"] == "fake" and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["max_tokens"] == 4
    assert isinstance(body["prompt"], list) and all(100 <= t < 500 for t in body["prompt"])  # token ids
    assert "Serving Benchmark Result" in capsys.readouterr().out


def test_max_concurrency_is_honoured(fake, tmp_path):
    server = fake(token_delay_s=0.02)
    assert bench(server.url, "--num_prompts=12", "--random_output_len=3", "--max_concurrency=3") == 0
    assert server.peak == 3 and len(server.bodies) == 12


def test_request_rate_paces_arrivals(fake):
    server = fake()
    assert bench(server.url, "--num_prompts=8", "--random_output_len=2", "--request_rate=20", "--burstiness=1",
                 "--seed=5") == 0
    actual = np.array(server.arrivals) - server.arrivals[0]  # [8]
    expected = runner.arrival_offsets(8, 20.0, 1.0, seed=5)
    assert np.all(actual >= expected - 0.01)  # never early (1 ms clock slack between the threads)
    assert np.all(actual <= expected + 0.08)  # late by at most the loop's delay on a loaded machine


def test_server_down_is_one_line_and_exit_2(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
        assert bench(f"http://127.0.0.1:{port}", "--num_prompts=2") == 2
    err = capsys.readouterr().err
    assert "cannot reach" in err and "is the server running" in err and "Traceback" not in err
    assert bench("localhost:8000", "--num_prompts=2") == 2
    assert "is not an http(s) URL" in capsys.readouterr().err


def test_rejected_requests_fail_with_their_message(fake, tmp_path, capsys):
    assert bench(fake(mode="400").url, "--num_prompts=3") == 1
    err = capsys.readouterr().err
    assert "3 of 3 requests failed" in err and "HTTP 400: boom 400" in err
    out = tmp_path / "r.json"
    assert bench(fake(mode="500_every_2").url, "--num_prompts=4", "--max_concurrency=1", "--save_detailed",
                 f"--result_json={out}") == 0
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (2, 2)
    assert sorted(result["errors"]) == ["", "", "HTTP 500: boom 500", "HTTP 500: boom 500"]


def test_a_connection_closed_before_any_response_is_sent_once_more(fake, tmp_path, capsys):
    out = tmp_path / "r.json"
    server = fake(mode="drop_every_2")  # every first send of a request is dropped, its second served
    assert bench(server.url, "--num_prompts=3", "--max_concurrency=1", "--random_output_len=2",
                 f"--result_json={out}") == 0
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["retried"]) == (3, 0, 3) and len(server.bodies) == 6
    server = fake(mode="drop_always")  # one retry only, then the request fails with its message
    assert bench(server.url, "--num_prompts=2", "--max_concurrency=1", f"--result_json={out}") == 1
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (0, 2) and len(server.bodies) == 4
    assert "ServerDisconnectedError" in capsys.readouterr().err


def test_a_stream_cut_after_it_began_is_not_sent_again(fake, tmp_path, capsys):
    out = tmp_path / "r.json"
    server = fake(mode="cut_mid_stream")
    assert bench(server.url, "--num_prompts=2", "--max_concurrency=1", "--random_output_len=2",
                 f"--result_json={out}") == 1
    result = json.loads(out.read_text())
    assert (result["failed"], result["retried"]) == (2, 0) and len(server.bodies) == 2


@pytest.mark.parametrize("mode, message", [("not_json", "a data line is not JSON"),
                                           ("no_done", "ended without data: [DONE]")])
def test_malformed_streams_fail_clearly(fake, capsys, mode, message):
    assert bench(fake(mode=mode).url, "--num_prompts=2", "--random_output_len=2") == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_output_tokens_without_usage_are_chunks(fake, tmp_path):
    out = tmp_path / "r.json"
    assert bench(fake(usage=False).url, "--num_prompts=2", "--random_output_len=3", f"--result_json={out}") == 0
    result = json.loads(out.read_text())
    assert result["output_token_source"] == "chunks" and result["total_output_tokens"] == 6


def test_chat_endpoint_body(fake, tmp_path):
    server = fake()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello there friend", "output_tokens": 3}\n')
    out = tmp_path / "r.json"
    assert bench(server.url, "--endpoint=chat", "--dataset_name=jsonl", f"--dataset_path={prompts}",
                 "--num_prompts=2", "--model=served-name", f"--result_json={out}") == 0
    body = server.bodies[0]
    assert body["messages"] == [{"role": "user", "content": "hello there friend"}]
    assert body["max_completion_tokens"] == 3 and "prompt" not in body and "max_tokens" not in body
    assert body["model"] == "served-name" and body["ignore_eos"] is False
    result = json.loads(out.read_text())
    assert result["total_input_tokens"] == 6 and result["input_token_source"] == "words"
    assert result["total_output_tokens"] == 6


def test_bad_flags_exit_2(fake, capsys):
    url = fake().url
    assert bench(url, "--endpoint=chat", "--num_prompts=1") == 2
    assert "need a --tokenizer" in capsys.readouterr().err
    assert bench(url, "--goodput=ttft") == 2
    assert bench(url, "--dataset_name=sharegpt") == 2
    assert bench(url, "--plot=x.png") == 2
    assert bench(url, "--sweep_max_concurrency=1,2.5") == 2
    assert bench(url, "--sweep_max_concurrency=1,2", "--max_concurrency=4") == 2
    assert bench(url, "--sweep_max_concurrency=1", "--sweep_request_rate=1") == 2
    assert "Traceback" not in capsys.readouterr().err


def test_server_step_metrics_section(fake, tmp_path):
    out = tmp_path / "r.json"
    assert bench(fake(metrics=True).url, "--num_prompts=3", "--random_output_len=2", "--num_warmups=1",
                 f"--result_json={out}") == 0
    steps = json.loads(out.read_text())["server_step_metrics"]
    assert steps["jaxserve_step_host_gap_seconds"]["count"] == 3  # the warm-up is before the first scrape
    assert steps["jaxserve_step_host_gap_seconds"]["mean"] == pytest.approx(0.002)
    assert bench(fake().url, "--num_prompts=1", "--random_output_len=2", f"--result_json={out}") == 0
    assert "server_step_metrics" not in json.loads(out.read_text())


def test_sweep_finds_the_largest_level_meeting_the_slo(fake, tmp_path, capsys):
    # The first chunk waits 60 ms per stream in flight: level 1 ~60 ms, level 4 >= 240 ms at P99.
    server = fake(first_delay_s=0.06, token_delay_s=0.005)
    out, png = tmp_path / "sweep.json", tmp_path / "plots" / "sweep.png"
    assert bench(server.url, "--num_prompts=4", "--random_output_len=2", "--sweep_max_concurrency=1,4",
                 "--goodput=ttft:200", "--hour_usd=1", f"--result_json={out}", f"--plot={png}") == 0
    document = json.loads(out.read_text())
    assert [lv["max_concurrency"] for lv in document["levels"]] == [1, 4]
    assert document["max_concurrency_meeting_slo"] == 1 and server.peak == 4
    assert document["levels"][1]["p99_ttft_ms"] >= 200
    for level in document["levels"]:
        assert level["cost_per_million_output_tokens_usd"] == pytest.approx(1 / 3600 / level["output_throughput"] * 1e6)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "max_concurrency_meeting_slo: 1" in printed and "P99 TTFT ms" in printed


def test_each_level_of_a_sweep_sends_prompts_of_its_own(fake, tmp_path):
    """Level i draws with seed + i: a later level finds none of an earlier one's prompts cached."""
    server = fake()
    assert bench(server.url, "--num_prompts=3", "--random_output_len=2", "--random_input_len=8",
                 "--sweep_max_concurrency=1,2", "--seed=7", f"--result_json={tmp_path / 'r.json'}") == 0
    first, second = ([json.dumps(b["prompt"]) for b in server.bodies[i:i + 3]] for i in (0, 3))
    assert not set(first) & set(second)
    again = fake()
    assert bench(again.url, "--num_prompts=3", "--random_output_len=2", "--random_input_len=8", "--seed=7",
                 f"--result_json={tmp_path / 'one.json'}") == 0
    assert [json.dumps(b["prompt"]) for b in again.bodies] == first  # a single run is level 0


def test_request_rate_sweep(fake, tmp_path, capsys):
    out, png = tmp_path / "rates.json", tmp_path / "rates.png"
    assert bench(fake().url, "--num_prompts=3", "--random_output_len=3", "--sweep_request_rate=40,80",
                 "--goodput=e2el:5000", f"--result_json={out}", f"--plot={png}") == 0
    document = json.loads(out.read_text())
    assert document["sweep"] == "request_rate" and document["max_request_rate_meeting_slo"] == 80
    assert [lv["request_rate"] for lv in document["levels"]] == [40, 80]
    assert "max_concurrency_meeting_slo" not in document and png.stat().st_size > 0


def test_against_jaxserves_own_server(tmp_path):
    """jaxserve's HTTP server (serve.app) on the tests' deterministic FakeEngine: the real SSE
    framing, usage chunk and /v1/models, without a model."""
    from serve.app import ServerConfig  # the server's modules load in seconds: only this test needs them
    from tests.test_server import FakeEngine, LiveServer  # the same reason
    server = LiveServer(FakeEngine(token_delay_s=0.002), ServerConfig(drain_timeout_s=5.0))
    try:
        url, out = f"http://127.0.0.1:{server.port}", tmp_path / "r.json"
        assert bench(url, "--num_prompts=4", "--random_input_len=6", "--random_output_len=5",
                     "--random_vocab_size=200", "--max_concurrency=2", "--save_detailed", f"--result_json={out}") == 0
        result = json.loads(out.read_text())
        assert (result["completed"], result["failed"], result["model_id"]) == (4, 0, "fake-model")
        assert result["output_token_source"] == "usage" and result["output_lens"] == [5] * 4
        assert result["total_input_tokens"] == 24 and all(len(itl) >= 1 for itl in result["itls"])
        prompts = tmp_path / "p.jsonl"
        prompts.write_text('{"prompt": "hi there", "output_tokens": 3}\n')
        assert bench(url, "--endpoint=chat", "--dataset_name=jsonl", f"--dataset_path={prompts}", "--num_prompts=2",
                     "--ignore_eos", f"--result_json={out}") == 0
        result = json.loads(out.read_text())
        assert result["completed"] == 2 and result["total_output_tokens"] == 6
        assert server.engine.params[-1].ignore_eos and server.engine.params[-1].max_tokens == 3
    finally:
        server.close()


def test_tokenizer_decodes_random_prompts_and_counts_output(fake, tmp_path, capsys):
    from tests.test_server import byte_tokenizer  # transformers loads in seconds: only this test needs it
    byte_tokenizer().save_pretrained(tmp_path / "tok")
    server, out = fake(usage=False), tmp_path / "r.json"
    assert bench(server.url, "--endpoint=chat", f"--tokenizer={tmp_path / 'tok'}", "--num_prompts=2",
                 "--random_input_len=10", "--random_output_len=3", f"--result_json={out}") == 0
    assert isinstance(server.bodies[0]["messages"][0]["content"], str)
    result = json.loads(out.read_text())
    assert result["output_token_source"] == "tokenizer" and result["input_token_source"] == "tokenizer"
    assert result["total_output_tokens"] == 2 * 6  # "ab" x 3 chunks: six byte tokens each, not three chunks
    assert bench(server.url, f"--tokenizer={tmp_path / 'nothing'}", "--num_prompts=1") == 2
    assert "--tokenizer=" in capsys.readouterr().err
