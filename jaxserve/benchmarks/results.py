"""From request timelines to `vllm bench serve`'s result: TTFT, TPOT, ITL, E2EL, goodput.

Pure functions of the `RequestRecord`s `client.send` returns (no clock, no network), so the
arithmetic is tested exactly:
- TTFT: first chunk with text - send time; E2EL: end of stream - send time.
- ITL: the gaps between consecutive chunks with text (all requests' gaps pooled).
- TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token.
- output tokens: the final usage chunk's `completion_tokens` when the server sent one, else the
  tokenizer's count of the text, else the number of chunks (`output_token_source` says which).
- request goodput: requests per second that met every `--goodput` SLO (a request without a TPOT,
  one output token, meets the TPOT SLO; one without a first chunk misses the TTFT SLO).
- multi-turn runs (`ttft_by_turn`): the TTFT statistics of each turn index over the conversations
  (`ttft_by_turn_ms`), and the mean TTFT of every completed request of turns 2..T
  (`mean_ttft_later_turns_ms`), the turns whose prompts repeat a history the server has seen.
Latency statistics are in milliseconds; `None` (JSON null) when a run has no value for them.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from jaxserve.benchmarks.client import RequestRecord

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """One finished request's latencies in seconds (None where undefined) and token counts."""

    ttft: float | None
    tpot: float | None
    itls: list[float]
    e2el: float
    input_len: int
    output_len: int
    output_token_source: str  # "usage", "tokenizer" or "chunks"


def request_metrics(record: RequestRecord, count_tokens: Callable[[str], int] | None = None) -> RequestMetrics:
    """The latencies of one successful request, from its recorded times."""
    if record.usage_completion_tokens is not None:
        output_len, source = record.usage_completion_tokens, "usage"
    elif count_tokens is not None:
        output_len, source = count_tokens(record.text), "tokenizer"
    else:
        output_len, source = len(record.chunk_times), "chunks"
    times = record.chunk_times
    ttft = times[0] - record.start if times else None
    e2el = record.end - record.start
    tpot = (e2el - ttft) / (output_len - 1) if ttft is not None and output_len > 1 else None
    itls = [b - a for a, b in zip(times, times[1:])]
    return RequestMetrics(ttft, tpot, itls, e2el, record.prompt_len, output_len, source)


