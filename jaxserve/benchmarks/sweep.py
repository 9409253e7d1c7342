"""A sweep's verdict and table: the largest level that meets the SLOs, cost per million tokens.

A level meets the SLOs when all its requests completed and, for each `--goodput` metric, the P99
over its requests is within the SLO (a run whose requests all produced one token has no TPOT and
meets a TPOT SLO). `max_concurrency_meeting_slo` (`max_request_rate_meeting_slo` for a rate
sweep) is the largest such level, None when none does or no --goodput was given.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxserve.benchmarks.results import RequestMetrics, metric_values, percentile_ms

VERDICT_KEYS = {"max_concurrency": "max_concurrency_meeting_slo", "request_rate": "max_request_rate_meeting_slo"}
SLO_DEFINITION = ("the largest level at which every request completed and the P99 of each --goodput metric "
                  "(ttft, tpot, e2el) is within its SLO")


def level_meets_slos(result: dict, metrics: Sequence[RequestMetrics], slos: dict[str, float]) -> bool:
    """Whether one level's run meets every SLO (ms) at P99, with no failed request."""
    if not slos or result["failed"] or not result["completed"]:
        return False
    for name, limit_ms in slos.items():
        p99 = percentile_ms(metrics, name, 99.0)
        if p99 is None and name != "tpot":
            return False
        if p99 is not None and p99 > limit_ms:
            return False
    return True


def best_level(levels: Sequence[float], passed: Sequence[bool]) -> float | None:
    """The largest level that passed, None when none did."""
    good = [level for level, ok in zip(levels, passed) if ok]
    return max(good) if good else None


def cost_per_million_output_tokens(hour_usd: float, output_throughput: float) -> float | None:
    """USD per million output tokens at `output_throughput` tok/s for a machine at `hour_usd`/hour."""
    return hour_usd / 3600.0 / output_throughput * 1e6 if output_throughput > 0 else None


def table_row(level: float, result: dict, metrics: Sequence[RequestMetrics]) -> dict:
    """What the sweep table and plot show of one level (P99s in ms whatever --metric_percentiles)."""
    tpots = metric_values(metrics, "tpot")
    return {"level": level, "completed": result["completed"], "failed": result["failed"],
            "request_throughput": result["request_throughput"], "output_throughput": result["output_throughput"],
            "p99_ttft_ms": percentile_ms(metrics, "ttft", 99.0), "p99_tpot_ms": percentile_ms(metrics, "tpot", 99.0),
            "mean_tpot_ms": float(np.mean(tpots)) * 1e3 if tpots else None,
            "request_goodput": result.get("request_goodput"),
            "cost_per_million_output_tokens_usd": result.get("cost_per_million_output_tokens_usd")}


def _cell(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def format_table(kind: str, results: Sequence[dict]) -> str:
    """One row per level (`table_row`s): completed, request/s, output tok/s, P99 TTFT/TPOT, goodput
    (with --goodput) and cost (with --hour_usd)."""
    with_goodput = any(r["request_goodput"] is not None for r in results)
    with_cost = any(r["cost_per_million_output_tokens_usd"] is not None for r in results)
    header = [kind, "completed", "req/s", "out tok/s", "P99 TTFT ms", "P99 TPOT ms"]
    header += ["goodput req/s"] * with_goodput + ["USD/1M out"] * with_cost
    rows = []
    for r in results:
        row = [_cell(r["level"], "g"), f"{r['completed']}/{r['completed'] + r['failed']}",
               _cell(r["request_throughput"], ".2f"), _cell(r["output_throughput"], ".1f"),
               _cell(r["p99_ttft_ms"], ".1f"), _cell(r["p99_tpot_ms"], ".1f")]
        row += [_cell(r["request_goodput"], ".2f")] * with_goodput
        row += [_cell(r["cost_per_million_output_tokens_usd"], ".4f")] * with_cost
        rows.append(row)
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
