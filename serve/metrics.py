"""Prometheus metrics of the server, in a registry of its own (one per app).

Request counters and histograms are fed by the handlers through a `RequestTracker` per choice:
token counts, latencies seen by the client (TTFT, inter-token, end to end) and, from the finished
delta's `RequestMetrics`, the engine's phases (queue, prefill, decode); the engine gauges (running,
waiting, KV pages and their used fraction, preemptions, prefix cache) are read from
`engine.stats()` at scrape time; the step histograms (time and tokens per step, by kind) are fed
by the engine's `StepRecord`s (`observe_step`, an engine step listener, called on the engine
thread). Every sample carries a `model_name` label (the served model's id), as vLLM's do, and the
names follow vLLM's (docs/metrics.md lists them).
"""
from __future__ import annotations

import functools
import itertools
import logging
import time
from typing import Any, Callable, Iterator, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from jaxserve.core.outputs import EngineStats, RequestMetrics, RequestOutput, StepRecord

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                    1800.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
                          5.0, 10.0)
_STEP_TOKEN_BUCKETS = tuple(2.0 ** i for i in range(14))  # 1 .. 8192 tokens
_PARAMS_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)
_GAP_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
_UTILIZATION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.5)


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
        yield gauge("jaxserve_kv_pages_capacity", "KV cache pages requests can use (the pool less its null page).",
                    s.kv_pages_total)
        yield gauge("jaxserve_kv_cache_usage_perc", "Fraction of the KV cache pages in use (0 to 1; vLLM's "
                    "kv_cache_usage_perc).", s.kv_pages_used / s.kv_pages_total if s.kv_pages_total else 0.0)
        yield gauge("jaxserve_weights_bytes", "Bytes of the model weights on the devices (quantized "
                    "sizes when quantized).", s.weights_bytes)
        yield gauge("jaxserve_kv_cache_bytes", "Bytes of the KV page pool (int8 scales included).", s.kv_cache_bytes)
        yield counter("jaxserve_num_preemptions", "Requests preempted (recomputed) for lack of pages (vLLM's "
                      "num_preemptions).", s.num_preemptions)
        yield gauge("jaxserve_warmup_shapes_compiled", "Warm-up: step, sampler and prompt-logprob shapes "
                    "compiled so far.", s.warmup_shapes_compiled)
        yield gauge("jaxserve_warmup_shapes", "Warm-up: the shapes it compiles in all (0: no warm-up).",
                    s.warmup_shapes_total)
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
        if s.kv_offload_host_pages_total:
            yield from self._kv_offload_metrics(s, gauge, counter)
        if s.max_lora:  # vLLM's lora_requests_info: the adapters in the labels, the time as the value
            info = GaugeMetricFamily(
                "jaxserve_lora_requests_info", "LoRA: the adapters of the running and the waiting requests "
                "(comma-separated labels) and --max_loras; the value is the time of the scrape.",
                labels=["model_name", "running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            info.add_metric([self.model_name, ",".join(s.lora_running), ",".join(s.lora_waiting), str(s.max_lora)],
                            time.time())
            yield info


    def _kv_offload_metrics(self, s: EngineStats, gauge, counter) -> Iterator[Metric]:
        """KV offload's tiers (docs/kv_offload.md): vLLM's external prefix cache counters, and per tier
        or direction its hits, pages and bytes moved."""
        yield counter("jaxserve_external_prefix_cache_queries", "KV offload: prompt tokens looked up in the host "
                      "and disk tiers (past the device's prefix cache hits).", s.kv_offload_queried_tokens)
        restored = s.kv_offload_host_hit_tokens + s.kv_offload_disk_hit_tokens
        yield counter("jaxserve_external_prefix_cache_hits", "KV offload: prompt tokens restored from the host "
                      "and disk tiers instead of computed.", restored)
        tiers = (("host", s.kv_offload_host_hit_tokens, s.kv_offload_host_pages_used, s.kv_offload_host_pages_total),
                 ("disk", s.kv_offload_disk_hit_tokens, s.kv_offload_disk_pages_used, s.kv_offload_disk_pages_total))
        families = [(CounterMetricFamily, "jaxserve_kv_offload_hits", "KV offload: prompt tokens restored, by tier."),
                    (GaugeMetricFamily, "jaxserve_kv_offload_pages_used", "KV offload: pages the tier holds "
                     "(or is receiving)."),
                    (GaugeMetricFamily, "jaxserve_kv_offload_pages_capacity", "KV offload: pages the tier can hold.")]
        for column, (kind, name, documentation) in enumerate(families, start=1):
            family = kind(name, documentation, labels=["model_name", "tier"])
            for tier in tiers:
                if tier[3]:
                    family.add_metric([self.model_name, tier[0]], tier[column])
            yield family
        moved = CounterMetricFamily("jaxserve_kv_offload_bytes", "KV offload: bytes copied, by direction (to_host: "
                                    "evicted pages saved; to_device: pages restored; to_disk: host pages spilled).",
                                    labels=["model_name", "direction"])
        for direction, value in (("to_host", s.kv_offload_bytes_to_host), ("to_device", s.kv_offload_bytes_to_device),
                                 ("to_disk", s.kv_offload_bytes_to_disk)):
            moved.add_metric([self.model_name, direction], value)
        yield moved
        yield counter("jaxserve_kv_offload_dropped_pages", "KV offload: evicted pages not kept (every host block "
                      "was being written or read).", s.kv_offload_dropped_pages)


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


def token_count_buckets(max_model_len: int | None) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the first bound at or past `max_model_len` (vLLM's 1-2-5
    buckets of token counts); without it, up to 1e6."""
    limit, buckets = max_model_len or 1_000_000, []
    for exponent in itertools.count():
        for mantissa in (1, 2, 5):
            buckets.append(float(mantissa * 10 ** exponent))
            if buckets[-1] >= limit:
                return tuple(buckets)


class ServerMetrics:
    """The server's metrics. Names are vLLM's with `jaxserve_` for `vllm:` wherever jaxserve
    measures the same thing, so that one relabel rule serves vLLM's dashboards (docs/metrics.md)."""

    def __init__(self, engine_stats: Callable[[], EngineStats], model_name: str = "model",
                 max_model_len: int | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._define_request_metrics(token_count_buckets(max_model_len))
        self._define_step_metrics()
        self.registry.register(_EngineStatsCollector(engine_stats, model_name))

    def _metric(self, kind: type, name: str, documentation: str, labels: tuple[str, ...] = (),
                **kwargs: Any) -> _Labeled:
        metric = kind(name, documentation, ["model_name", *labels], registry=self.registry, **kwargs)
        return _Labeled(metric, self.model_name, bool(labels))

    def _define_request_metrics(self, token_buckets: tuple[float, ...]) -> None:
        m = self._metric
        self.http_requests = m(Counter, "jaxserve_http_requests", "HTTP requests by route and status code.",
                               ("route", "status"))
        self.request_success = m(Counter, "jaxserve_request_success", "Generation requests (choices) finished, "
                                 "by finish reason (vLLM's request_success; stop, length, abort, error, "
                                 "invalid_request).", ("finished_reason",))
        self.requests_finished = m(Counter, "jaxserve_requests_finished", "The same count as "
                                   "jaxserve_request_success under jaxserve's first name and label "
                                   "(finish_reason; invalid_request: ended by a limit its own input met, e.g. "
                                   "of its grammar; error: the server's).", ("finish_reason",))
        self.lora_requests = m(Counter, "jaxserve_lora_requests", "LoRA: requests (prompts) admitted for each "
                               "adapter.", ("lora_name",))
        self.prompt_tokens = m(Counter, "jaxserve_prompt_tokens", "Prompt tokens of finished requests (each "
                               "prompt once, however many choices it has).")
        self.generation_tokens = m(Counter, "jaxserve_generation_tokens", "Tokens generated.")
        self.time_to_first_token = m(Histogram, "jaxserve_time_to_first_token_seconds", "From arrival to the "
                                     "first token.", buckets=_LATENCY_BUCKETS)
        self.inter_token_latency = m(Histogram, "jaxserve_inter_token_latency_seconds", "Between two deltas of "
                                     "a request that carry tokens (a delta holds one step's tokens: several "
                                     "with speculative or multi-step decoding).", buckets=_TOKEN_LATENCY_BUCKETS)
        self.time_per_output_token = m(Histogram, "jaxserve_time_per_output_token_seconds", "Mean time "
                                       "between output tokens of a request (one sample per request).",
                                       buckets=_TOKEN_LATENCY_BUCKETS)
        self.e2e_latency = m(Histogram, "jaxserve_e2e_request_latency_seconds", "From arrival to the last "
                             "token.", buckets=_LATENCY_BUCKETS)
        phases = {"queue": "Waiting in the engine's queue until first scheduled.",
                  "prefill": "From first scheduled to the first token.",
                  "decode": "From the first token to the end.",
                  "inference": "From first scheduled to the end (prefill and decode)."}
        self.phase_time = {phase: m(Histogram, f"jaxserve_request_{phase}_time_seconds", text,
                                    buckets=_LATENCY_BUCKETS) for phase, text in phases.items()}
        self.request_prompt_tokens = m(Histogram, "jaxserve_request_prompt_tokens", "Prompt tokens per "
                                       "request (choice).", buckets=token_buckets)
        self.request_generation_tokens = m(Histogram, "jaxserve_request_generation_tokens", "Tokens "
                                           "generated per request (choice).", buckets=token_buckets)
        self.request_max_tokens = m(Histogram, "jaxserve_request_params_max_tokens", "The max_tokens of "
                                    "each request (choice).", buckets=token_buckets)
        self.request_n = m(Histogram, "jaxserve_request_params_n", "The n of each prompt.",
                           buckets=_PARAMS_N_BUCKETS)
        self.request_max_generation_tokens = m(Histogram, "jaxserve_request_max_num_generation_tokens",
                                               "Per prompt, the most tokens one of its choices generated.",
                                               buckets=token_buckets)

    def _define_step_metrics(self) -> None:
        m = self._metric
        self.step_seconds = m(Histogram, "jaxserve_step_duration_seconds", "Engine step time (device and host) "
                              "by kind: decode, prefill, mixed or verify (speculative).", ("kind",),
                              buckets=_TOKEN_LATENCY_BUCKETS)
        self.step_device_seconds = m(Counter, "jaxserve_step_device_seconds", "Device time of engine steps "
                                     "(forward and sampler) by kind.", ("kind",))
        self.step_tokens = m(Histogram, "jaxserve_step_tokens", "Tokens computed per engine step by kind.",
                             ("kind",), buckets=_STEP_TOKEN_BUCKETS)
        self.step_padded_tokens = m(Counter, "jaxserve_step_padded_tokens", "Token rows the compiled steps "
                                    "computed, padding included (tokens / this: padding efficiency).")
        # Histograms, not gauges: one scrape every few seconds would see one step of hundreds, and the
        # decode and prefill steps of a run sit at different utilizations (labelled by kind).
        self.step_host_seconds = m(Counter, "jaxserve_step_host_seconds", "Host time of engine steps (scheduling, "
                                   "packing, stop checks, detokenizing) by kind.", ("kind",))
        self.step_host_gap = m(Histogram, "jaxserve_step_host_gap_seconds", "From the end of one engine step to "
                               "the start of the next while requests were unfinished (the device idle on the "
                               "host loop).", buckets=_GAP_BUCKETS)
        self.step_bandwidth_use = m(Histogram, "jaxserve_step_bandwidth_utilization", "Per step: estimated bytes "
                                    "moved / device seconds / the device's memory bandwidth (steps of a device "
                                    "whose ceilings are known).", ("kind",), buckets=_UTILIZATION_BUCKETS)
        self.step_compute_use = m(Histogram, "jaxserve_step_compute_utilization", "Per step: estimated FLOPs / "
                                  "device seconds / the device's peak FLOP/s.", ("kind",), buckets=_UTILIZATION_BUCKETS)

    def observe_step(self, record: StepRecord) -> None:
        """One engine step (an engine step listener; thread-safe)."""
        self.step_seconds.labels(kind=record.kind).observe(record.seconds)
        self.step_device_seconds.labels(kind=record.kind).inc(record.device_seconds)
        self.step_tokens.labels(kind=record.kind).observe(record.num_tokens)
        self.step_padded_tokens.inc(record.num_padded_tokens)
        self.step_host_seconds.labels(kind=record.kind).inc(max(record.host_seconds, 0.0))
        self.step_host_gap.observe(record.host_gap_seconds)
        if record.bandwidth_utilization is not None:
            self.step_bandwidth_use.labels(kind=record.kind).observe(record.bandwidth_utilization)
        if record.compute_utilization is not None:
            self.step_compute_use.labels(kind=record.kind).observe(record.compute_utilization)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def trackers(self, arrival_time: float, prompts: Sequence[tuple[int, int]], choices_per_prompt: int = 1,
                 n: int = 1) -> list["RequestTracker"]:
        """The trackers of one HTTP request's choices, in sequence order (prompt p's choices are
        p * choices_per_prompt ..). `prompts`: (prompt tokens, max_tokens) of each prompt; `n`: the
        request's n (observed once per prompt)."""
        trackers = []
        for num_prompt_tokens, max_tokens in prompts:
            group = _PromptGroup(self, choices_per_prompt, n)
            trackers += [RequestTracker(self, arrival_time, num_prompt_tokens, max_tokens, group, count_prompt=j == 0)
                         for j in range(choices_per_prompt)]
        return trackers


class _PromptGroup:
    """The choices of one prompt: when the last one ends, the prompt's n and its longest output
    are observed."""

    def __init__(self, metrics: ServerMetrics, num_choices: int, n: int) -> None:
        self.metrics, self.num_left, self.n = metrics, num_choices, n
        self.max_generation_tokens = 0

    def choice_finished(self, num_output_tokens: int) -> None:
        self.num_left -= 1
        self.max_generation_tokens = max(self.max_generation_tokens, num_output_tokens)
        if self.num_left == 0:
            self.metrics.request_n.observe(self.n)
            self.metrics.request_max_generation_tokens.observe(self.max_generation_tokens)


class RequestTracker:
    """Timing of one choice; `observe` is called with every delta the engine yields. Only the
    first choice of a prompt (`count_prompt`) adds its prompt tokens to jaxserve_prompt_tokens."""

    def __init__(self, metrics: ServerMetrics, arrival_time: float, num_prompt_tokens: int, max_tokens: int,
                 group: _PromptGroup, count_prompt: bool = True) -> None:
        self.metrics = metrics
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.group = group
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
            else:
                m.inter_token_latency.observe(now - self.last_token_time)
            self.last_token_time = now
        if output.finished:  # an error the request's own input caused (its grammar) is not the server's
            reason = "invalid_request" if output.error_param is not None else output.finish_reason
            self.finish(reason or "abort", now, output.metrics)

    def finish(self, finish_reason: str, now: float | None = None, phases: RequestMetrics | None = None) -> None:
        """Records the end of the request once (later calls do nothing); `phases`: the engine's
        times of the request, when its finished delta came."""
        if self.done:
            return
        now = time.monotonic() if now is None else now
        self.done = True
        m = self.metrics
        m.request_success.labels(finished_reason=finish_reason).inc()
        m.requests_finished.labels(finish_reason=finish_reason).inc()
        if self.count_prompt:
            m.prompt_tokens.inc(self.num_prompt_tokens)
        m.e2e_latency.observe(now - self.arrival_time)
        if self.first_token_time is not None and self.num_output_tokens > 1:
            m.time_per_output_token.observe((now - self.first_token_time) / (self.num_output_tokens - 1))
        m.request_prompt_tokens.observe(self.num_prompt_tokens)
        m.request_generation_tokens.observe(self.num_output_tokens)
        m.request_max_tokens.observe(self.max_tokens)
        if phases is not None:
            for phase, seconds in (("queue", phases.queue_seconds), ("prefill", phases.prefill_seconds),
                                   ("decode", phases.decode_seconds), ("inference", phases.inference_seconds)):
                if seconds is not None:
                    m.phase_time[phase].observe(seconds)
        self.group.choice_finished(self.num_output_tokens)
