"""The server's own step diagnosis over a run: `jaxserve_step_*` metrics from `{base_url}/metrics`.

`scrape` reads the Prometheus text before and after a run; `step_metrics_delta` keeps the families
named `jaxserve_step_*` (jaxserve's per-step bandwidth and compute utilization and host gap) and
returns, per family, what changed over the run: histogram and summary `sum`/`count` deltas and
their mean, counter deltas, gauges' last value. A server without such metrics (vLLM, llama.cpp's
server, a jaxserve without them) gives None, and the result has no `server_step_metrics`.
"""
from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

STEP_PREFIX = "jaxserve_step_"


async def scrape(session: aiohttp.ClientSession, base_url: str) -> str | None:
    """The /metrics text, or None when the server has none (any error or a non-200 answer)."""
    try:
        async with session.get(base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as response:
            return await response.text(errors="replace") if response.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return None


def _totals(text: str | None) -> dict[str, dict[str, float]]:
    """{family: {"sum"|"count"|"total"|"value": value summed over label sets}} of jaxserve_step_*."""
    families: dict[str, dict[str, float]] = {}
    if not text:
        return families
    try:
        parsed = list(text_string_to_metric_families(text))
    except ValueError:  # not Prometheus text: treated as no metrics
        return families
    for family in parsed:
        if not family.name.startswith(STEP_PREFIX):
            continue
        totals = families.setdefault(family.name, {})
        for sample in family.samples:
            suffix = sample.name[len(family.name):]
            key = {"_sum": "sum", "_count": "count", "_total": "total", "": "value"}.get(suffix)
            if key is not None:
                totals[key] = totals.get(key, 0.0) + float(sample.value)
    return families


def step_metrics_delta(before: str | None, after: str | None) -> dict | None:
    """Per jaxserve_step_* family: the run's sum/count deltas and mean (histograms, summaries),
    the delta (counters), or the value after the run (gauges); None when there are none."""
    start, end = _totals(before), _totals(after)
    if not end:
        return None
    section = {}
    for name, totals in sorted(end.items()):
        old = start.get(name, {})
        entry = {}
        if "count" in totals:
            entry["sum"] = totals.get("sum", 0.0) - old.get("sum", 0.0)
            entry["count"] = totals["count"] - old.get("count", 0.0)
            entry["mean"] = entry["sum"] / entry["count"] if entry["count"] > 0 else None
        elif "total" in totals:
            entry["delta"] = totals["total"] - old.get("total", 0.0)
        elif "value" in totals:
            entry["value"] = totals["value"]
        section[name] = entry
    return section
