"""What the engine hands back to its callers (server, CLI): plain dataclasses, no jax."""
from __future__ import annotations

import dataclasses


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full; the caller should retry later (HTTP 429)."""


class StepInputError(ValueError):
    """The inputs of one request could not be packed into a step (nothing ran on the device)."""

    def __init__(self, request, message: str) -> None:
        super().__init__(message)
        self.request = request


@dataclasses.dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-N (token_id, logprob) pairs, best first


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
