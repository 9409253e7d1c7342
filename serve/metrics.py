"""Prometheus metrics of the server, in a registry of its own (one per app).

Request counters and latency histograms are fed by the handlers; the engine gauges (running,
waiting, KV pages and their used fraction, preemptions, prefix cache) are read from
`engine.stats()` at scrape time; the step histograms (time and tokens per step, by kind) are fed
by the engine's `StepRecord`s (`observe_step`, an engine step listener, called on the engine
thread). Every sample carries a `model_name` label (the served model's id), as vLLM's do.
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from jaxserve.outputs import EngineStats, RequestOutput, StepRecord

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
_STEP_TOKEN_BUCKETS = tuple(2.0 ** i for i in range(14))  # 1 .. 8192 tokens


class _EngineStatsCollector:
    """Turns one `engine.stats()` call per scrape into gauges and counters."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        try:
            s = self.stats()
        except Exception:
            logger.exception("engine.stats() failed during a metrics scrape")
            return
        gauge, counter = (functools.partial(_metric, kind, self.model_name)
                          for kind in (GaugeMetricFamily, CounterMetricFamily))
        yield gauge("jaxserve_num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("jaxserve_num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting)
        yield gauge("jaxserve_kv_pages_used", "KV cache pages held by requests.", s.kv_pages_used)
        yield gauge("jaxserve_kv_pages_total", "KV cache pages requests can use (the pool less its null page).",
                    s.kv_pages_total)
        yield gauge("jaxserve_kv_cache_usage_perc", "Fraction of the KV cache pages in use (0 to 1; vLLM's "
                    "kv_cache_usage_perc).", s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 0.0)
        yield gauge("jaxserve_weights_bytes", "Bytes of the model weights on the devices (quantized "
                    "sizes when quantized).", s.weights_bytes)
        yield gauge("jaxserve_kv_cache_bytes", "Bytes of the KV page pool (int8 scales included).", s.kv_cache_bytes)
        yield counter("jaxserve_preemptions", "Requests preempted (recomputed) for lack of pages.", s.num_preemptions)
        yield counter("jaxserve_step_failures", "Engine steps that failed; their requests ended with an error.",
                      s.num_step_failures)
        yield counter("jaxserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      s.prefix_cache_queried_tokens)
        yield counter("jaxserve_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      s.prefix_cache_hit_tokens)
        hit_rate = s.prefix_cache_hit_tokens / s.prefix_cache_queried_tokens if s.prefix_cache_queried_tokens else 0.0
        yield gauge("jaxserve_prefix_cache_hit_rate", "Prefix cache hits / queries, in tokens.", hit_rate)
        yield counter("jaxserve_spec_decode_verify_steps", "Speculative decoding: verification steps.",
                      s.spec_verify_steps)
        yield counter("jaxserve_spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed.",
                      s.spec_proposed_tokens)
        yield counter("jaxserve_spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted.",
                      s.spec_accepted_tokens)
        per_position = CounterMetricFamily(
            "jaxserve_spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: proposed tokens accepted, by their position in the proposal (0: first).",
            labels=["model_name", "position"])
        for position, count in enumerate(s.spec_accepted_per_position):
            per_position.add_metric([self.model_name, str(position)], count)
        yield per_position


def _metric(kind: type, model_name: str, name: str, documentation: str, value: float) -> Metric:
    family = kind(name, documentation, labels=["model_name"])
    family.add_metric([model_name], value)
    return family


class _Labeled:
    """A labeled metric with `model_name` bound: `.labels(**others)` and, without other labels,
    the metric's own methods (inc, observe)."""

    def __init__(self, metric: Any, model_name: str, has_other_labels: bool) -> None:
        self._metric, self._model_name = metric, model_name
        self._child = None if has_other_labels else metric.labels(model_name=model_name)

    def labels(self, **labels: str) -> Any:
        return self._metric.labels(model_name=self._model_name, **labels)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._child, name)


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], EngineStats], model_name: str = "model") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.model_name = model_name

        def metric(kind, name, documentation, labels=(), **kwargs):
            return _Labeled(kind(name, documentation, ["model_name", *labels], registry=r, **kwargs), model_name,
                            bool(labels))

        self.http_requests = metric(Counter, "jaxserve_http_requests", "HTTP requests by route and status code.",
                                    ["route", "status"])
        self.requests_finished = metric(Counter, "jaxserve_requests_finished", "Generation requests (choices) by "
                                        "finish reason (invalid_request: ended by a limit its own input met, "
                                        "e.g. of its grammar; error: the server's).", ["finish_reason"])
        self.prompt_tokens = metric(Counter, "jaxserve_prompt_tokens", "Prompt tokens of finished requests (each "
                                    "prompt once, however many choices it has).")
        self.generation_tokens = metric(Counter, "jaxserve_generation_tokens", "Tokens generated.")
        self.time_to_first_token = metric(Histogram, "jaxserve_time_to_first_token_seconds", "From arrival to the "
                                          "first token.", buckets=_LATENCY_BUCKETS)
        self.time_per_output_token = metric(Histogram, "jaxserve_time_per_output_token_seconds", "Mean time "
                                            "between output tokens of a request.", buckets=_TOKEN_LATENCY_BUCKETS)
        self.e2e_latency = metric(Histogram, "jaxserve_e2e_request_latency_seconds", "From arrival to the last "
                                  "token.", buckets=_LATENCY_BUCKETS)
        self.step_seconds = metric(Histogram, "jaxserve_step_duration_seconds", "Engine step time (device and host) "
                                   "by kind: decode, prefill, mixed or verify (speculative).", ["kind"], buckets=_TOKEN_LATENCY_BUCKETS)
        self.step_device_seconds = metric(Counter, "jaxserve_step_device_seconds", "Device time of engine steps "
                                          "(forward and sampler) by kind.", ["kind"])
        self.step_tokens = metric(Histogram, "jaxserve_step_tokens", "Tokens computed per engine step by kind.",
                                  ["kind"], buckets=_STEP_TOKEN_BUCKETS)
        self.step_padded_tokens = metric(Counter, "jaxserve_step_padded_tokens", "Token rows the compiled steps "
                                         "computed, padding included (tokens / this: padding efficiency).")
        r.register(_EngineStatsCollector(engine_stats, model_name))

    def observe_step(self, record: StepRecord) -> None:
        """One engine step (an engine step listener; thread-safe)."""
        self.step_seconds.labels(kind=record.kind).observe(record.seconds)
        self.step_device_seconds.labels(kind=record.kind).inc(record.device_seconds)
        self.step_tokens.labels(kind=record.kind).observe(record.num_tokens)
        self.step_padded_tokens.inc(record.num_padded_tokens)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def tracker(self, arrival_time: float, num_prompt_tokens: int, count_prompt: bool = True) -> "RequestTracker":
        return RequestTracker(self, arrival_time, num_prompt_tokens, count_prompt)


