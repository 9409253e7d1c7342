"""The run's bound from step records and from /metrics (jaxserve.core.diagnosis; the /metrics text
as `jaxserve bench serve` reads it, jaxserve.benchmarks.server_metrics): synthetic StepRecords, no
engine, no jax."""
from __future__ import annotations

import dataclasses

import pytest

from jaxserve.core import diagnosis
from jaxserve.core.outputs import EngineStats, StepRecord
from jaxserve.benchmarks import server_metrics
from serve.metrics import ServerMetrics


def diagnose_metrics_text(text: str) -> diagnosis.RunBound | None:
    """The bound of every step a /metrics text counts (a run from the server's start)."""
    return server_metrics.run_bound(server_metrics.step_metrics_delta(None, text))

STEP = StepRecord(kind="decode", bucket_decode_rows=8, bucket_prefill_tokens=0, bucket_pages=32, num_decode_rows=8,
                  num_prefill_rows=0, num_prefill_tokens=0, num_tokens=8, num_attention_pairs=8 * 500,
                  device_seconds=0.02, host_seconds=0.002, pack_seconds=0.001, num_output_tokens=8,
                  estimated_bytes=1.6e8, estimated_flops=2e9, host_gap_seconds=0.001,
                  bandwidth_utilization=0.8, compute_utilization=0.1)


def stats() -> EngineStats:
    return EngineStats(num_running=0, num_waiting=0, kv_pages_used=0, kv_pages_total=10, num_preemptions=0,
                       prefix_cache_queried_tokens=0, prefix_cache_hit_tokens=0)


@pytest.mark.parametrize("change, bound", [
    ({}, "bandwidth-bound"),
    ({"bandwidth_utilization": 0.2, "compute_utilization": 0.7}, "compute-bound"),
    ({"host_gap_seconds": 0.015, "host_seconds": 0.006}, "scheduling-bound"),  # host 21 ms of 41
    ({"bandwidth_utilization": None, "compute_utilization": None}, "device-bound"),
])
def test_the_bound_of_a_run_from_its_steps_and_from_its_metrics(change, bound):
    steps = [dataclasses.replace(STEP, **change)] * 5
    verdict = diagnosis.diagnose_steps(steps)
    assert verdict.bound == bound and verdict.num_steps == 5
    metrics = ServerMetrics(stats)
    for step in steps:
        metrics.observe_step(step)
    from_text = diagnose_metrics_text(metrics.render()[0].decode())
    assert from_text.bound == bound
    for field in ("num_steps", "device_seconds", "host_seconds", "host_gap_seconds", "host_fraction",
                  "bandwidth_utilization", "compute_utilization"):
        assert getattr(from_text, field) == pytest.approx(getattr(verdict, field)), field


def test_the_diagnosis_metrics_are_exported():
    metrics = ServerMetrics(stats)
    metrics.observe_step(STEP)
    metrics.observe_step(dataclasses.replace(STEP, kind="prefill", bandwidth_utilization=None, compute_utilization=None))
    text = metrics.render()[0].decode()
    assert 'jaxserve_step_bandwidth_utilization_count{kind="decode",model_name="model"} 1.0' in text
    assert 'jaxserve_step_bandwidth_utilization_bucket{kind="decode",le="0.8",model_name="model"} 1.0' in text
    assert 'jaxserve_step_compute_utilization_sum{kind="decode",model_name="model"} 0.1' in text
    assert 'kind="prefill"' in text and 'jaxserve_step_compute_utilization_count{kind="prefill"' not in text
    assert 'jaxserve_step_host_gap_seconds_count{model_name="model"} 2.0' in text
    assert 'jaxserve_step_host_seconds_total{kind="decode",model_name="model"} 0.002' in text


def test_no_steps_is_idle():
    assert diagnosis.diagnose_steps([]).bound == "idle"
    assert diagnose_metrics_text("") is None  # no step metrics: a server that is not jaxserve


def test_a_runs_bound_counts_only_the_steps_between_two_scrapes():
    metrics = ServerMetrics(stats)
    for _ in range(4):  # before the run: compute-bound steps
        metrics.observe_step(dataclasses.replace(STEP, bandwidth_utilization=0.1, compute_utilization=0.9))
    before = metrics.render()[0].decode()
    for _ in range(3):  # the run: bandwidth-bound steps
        metrics.observe_step(STEP)
    section = server_metrics.step_metrics_delta(before, metrics.render()[0].decode())
    verdict = server_metrics.run_bound(section)
    assert verdict.bound == "bandwidth-bound" and verdict.num_steps == 3
    assert verdict.device_seconds == pytest.approx(3 * STEP.device_seconds)
    assert verdict.bandwidth_utilization == pytest.approx(0.8)
    assert diagnose_metrics_text(metrics.render()[0].decode()).num_steps == 7