def parse_goodput(text: str | None) -> dict[str, float]:
    """`ttft:800,tpot:80` -> {"ttft": 800.0, "tpot": 80.0} (milliseconds); ValueError on bad input."""
    slos: dict[str, float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput: {item.strip()!r} is not METRIC:MS with METRIC one of {', '.join(GOODPUT_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput: {value.strip()!r} is not a number of milliseconds") from None
        if not slos[name] > 0:
            raise ValueError(f"--goodput: the {name} SLO must be > 0 ms, got {value.strip()}")
    return slos


def parse_percentiles(text: str) -> list[float]:
    """`50,90,99` -> [50.0, 90.0, 99.0]; ValueError outside (0, 100]."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--metric_percentiles: {text!r} is not a comma list of numbers") from None
    if not values or not all(0 < v <= 100 for v in values):
        raise ValueError(f"--metric_percentiles: each must be in (0, 100], got {text!r}")
    return values


def parse_metric_names(text: str) -> list[str]:
    """`ttft,tpot` -> ["ttft", "tpot"]; ValueError for a name outside METRICS."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METRICS]
    if unknown or not names:
        raise ValueError(f"--percentile_metrics: {', '.join(unknown) or 'none given'}; choose from {', '.join(METRICS)}")
    return names


def percentile_key(p: float) -> str:
    """vLLM's key for a percentile: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def metric_values(metrics: Sequence[RequestMetrics], name: str) -> list[float]:
    """The values of `name` in seconds (ITL: every gap of every request)."""
    if name == "itl":
        return [gap for m in metrics for gap in m.itls]
    return [getattr(m, name) for m in metrics if getattr(m, name) is not None]


def percentile_ms(metrics: Sequence[RequestMetrics], name: str, p: float) -> float | None:
    """The `p`-th percentile of `name` in ms (numpy's linear interpolation), None without values."""
    values = metric_values(metrics, name)
    return float(np.percentile(np.asarray(values) * 1e3, p)) if values else None


def meets_slos(m: RequestMetrics, slos: dict[str, float]) -> bool:
    """Whether one request met every SLO (ms); see the module docstring for undefined values."""
    for name, limit_ms in slos.items():
        value = getattr(m, name)
        if value is None:
            if name == "tpot":
                continue
            return False
        if value * 1e3 > limit_ms:
            return False
    return True


def _stats(values_s: list[float], percentiles: Sequence[float], name: str) -> dict[str, float | None]:
    """mean/median/std/pNN of one metric, in ms."""
    ms = np.asarray(values_s, dtype=np.float64) * 1e3  # [num values]
    stats: dict[str, float | None] = {}
    for stat, fn in (("mean", np.mean), ("median", np.median), ("std", np.std)):
        stats[f"{stat}_{name}_ms"] = float(fn(ms)) if ms.size else None
    for p in percentiles:
        stats[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else None
    return stats


def _token_source(metrics: Sequence[RequestMetrics]) -> str | None:
    sources = sorted({m.output_token_source for m in metrics})
    return ",".join(sources) if sources else None


def summarize(records: Sequence[RequestRecord], duration: float, *, percentile_metrics: Sequence[str] = METRICS,
              percentiles: Sequence[float] = (99.0,), slos: dict[str, float] | None = None,
              count_tokens: Callable[[str], int] | None = None) -> tuple[dict, list[RequestMetrics]]:
    """(the result dict with vLLM's field names, the successful requests' metrics)."""
    metrics = [request_metrics(r, count_tokens) for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    input_tokens = sum(m.input_len for m in metrics)
    output_tokens = sum(m.output_len for m in metrics)
    rate = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    result = {
        "completed": len(metrics), "failed": len(failed), "duration": duration,
        "retried": sum(r.retries > 0 for r in records),  # sent again after a closed keep-alive connection
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": rate(len(metrics)), "output_throughput": rate(output_tokens),
        "total_token_throughput": rate(input_tokens + output_tokens),
        "output_token_source": _token_source(metrics),
    }
    if slos:
        result["request_goodput"] = rate(sum(meets_slos(m, slos) for m in metrics))
    for name in percentile_metrics:
        result.update(_stats(metric_values(metrics, name), percentiles, name))
    if failed:
        result["first_error"] = failed[0].error
    return result, metrics


def ttft_by_turn(turn_of: Sequence[int], records: Sequence[RequestRecord], num_turns: int,
                 percentiles: Sequence[float] = (99.0,)) -> dict:
    """{"ttft_by_turn_ms": [{"turn": 1-based, "count", "mean_ttft_ms", "median_ttft_ms",
    "std_ttft_ms", "pNN_ttft_ms" (99 always, and each of `percentiles`), "mean_cached_tokens"},
    ...one per turn], "mean_ttft_later_turns_ms": the mean over turns 2..T's requests};
    `turn_of[i]` is record i's 0-based turn, and only successful requests with a first chunk
    count. `mean_cached_tokens`: of the prompt tokens the server's usage says it found cached
    (`prompt_tokens_details.cached_tokens`; None where the server does not say)."""
    ttfts: list[list[float]] = [[] for _ in range(num_turns)]  # [turn][request] seconds
    cached: list[list[int]] = [[] for _ in range(num_turns)]  # [turn][request] tokens
    for turn, r in zip(turn_of, records, strict=True):
        if r.ok and r.chunk_times:
            ttfts[turn].append(r.chunk_times[0] - r.start)
            if r.usage_cached_tokens is not None:
                cached[turn].append(r.usage_cached_tokens)
    shown = sorted({99.0, *percentiles})
    rows = [{"turn": t + 1, "count": len(values), **_stats(values, shown, "ttft"),
             "mean_cached_tokens": float(np.mean(cached[t])) if cached[t] else None} for t, values in enumerate(ttfts)]
    later = [value for values in ttfts[1:] for value in values]
    return {"ttft_by_turn_ms": rows, "mean_ttft_later_turns_ms": float(np.mean(later)) * 1e3 if later else None}


def format_turns(result: dict) -> list[str]:
    """The printed lines of `ttft_by_turn`'s figures in `result` (none when it has none)."""
    rows = result.get("ttft_by_turn_ms")
    if not rows:
        return []
    lines = ["{s:{c}^50}".format(s="TTFT by turn (ms)", c="-"),
             f"{'Turn':<6}{'Count':>6}{'Mean':>10}{'Median':>10}{'P99':>10}{'Cached':>8}"]
    lines += [f"{row['turn']:<6}{row['count']:>6}" + "".join(f"{_ms(row[key]):>10}" for key in
                                                           ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms"))
              + f"{_tokens(row.get('mean_cached_tokens')):>8}" for row in rows]
    if len(rows) > 1:
        lines.append(_line(f"Mean TTFT of turns 2..{len(rows)} (ms):", result.get("mean_ttft_later_turns_ms")))
    return lines


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _tokens(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def detailed(records: Sequence[RequestRecord], count_tokens: Callable[[str], int] | None = None) -> dict:
    """--save_detailed: per-request lists in send order, seconds as vLLM stores them (failed
    requests: TTFT/E2EL 0, output length 0, their message in `errors`; "" for the others)."""
    rows = [request_metrics(r, count_tokens) if r.ok else None for r in records]
    return {
        "ttfts": [(m.ttft or 0.0) if m else 0.0 for m in rows],
        "itls": [m.itls if m else [] for m in rows],
        "e2els": [m.e2el if m else 0.0 for m in rows],
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [m.output_len if m else 0 for m in rows],
        "errors": [r.error or "" for r in records],
    }


def _line(label: str, value) -> str:
    if value is None:
        text = "n/a"
    elif isinstance(value, float):
        text = f"{value:.2f}"
    else:
        text = str(value)
    return f"{label:<40} {text:<10}"


def format_summary(result: dict, percentile_metrics: Sequence[str], percentiles: Sequence[float]) -> str:
    """The printed result, laid out as vLLM's."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="="),
             _line("Successful requests:", result["completed"]), _line("Failed requests:", result["failed"]),
             _line("Requests sent again (closed connection):", result.get("retried", 0)),
             _line("Maximum request concurrency:", result.get("max_concurrency")),
             _line("Benchmark duration (s):", result["duration"]),
             _line("Total input tokens:", result["total_input_tokens"]),
             _line("Total generated tokens:", result["total_output_tokens"]),
             _line("Request throughput (req/s):", result["request_throughput"])]
    if "request_goodput" in result:
        lines.append(_line("Request goodput (req/s):", result["request_goodput"]))
    lines += [_line("Output token throughput (tok/s):", result["output_throughput"]),
              _line("Total token throughput (tok/s):", result["total_token_throughput"])]
    if result.get("cost_per_million_output_tokens_usd") is not None:
        lines.append(_line("Cost per 1M output tokens (USD):", result["cost_per_million_output_tokens_usd"]))
    for name in percentile_metrics:
        lines.append("{s:{c}^50}".format(s=METRIC_NAMES[name], c="-"))
        upper = name.upper()
        lines.append(_line(f"Mean {upper} (ms):", result[f"mean_{name}_ms"]))
        lines.append(_line(f"Median {upper} (ms):", result[f"median_{name}_ms"]))
        for p in percentiles:
            key = percentile_key(p)
            lines.append(_line(f"P{key[1:]} {upper} (ms):", result[f"{key}_{name}_ms"]))
    lines += format_turns(result)
    bound = result.get("server_bound")
    if bound is not None:  # jaxserve's own step metrics over the run
        lines.append("{s:{c}^50}".format(s="Server steps", c="-"))
        lines.append(_line("Bound:", bound["bound"]))
        lines.append(_line("Host share of step time:", f"{bound['host_fraction']:.0%}"))
        for key, label in (("bandwidth_utilization", "Bandwidth utilization:"),
                           ("compute_utilization", "Compute utilization:")):
            if bound[key] is not None:
                lines.append(_line(label, f"{bound[key]:.0%}"))
    lines.append("=" * 50)
    return "\n".join(lines)