class RequestTracker:
    """Timing of one choice; `observe` is called with every delta the engine yields. Only the
    first choice of a prompt (`count_prompt`) adds its prompt tokens to jaxserve_prompt_tokens."""

    def __init__(self, metrics: ServerMetrics, arrival_time: float, num_prompt_tokens: int,
                 count_prompt: bool = True) -> None:
        self.metrics = metrics
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.num_prompt_tokens = num_prompt_tokens
        self.count_prompt = count_prompt
        self.num_output_tokens = 0
        self.done = False

    def observe(self, output: RequestOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        self.num_prompt_tokens = output.num_prompt_tokens
        self.num_output_tokens = output.num_output_tokens
        if output.new_token_ids:
            m.generation_tokens.inc(len(output.new_token_ids))
            if self.first_token_time is None:
                self.first_token_time = now
                m.time_to_first_token.observe(now - self.arrival_time)
        if output.finished:  # an error the request's own input caused (its grammar) is not the server's
            reason = "invalid_request" if output.error_param is not None else output.finish_reason
            self.finish(reason or "abort", now)

    def finish(self, finish_reason: str, now: float | None = None) -> None:
        """Records the end of the request once (later calls do nothing)."""
        if self.done:
            return
        now = time.monotonic() if now is None else now
        self.done = True
        m = self.metrics
        m.requests_finished.labels(finish_reason=finish_reason).inc()
        if self.count_prompt:
            m.prompt_tokens.inc(self.num_prompt_tokens)
        m.e2e_latency.observe(now - self.arrival_time)
        if self.first_token_time is not None and self.num_output_tokens > 1:
            m.time_per_output_token.observe((now - self.first_token_time) / (self.num_output_tokens - 1))
