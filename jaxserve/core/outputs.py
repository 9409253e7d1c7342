"""What the engine hands back to its callers (server, CLI, benchmarks): plain dataclasses, no jax."""
from __future__ import annotations

import dataclasses
import time
from typing import Any


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full; the caller should retry later (HTTP 429)."""


class EngineUnavailableError(RuntimeError):
    """The engine takes no request now: not started, stopped, or its executor failed for good (a
    multi-host job that lost a process). The server answers 503."""


class StepInputError(ValueError):
    """The inputs of one request could not be packed into a step (nothing ran on the device)."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-N (token_id, logprob) pairs, best first
    rank: int | None = None  # prompt logprobs: the token's rank in its distribution (1 = the most likely)


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """When the engine saw one request pass its phases (vLLM's RequestMetrics), in `time.monotonic()`
    seconds of the engine's process: admitted, first scheduled, first output token, finished. A
    phase the request never reached is None (e.g. aborted while waiting: never scheduled)."""
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float

    @property
    def queue_seconds(self) -> float | None:
        """Waiting to be scheduled the first time."""
        return _between(self.arrival_time, self.first_scheduled_time)

    @property
    def prefill_seconds(self) -> float | None:
        """From the first scheduling to the first token (the prompt's prefill)."""
        return _between(self.first_scheduled_time, self.first_token_time)

    @property
    def decode_seconds(self) -> float | None:
        """From the first token to the end."""
        return _between(self.first_token_time, self.finished_time)

    @property
    def inference_seconds(self) -> float | None:
        """From the first scheduling to the end (prefill and decode)."""
        return _between(self.first_scheduled_time, self.finished_time)


def _between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(end - start, 0.0)


@dataclasses.dataclass
class RequestOutput:
    """One delta of a request: the tokens and text produced since the previous delta."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    num_prompt_tokens: int
    num_output_tokens: int  # total so far
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    new_logprobs: list[TokenLogprob] | None = None  # one per new token when logprobs were asked for
    error: str | None = None  # message when finish_reason == "error"
    error_param: str | None = None  # the client's field that caused the error (its input, not the server)
    stop_reason: str | int | None = None  # finish_reason "stop": the stop string or stop token id; None for EOS
    # With prompt_logprobs, in the request's first delta: one entry per prompt token from the second
    # (the first token has no logprob: nothing precedes it).
    prompt_logprobs: list[TokenLogprob] | None = None
    metrics: RequestMetrics | None = None  # in the finished delta: the request's phase times
    # A pooling engine's finished delta: the prompt's pooled vector, numpy float32 [hidden] (an
    # embedding before dimensions and normalization: jaxserve.pooling.accumulate.finish_embedding)
    # or a classifier's activated scores [num_labels]; None otherwise.
    pooled: Any = None


@dataclasses.dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_pages_used: int  # pages held by requests (0 when idle)
    kv_pages_total: int
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    weights_bytes: int = 0  # device arrays of the weights (quantized sizes when quantized)
    kv_cache_bytes: int = 0  # the KV page pool (scales of an int8 cache included)
    num_step_failures: int = 0  # steps that raised; their requests ended with an error
    # Speculative decoding: verification steps, tokens proposed and accepted in them, and the
    # accepted proposals by position in the row (index 0: first proposal).
    spec_verify_steps: int = 0
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()
    # Warm-up: shapes compiled so far of all it compiles (0 of 0 without a warm-up).
    warmup_shapes_compiled: int = 0
    warmup_shapes_total: int = 0
    # LoRA: the adapters of the running and of the waiting requests (sorted names), and the most in
    # one step (--max_loras; 0: LoRA off).
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    max_lora: int = 0
    # KV offload (--kv_offloading_size; 0s when off): the tiers' pages in use of their total, prompt
    # tokens looked up past the device's prefix cache and those restored from each tier, and bytes moved.
    kv_offload_host_pages_used: int = 0
    kv_offload_host_pages_total: int = 0
    kv_offload_disk_pages_used: int = 0
    kv_offload_disk_pages_total: int = 0
    kv_offload_queried_tokens: int = 0
    kv_offload_host_hit_tokens: int = 0
    kv_offload_disk_hit_tokens: int = 0
    kv_offload_bytes_to_host: int = 0
    kv_offload_bytes_to_device: int = 0
    kv_offload_bytes_to_disk: int = 0
    kv_offload_dropped_pages: int = 0  # evicted while every host block was pending or pinned: not kept


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One engine step that ran: its shape, its work and where its time went.

    The engine keeps the recent ones (`Engine.step_records`) and passes each to its step
    listeners (`Engine.add_step_listener`): the benchmarks and the server's /metrics read these.
    The engine leaves the roofline's fields empty; a `step_pricing.StepPricer` fills them (the
    async client's listeners get priced records)."""
    kind: str  # "decode" (decode rows only) | "prefill" (prefill chunks only) | "mixed" | "verify" (speculative)
    bucket_decode_rows: int  # the compiled shape the step was padded into ...
    bucket_prefill_tokens: int
    bucket_pages: int  # ... block-table width
    num_decode_rows: int
    num_prefill_rows: int  # prefill chunks
    num_prefill_tokens: int
    num_tokens: int  # tokens computed: decode rows + prefill tokens
    num_attention_pairs: int  # (query, key) pairs the step's causal attention covers
    device_seconds: float  # jitted forward + sampler: host arrays in, sampled ids out
    host_seconds: float  # the rest of `Engine.step`: scheduling, packing, stop checks, detokenizing
    pack_seconds: float  # the runner's part of host_seconds: packing the arrays, slicing the results
    num_output_tokens: int = 0  # output tokens the step gave its requests (verify: often several per row)
    num_kv_tokens_read: int = 0  # cached context tokens the step's rows attend to (the sum of their starts)
    num_steps: int = 1  # model passes in the call (multi-step decoding: several)
    # The roofline's estimate of the step's work on one device (jaxserve.planning.predict): bytes
    # moved (weights, K/V read and written, activations) and FLOPs (matmuls and attention);
    # 0 until a StepPricer priced the record.
    estimated_bytes: float = 0.0
    estimated_flops: float = 0.0
    # From the end of the previous step to the start of this one while the engine had work (0
    # after an idle engine): time the device waited on the host loop.
    host_gap_seconds: float = 0.0
    # Achieved bytes/s and FLOP/s over device_seconds as a fraction of the device's ceilings;
    # None where the ceilings are unknown (a CPU without --memory_bandwidth_gbps / --peak_tflops).
    bandwidth_utilization: float | None = None
    compute_utilization: float | None = None

    @classmethod
    def of(cls, batch, result, step_seconds: float, num_output_tokens: int, host_gap: float = 0.0) -> "StepRecord":
        """The record of a step that ran `batch` (a core.step.ScheduledBatch) with `result` (its
        StepOutput) in `step_seconds` of the engine's step, unpriced."""
        bucket = result.bucket
        kind = ("verify" if batch.verify else "mixed" if batch.decode and batch.prefill
                else "decode" if batch.decode else "prefill")
        return cls(
            kind=kind, bucket_decode_rows=bucket.num_decode, bucket_prefill_tokens=bucket.num_prefill_tokens,
            bucket_pages=bucket.pages_per_seq, num_decode_rows=len(batch.decode) + len(batch.verify),
            num_prefill_rows=len(batch.prefill), num_prefill_tokens=batch.num_prefill_tokens,
            num_tokens=batch.num_tokens, num_attention_pairs=batch.num_attention_pairs,
            device_seconds=result.device_seconds, host_seconds=step_seconds - result.device_seconds,
            pack_seconds=result.host_seconds, num_output_tokens=num_output_tokens,
            num_kv_tokens_read=sum(row.start for row in batch.rows), num_steps=batch.num_steps,
            host_gap_seconds=host_gap)

    @property
    def num_padded_tokens(self) -> int:
        """Token rows the compiled step computed (the bucket's)."""
        return self.bucket_decode_rows + self.bucket_prefill_tokens

    @property
    def seconds(self) -> float:
        """The whole step: device and host."""
        return self.device_seconds + self.host_seconds

    @property
    def achieved_bytes_per_second(self) -> float:
        return self.estimated_bytes / self.device_seconds if self.device_seconds > 0 else 0.0


