"""/metrics under a real Prometheus (Debian's package: `prometheus` and `promtool`).

A tiny-model server gets streamed and non-streamed requests in two rounds while a Prometheus
scrapes it every second twice over: as is (job "jaxserve") and with the relabel rule of
docs/metrics.md (job "vllm": `jaxserve_(.*)` -> `vllm:$1`). Then every query of the shipped
dashboard (deploy/grafana/jaxserve.json) and every query vLLM's own dashboard makes must return
data, and promtool must find nothing to lint in a scrape.
"""
from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import openai
import pytest
import requests

from tests.test_server_engine import LiveServer

pytestmark = pytest.mark.slow  # Prometheus scraping a server: out of `make test-quick`

PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None or PROMTOOL is None, reason=(
    "needs Debian's prometheus package (prometheus and promtool): apt-get install prometheus; "
    "`make install-test` installs it when run as root"))

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "jaxserve.json"
MODEL = "tiny"
WINDOW = "1m"  # what $__rate_interval and the like stand for: longer than the whole test
RELABEL_RULE = {"source_labels": ["__name__"], "regex": "jaxserve_(.*)", "target_label": "__name__",
                "replacement": "vllm:$1"}


def _vllm_latency_queries(name: str) -> list[str]:
    """What vLLM's latency panels ask of one histogram: four quantiles and the mean."""
    selector = '{model_name="$model_name"}[$__rate_interval]'
    return [f"histogram_quantile({q}, sum by(le) (rate({name}_bucket{selector})))" for q in (0.99, 0.95, 0.9, 0.5)] + [
        f"rate({name}_sum{selector})\n/\nrate({name}_count{selector})"]


# The queries of the 12 panels of vLLM's example dashboard (examples/observability/prometheus_grafana).
VLLM_DASHBOARD_QUERIES = [
    *_vllm_latency_queries("vllm:e2e_request_latency_seconds"),
    'rate(vllm:prompt_tokens_total{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:generation_tokens_total{model_name="$model_name"}[$__rate_interval])',
    *_vllm_latency_queries("vllm:inter_token_latency_seconds"),
    'vllm:num_requests_running{model_name="$model_name"}',
    'vllm:num_requests_waiting{model_name="$model_name"}',
    *_vllm_latency_queries("vllm:time_to_first_token_seconds"),
    'vllm:kv_cache_usage_perc{model_name="$model_name"}',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="$model_name"}[$__rate_interval]))',
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="$model_name"}[$__rate_interval]))',
    'rate(vllm:request_queue_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="$model_name"}[$__rate_interval])',
    'rate(vllm:request_max_num_generation_tokens_sum{model_name="$model_name"}[$__rate_interval])',
]


def substitute(expr: str) -> str:
    """A panel query as Grafana would send it: the model variable and the interval macros filled in."""
    expr = re.sub(r"\$\{?model_name\}?", MODEL, expr)
    expr = re.sub(r"\$\{?__(rate_interval|interval|range)\}?", WINDOW, expr)
    assert "$" not in expr, f"a template variable the test does not know: {expr}"
    return expr


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, query) of every target of the shipped dashboard."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(panel["title"], target["expr"]) for panel in panels for target in panel["targets"]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """A prometheus process scraping `target` every second, with temporary config and storage."""

    def __init__(self, target: str, folder: Path) -> None:
        jobs = [{"job_name": "jaxserve", "static_configs": [{"targets": [target]}]},
                {"job_name": "vllm", "static_configs": [{"targets": [target]}],
                 "metric_relabel_configs": [RELABEL_RULE]}]
        config = folder / "prometheus.yml"  # JSON is YAML
        config.write_text(json.dumps({"global": {"scrape_interval": "1s", "scrape_timeout": "1s"},
                                      "scrape_configs": jobs}))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = (folder / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_for(lambda: requests.get(self.url + "/-/ready", timeout=2).status_code == 200, "ready")

    def wait_for(self, condition, what: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"prometheus exited: {Path(self.log.name).read_text()[-2000:]}"
            try:
                if condition():
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise AssertionError(f"prometheus not {what} within {timeout} s")

    def query(self, expr: str) -> list[dict]:
        body = requests.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10).json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()


def send_round(server: LiveServer) -> int:
    """Per prompt, one streamed request and one whole request with n=2; returns how many choices
    finished (all at max_tokens)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompts = ("The quick brown fox", "Once upon a time, in a land far away")
    for prompt in prompts:
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=6, extra_body={"ignore_eos": True})
        chunks = client.completions.create(stream=True, temperature=0.0, **kwargs)
        assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
        assert all(choice.text for choice in client.completions.create(n=2, seed=1, **kwargs).choices)
    return len(prompts) * (1 + 2)


