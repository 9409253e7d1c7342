"""Host-side request state: sampling parameters, status and the token bookkeeping of one request.

No jax here: the scheduler and the allocator work on these plain objects and are unit-tested in
milliseconds.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import random
import time
from typing import Any

MAX_LOGPROBS = 20
_MAX_SEED = 2**63
_system_random = random.SystemRandom()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling knobs (OpenAI / vLLM meaning). `top_k` 0 or -1 means off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k: sampled token logprob + top-k alternatives

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raises ValueError naming the first field that is out of range or of the wrong type."""
        _check_int("max_tokens", self.max_tokens, low=1)
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, low=-1, hint=" (0 or -1 disables top-k)")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.seed is not None:
            _check_int("seed", self.seed, low=0, high=_MAX_SEED - 1)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)


def _check_int(name: str, value: Any, low: int | None = None, high: int | None = None, hint: str = "") -> None:
    if not _is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}{hint}, got {value}")
    if high is not None and value > high:
        bound = f"in [{low}, {high}]" if low is not None else f"<= {high}"
        raise ValueError(f"{name} must be {bound}{hint}, got {value}")


def _check_number(name: str, value: Any) -> None:
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI-style reason ("stop", "length", "abort", "error"); None while unfinished."""
        return self.value if self.is_finished else None


_FINISHED = frozenset({
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
})


class Request:
    """One generation request. Plain ints and lists; the scheduler owns the mutation.

    `num_computed_tokens` counts tokens whose K/V are in the cache; `page_ids[i]` holds positions
    `i * page_size .. (i + 1) * page_size - 1`. `arrival_time` and the other times use
    `time.monotonic()`.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params if params is not None else SamplingParams()
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.page_ids: list[int] = []
        self.num_cached_tokens = 0
        self.seed = self.params.seed if self.params.seed is not None else _system_random.getrandbits(63)
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.error_message: str | None = None
        # Content hashes of this request's full pages whose registration was already attempted,
        # in page order; maintained by the PageAllocator.
        self.page_hashes: list[bytes] = []

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_id_at(self, position: int) -> int:
        num_prompt = len(self.prompt_token_ids)
        if position < num_prompt:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - num_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens}, pages={len(self.page_ids)})"
        )