@dataclasses.dataclass
class FinishedRequest:
    """The whole result of one request (offline generation)."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    num_cached_tokens: int
    ttft: float | None  # seconds from arrival to the first token
    e2e: float  # seconds from arrival to the end
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # with params.prompt_logprobs: prompt tokens 2..
    pooled: Any = None  # a pooling engine's: RequestOutput.pooled

    @classmethod
    def of(cls, request, last, text: str, logprobs: list) -> "FinishedRequest":
        """The result of a finished `request` (a core.request.Request) from its `last` delta, its
        whole text and its logprobs."""
        return cls(request.request_id, request.prompt_token_ids, list(request.output_token_ids), text,
                   last.finish_reason, request.num_cached_tokens,
                   None if request.first_token_time is None else request.first_token_time - request.arrival_time,
                   (request.finish_time or time.monotonic()) - request.arrival_time,
                   logprobs if request.params.logprobs is not None else None, request.prompt_logprobs, last.pooled)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or len(self.token_ids) < 2:
            return None
        return (self.e2e - self.ttft) / (len(self.token_ids) - 1)


def prompt_logprob_entries(rows, out: dict) -> list[TokenLogprob]:
    """The step's prompt-logprob rows of one chunk (`rows`: its core.step.PromptLogprobRows) as TokenLogprobs (the target token, its logprob,
    the top-k alternatives and its rank)."""
    k = rows.num_logprobs
    return [TokenLogprob(token_id, float(logprob), [(int(t), float(lp)) for t, lp in zip(top_ids[:k], top_lps[:k])],
                         int(rank))
            for token_id, logprob, rank, top_ids, top_lps in zip(
                rows.targets, out["logprobs"], out["ranks"], out["top_ids"], out["top_logprobs"])]


def with_metrics(request, output: RequestOutput) -> RequestOutput:
    """A finished delta with the phase times of `request` (a core.request.Request) (`RequestMetrics`); others as they are."""
    if not output.finished:
        return output
    finished_time = request.finish_time if request.finish_time is not None else time.monotonic()
    return dataclasses.replace(output, metrics=RequestMetrics(
        request.arrival_time, request.first_scheduled_time, request.first_token_time, finished_time))


def merge_deltas(deltas: list[RequestOutput]) -> RequestOutput:
    """One delta for several tokens of a request in one step (a verification step)."""
    last = deltas[-1]
    logprobs = [lp for d in deltas for lp in d.new_logprobs or ()] if deltas[0].new_logprobs is not None else None
    return dataclasses.replace(last, new_token_ids=[t for d in deltas for t in d.new_token_ids],
                               new_text="".join(d.new_text for d in deltas), new_logprobs=logprobs,
                               prompt_logprobs=deltas[0].prompt_logprobs)