@pytest.fixture(scope="module")
def scraped(tmp_path_factory):
    """(server, prometheus) once Prometheus has scraped both rounds of traffic under both jobs."""
    from checkpoints import default_model, load
    from jaxserve.config import ModelConfig
    from jaxserve.engine import Engine, EngineConfig
    from jaxserve.models import weights

    tokenizer = load.load_tokenizer(default_model.resolve_model("smollm2"))
    config = ModelConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_layers=2,
                         num_q_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                         eos_token_ids=(tokenizer.eos_token_id,))
    engine = Engine(config, weights.random_params(config, seed=3), tokenizer,
                    EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=8, num_pages=64,
                                 max_model_len=128, warmup=False), model_name=MODEL)
    server = LiveServer(engine)
    prometheus = Prometheus(f"127.0.0.1:{server.port}", tmp_path_factory.mktemp("prometheus"))
    try:
        finished = 0
        for _ in range(2):  # a scrape between the rounds: every counter grows within the query window
            finished += send_round(server)
            for name in ("jaxserve_request_success_total", "vllm:request_success_total"):
                prometheus.wait_for(lambda: prometheus.value(f"sum({name})") == finished, f"scraped {name}")
        yield server, prometheus
    finally:
        prometheus.close()
        server.close()


def assert_returns_data(prometheus: Prometheus, what: str, expr: str) -> None:
    result = prometheus.query(substitute(expr))
    assert result, f"{what}: no data for {expr}"
    values = [float(series["value"][1]) for series in result]
    assert all(math.isfinite(v) for v in values), f"{what}: {expr} gave {values}"


def test_the_shipped_dashboard_has_every_panel_vllm_shows():
    queries = " ".join(expr for _, expr in dashboard_queries())
    for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds", "inter_token_latency_seconds",
                 "prompt_tokens_total", "generation_tokens_total", "num_requests_running", "num_requests_waiting",
                 "kv_cache_usage_perc", "request_queue_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "request_prompt_tokens_bucket", "request_generation_tokens_bucket",
                 "request_success_total"):
        assert f"jaxserve_{name}" in queries, name


@needs_prometheus
def test_every_query_of_the_shipped_dashboard_returns_data(scraped):
    _, prometheus = scraped
    for title, expr in dashboard_queries():
        assert_returns_data(prometheus, title, expr)


@needs_prometheus
def test_every_query_of_vllms_dashboard_returns_data_under_the_relabel_rule(scraped):
    _, prometheus = scraped
    for expr in VLLM_DASHBOARD_QUERIES:
        assert_returns_data(prometheus, "vLLM's dashboard", expr)
    reasons = {s["metric"]["finished_reason"] for s in prometheus.query("vllm:request_success_total")}
    assert reasons == {"length"}
    num_prompts = 2 * 4  # two rounds of four single-prompt requests
    assert prometheus.value('sum(vllm:request_params_n_count{model_name="tiny"})') == num_prompts


@needs_prometheus
def test_promtool_finds_nothing_to_lint_in_a_scrape(scraped):
    server, _ = scraped
    text = requests.get(server.url + "/metrics", timeout=10).text
    lint = subprocess.run([PROMTOOL, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert lint.returncode == 0, lint.stdout + lint.stderr
