"""The server's own step diagnosis over a run: `jaxserve_step_*` metrics from `{base_url}/metrics`.

`scrape` reads the Prometheus text before and after a run; `step_metrics_delta` keeps the families
named `jaxserve_step_*` (jaxserve's per-step bandwidth and compute utilization and host gap) and
returns, per family, what changed over the run: histogram and summary `sum`/`count` deltas and
their mean, counter deltas, gauges' last value; labelled families also by label set. A server
without such metrics (vLLM, llama.cpp's server) gives None, and the result has no
`server_step_metrics`. `run_bound` names the bound the run hit from that section
(jaxserve.core.diagnosis: scheduling-, bandwidth- or compute-bound).
"""
from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.core import diagnosis

STEP_PREFIX = "jaxserve_step_"


async def scrape(session: aiohttp.ClientSession, base_url: str) -> str | None:
    """The /metrics text, or None when the server has none (any error or a non-200 answer)."""
    try:
        async with session.get(base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as response:
            return await response.text(errors="replace") if response.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None


SUFFIX_KEYS = {"_sum": "sum", "_count": "count", "_total": "total", "": "value"}  # `_created`, `_bucket`: left out


def _label_key(labels: dict[str, str]) -> str:
    """`kind=decode` for a sample's labels, histogram `le` and summary `quantile` left out."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k not in ("le", "quantile"))


def _totals(text: str | None) -> dict[str, dict[str, dict[str, float]]]:
    """{family: {label key: {"sum"|"count"|"total"|"value": value}}} of the jaxserve_step_* families."""
    families: dict[str, dict[str, dict[str, float]]] = {}
    if not text:
        return families
    try:
        parsed = list(text_string_to_metric_families(text))
    except ValueError:  # not Prometheus text: treated as no metrics
        return families
    for family in parsed:
        if not family.name.startswith(STEP_PREFIX) or family.name.endswith("_created"):
            continue
        for sample in family.samples:
            key = SUFFIX_KEYS.get(sample.name[len(family.name):])
            if key is not None:
                series = families.setdefault(family.name, {}).setdefault(_label_key(sample.labels), {})
                series[key] = series.get(key, 0.0) + float(sample.value)
    return families


def _delta(now: dict[str, float], old: dict[str, float]) -> dict:
    """One series over the run: sum/count deltas and mean, a counter's delta, or a gauge's value."""
    if "count" in now:
        count = now["count"] - old.get("count", 0.0)
        total = now.get("sum", 0.0) - old.get("sum", 0.0)
        return {"sum": total, "count": count, "mean": total / count if count > 0 else None}
    if "total" in now:
        return {"delta": now["total"] - old.get("total", 0.0)}
    return {"value": now.get("value")}


def _combined(series: list[dict]) -> dict:
    """The label sets of one family added up (a gauge only when it has one label set: values of
    fractions or levels do not add)."""
    out: dict = {}
    for entry in series:
        for key, value in entry.items():
            if key != "mean" and value is not None and (key != "value" or len(series) == 1):
                out[key] = out.get(key, 0.0) + value
    if "count" in out:
        out["mean"] = out.get("sum", 0.0) / out["count"] if out["count"] > 0 else None
    return out


def step_metrics_delta(before: str | None, after: str | None) -> dict | None:
    """Per jaxserve_step_* family, the run's change (see `_delta`) summed over its label sets, with
    `by_labels` for a labelled family; None when the server has no such metrics."""
    start, end = _totals(before), _totals(after)
    section = {}
    for name, by_key in sorted(end.items()):
        deltas = {key: _delta(now, start.get(name, {}).get(key, {})) for key, now in sorted(by_key.items())}
        entry = _combined(list(deltas.values()))
        if any(deltas):  # labelled series: keep each one
            entry["by_labels"] = deltas
        section[name] = entry
    return section or None


def run_bound(section: dict | None) -> diagnosis.RunBound | None:
    """The run's bound from its `step_metrics_delta` section: the steps' device and host seconds,
    the host gaps between them and their mean utilizations; None without jaxserve's step metrics."""
    if not section or "jaxserve_step_duration_seconds" not in section:
        return None

    def figure(family: str, key: str) -> float | None:
        return section.get(family, {}).get(key)

    return diagnosis.diagnose_totals(
        num_steps=int(figure("jaxserve_step_duration_seconds", "count") or 0),
        device_seconds=figure("jaxserve_step_device_seconds", "delta") or 0.0,
        host_seconds=figure("jaxserve_step_host_seconds", "delta") or 0.0,
        host_gap_seconds=figure("jaxserve_step_host_gap_seconds", "sum") or 0.0,
        bandwidth_utilization=figure("jaxserve_step_bandwidth_utilization", "mean"),
        compute_utilization=figure("jaxserve_step_compute_utilization", "mean"))
