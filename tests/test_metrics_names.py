"""The names /metrics exports, without a server: each count once, under vLLM's name where vLLM has
one, and every name the shipped Grafana dashboard (deploy/grafana/jaxserve.json) queries."""
import json
import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.core.outputs import EngineStats
from serve.metrics import ServerMetrics

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "jaxserve.json"
STATS = EngineStats(num_running=1, num_waiting=0, kv_pages_used=4, kv_pages_total=10, num_preemptions=3,
                    prefix_cache_queried_tokens=0, prefix_cache_hit_tokens=0)
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported() -> tuple[dict[str, float], set[str]]:
    """(the value of each sample of model "m" without other labels, every name a query can use)."""
    text = generate_latest(ServerMetrics(lambda: STATS, "m").registry).decode()
    values, names = {}, set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
        for sample in family.samples:
            if sample.labels == {"model_name": "m"}:
                values[sample.name] = sample.value
    return values, names


def test_preemptions_are_counted_once_under_vllms_name():
    values, names = exported()
    assert values["jaxserve_num_preemptions_total"] == 3
    assert [name for name in names if "preempt" in name] == ["jaxserve_num_preemptions_total"]


def test_every_name_the_dashboard_queries_is_exported():
    panels = json.loads(DASHBOARD.read_text())["panels"]
    queried = {name for panel in panels for target in panel["targets"]
               for name in re.findall(r"\bjaxserve_\w+", target["expr"])}
    _, names = exported()
    assert "jaxserve_num_preemptions_total" in queried
    assert queried - names == set()


def test_lora_requests_info_carries_the_adapters_in_its_labels_as_vllm():
    import dataclasses
    stats = dataclasses.replace(STATS, lora_running=("a", "b"), lora_waiting=("c",), max_lora=2)
    metrics = ServerMetrics(lambda: stats, "m")
    metrics.lora_requests.labels(lora_name="a").inc()
    text = generate_latest(metrics.registry).decode()
    (info,) = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "jaxserve_lora_requests_info"]
    assert info.labels == {"model_name": "m", "running_lora_adapters": "a,b", "waiting_lora_adapters": "c",
                           "max_lora": "2"} and info.value > 0
    assert 'jaxserve_lora_requests_total{lora_name="a",model_name="m"} 1.0' in text
    assert "jaxserve_lora_requests_info" not in generate_latest(ServerMetrics(lambda: STATS, "m").registry).decode()
