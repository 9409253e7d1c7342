"""Host-side request state: sampling parameters, status and the token bookkeeping of one request,
and the one admission check (`check_request`). Prompts are encoded by the server and the CLI
(`serve.prompts`).

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

from jaxserve.core.structured_output import StructuredOutputError, StructuredOutputParams, check_structured_output

MAX_LOGPROBS = 20  # the most alternatives a request may ask for (the engine may allow fewer)
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 1024  # per stop string: the detokenizer holds back that much text per token
MAX_STOP_TOKEN_IDS = 256  # checked per generated token
MAX_TEMPERATURE = 2.0  # OpenAI's range
MAX_LOGIT_BIAS = 300  # entries of one request's logit_bias (OpenAI's bound)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range of a bias
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # useful values are 1-2; outside, float32 logits vanish or overflow
_INT32_MAX = 2**31 - 1  # top_k travels to the device as int32
_MAX_SEED = 2**63
_system_random = random.SystemRandom()


class InvalidRequestError(ValueError):
    """A request the engine refuses at admission. `param` names the offending field, `code` is
    an OpenAI-style error code (e.g. "context_length_exceeded")."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """What the engine's arrays can hold; every bound of `check_request` derives from these."""

    vocab_size: int  # rows of the embedding: prompt and stop token ids must be below it
    max_seq_len: int  # prompt + output tokens: min(max_model_len, the KV pool's capacity)
    max_model_len: int  # the configured context (only named in messages)
    max_logprobs: int = MAX_LOGPROBS  # columns of the step's top-logprob output

    @property
    def context_text(self) -> str:
        """How the context limit is named in refusals."""
        if self.max_seq_len == self.max_model_len:
            return f"This model's maximum context length is {self.max_seq_len} tokens"
        return (f"This model's maximum context length is {self.max_seq_len} tokens (the KV cache holds "
                f"{self.max_seq_len} tokens; max_model_len is {self.max_model_len})")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_valid_unicode(text: str) -> bool:
    """False for strings holding lone surrogates (JSON "\\ud800"), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclasses.dataclass
class SamplingParams:
    """Per-request sampling knobs (OpenAI / vLLM meaning). `top_k` 0 or -1 means off.

    Plain data: `check_request` is the one place that decides whether a request is valid."""

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
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    min_tokens: int = 0  # EOS and stop tokens are masked (and stop strings ignored) until this many
    include_stop_str_in_output: bool = False  # keep the matched stop string (or stop token text)
    skip_special_tokens: bool = True  # special tokens are left out of the text
    # Prompt logprobs (vLLM's prompt_logprobs; completions' echo): None, or k: each prompt token's
    # logprob (the first has none) and its top-k alternatives. max_tokens may then be 0 (no output).
    prompt_logprobs: int | None = None
    structured_output: StructuredOutputParams | None = None  # a grammar the output must follow
    lora_name: str | None = None  # the LoRA adapter the request runs with (None: the base model)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]


def check_request(prompt_token_ids: Any, params: SamplingParams, limits: RequestLimits) -> None:
    """The admission check: raises InvalidRequestError naming the first field that cannot be served.

    Complete by design: a request that passes cannot fail a step (every value fits the dtype
    and range of the array it travels in) nor outgrow the KV cache."""
    _check_prompt(prompt_token_ids, limits, prompt_only=params.max_tokens == 0)
    check_sampling_params(params, limits)
    room = limits.max_seq_len - len(prompt_token_ids)
    if params.max_tokens > room:
        raise InvalidRequestError(
            f"{limits.context_text}; you requested {len(prompt_token_ids) + params.max_tokens} tokens "
            f"({len(prompt_token_ids)} in the prompt, {params.max_tokens} for the completion)",
            param="max_tokens", code="context_length_exceeded")


def check_pooling_request(prompt_token_ids: Any, params: SamplingParams, limits: RequestLimits) -> None:
    """A pooling engine's admission check (--runner=pooling): the prompt alone, which may fill the
    context; its params ask for nothing but the prompt (`pooling_params()`)."""
    _check_prompt(prompt_token_ids, limits, prompt_only=True)
    if params != pooling_params():
        raise InvalidRequestError("a pooling engine (--runner=pooling) pools the prompt: it takes no sampling "
                                  "parameters (max_tokens 0, the defaults otherwise)", param="max_tokens")


def pooling_params() -> SamplingParams:
    """The params of every request of a pooling engine: the prompt only, no output token."""
    return SamplingParams(max_tokens=0)


def _check_prompt(prompt_token_ids: Any, limits: RequestLimits, prompt_only: bool = False) -> None:
    """`prompt_only`: a request for the prompt alone (max_tokens 0, e.g. echo), which may fill the context."""
    if not isinstance(prompt_token_ids, (list, tuple)):
        raise InvalidRequestError("the prompt must be a list of token ids", param="prompt")
    if not prompt_token_ids:
        raise InvalidRequestError("the prompt is empty: it must contain at least one token", param="prompt")
    if len(prompt_token_ids) > limits.max_seq_len - (0 if prompt_only else 1):  # cheap first: before the scan
        raise InvalidRequestError(
            f"{limits.context_text}; the prompt has {len(prompt_token_ids)} tokens, leaving no room for "
            "a completion", param="prompt", code="context_length_exceeded")
    vocab = limits.vocab_size
    bad = next((t for t in prompt_token_ids if not _is_int(t) or not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(f"prompt token id {bad!r} is not an integer in [0, {vocab})", param="prompt")


def check_sampling_params(params: SamplingParams, limits: RequestLimits | None = None) -> None:
    """The sampling half of `check_request`. Without `limits` (no engine yet, e.g. the CLI reading
    its input before loading a model) the bounds that depend on the engine are left out."""
    vocab = limits.vocab_size if limits is not None else None
    if params.prompt_logprobs is not None:
        _check_int("prompt_logprobs", params.prompt_logprobs, low=0,
                   high=limits.max_logprobs if limits else MAX_LOGPROBS)
    _check_int("max_tokens", params.max_tokens, low=0 if params.prompt_logprobs is not None else 1)
    _check_number("temperature", params.temperature, 0.0, MAX_TEMPERATURE)
    _check_number("top_p", params.top_p, 0.0, 1.0, low_open=True)
    _check_int("top_k", params.top_k, low=-1, high=_INT32_MAX,
               hint=f" (0 or -1 disables top-k; {vocab or 'the vocabulary size'} or more keeps every token)")
    _check_number("min_p", params.min_p, 0.0, 1.0)
    _check_number("repetition_penalty", params.repetition_penalty, *REPETITION_PENALTY_RANGE)
    _check_number("presence_penalty", params.presence_penalty, -2.0, 2.0)
    _check_number("frequency_penalty", params.frequency_penalty, -2.0, 2.0)
    if params.seed is not None:
        _check_int("seed", params.seed, low=0, high=_MAX_SEED - 1)
    stop = params.stop
    if isinstance(stop, list) and len(stop) > MAX_STOP_SEQUENCES:
        raise InvalidRequestError(f"stop allows at most {MAX_STOP_SEQUENCES} strings, got {len(stop)}",
                                  param="stop")
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidRequestError("stop must be a string or a list of strings", param="stop")
    for s in stop:
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidRequestError(f"stop strings must have 1 to {MAX_STOP_CHARS} characters, got {len(s)}",
                                      param="stop")
        if not is_valid_unicode(s):
            raise InvalidRequestError("stop strings must be valid Unicode (no lone surrogates)", param="stop")
    ids = params.stop_token_ids
    if isinstance(ids, list) and len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(f"stop_token_ids allows at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                                  param="stop_token_ids")
    if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t < (vocab or _INT32_MAX) for t in ids):
        raise InvalidRequestError(f"stop_token_ids must be a list of token ids in [0, {vocab or 'vocabulary size'})",
                                  param="stop_token_ids")
    if not isinstance(params.ignore_eos, bool):
        raise InvalidRequestError(f"ignore_eos must be a boolean, got {params.ignore_eos!r}", param="ignore_eos")
    if params.logprobs is not None:
        _check_int("logprobs", params.logprobs, low=0, high=limits.max_logprobs if limits else MAX_LOGPROBS)
    _check_int("min_tokens", params.min_tokens, low=0, high=params.max_tokens if _is_int(params.max_tokens) else None,
               hint=" (at most max_tokens)")
    for name in ("include_stop_str_in_output", "skip_special_tokens"):
        if not isinstance(getattr(params, name), bool):
            raise InvalidRequestError(f"{name} must be a boolean, got {getattr(params, name)!r}", param=name)
    if params.logit_bias is not None:
        _check_logit_bias(params.logit_bias, vocab)
    if params.structured_output is not None:
        try:
            check_structured_output(params.structured_output)
        except StructuredOutputError as e:
            raise InvalidRequestError(str(e), param=e.param) from None
        if params.min_tokens:  # the grammar may be complete (only EOS allowed) before min_tokens
            raise InvalidRequestError("min_tokens cannot be combined with structured output",
                                      param="min_tokens")


def _check_logit_bias(logit_bias: Any, vocab: int | None) -> None:
    if not isinstance(logit_bias, dict):
        raise InvalidRequestError("logit_bias must map token ids to biases", param="logit_bias")
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidRequestError(f"logit_bias allows at most {MAX_LOGIT_BIAS} tokens, got {len(logit_bias)}",
                                  param="logit_bias")
    low, high = LOGIT_BIAS_RANGE
    for token_id, bias in logit_bias.items():
        if not _is_int(token_id) or not 0 <= token_id < (vocab or _INT32_MAX):
            raise InvalidRequestError(f"logit_bias token id {token_id!r} is not a token id in "
                                      f"[0, {vocab or 'vocabulary size'})", param="logit_bias")
        if not _is_number(bias) or not math.isfinite(bias) or not low <= bias <= high:
            raise InvalidRequestError(f"logit_bias of token {token_id} must be a number in [{low:g}, {high:g}], "
                                      f"got {bias!r}", param="logit_bias")


def _check_int(name: str, value: Any, low: int | None = None, high: int | None = None, hint: str = "") -> None:
    if not _is_int(value):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if low is not None and high is not None else (
            f">= {low}" if low is not None else f"<= {high}")
        raise InvalidRequestError(f"{name} must be {bound}{hint}, got {value}", param=name)


def _check_number(name: str, value: Any, low: float, high: float, low_open: bool = False) -> None:
    if not _is_number(value) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", param=name)
    if value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise InvalidRequestError(f"{name} must be in {bracket}{low:g}, {high:g}], got {value:g}", param=name)


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
        self.first_scheduled_time: float | None = None  # set by the scheduler (not again after a preemption)
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.error_message: str | None = None
        self.error_param: str | None = None  # the client's field that caused the error, if it did
        # Content hashes of this request's full pages whose registration was already attempted,
        # in page order; maintained by the PageAllocator.
        self.page_hashes: list[bytes] = []
        # With params.prompt_logprobs: the entries computed so far, one per prompt token from the
        # second (the engine fills it chunk by chunk; kept across preemption, never recomputed).
        self.prompt_logprobs: list | None = [] if self.params.prompt_logprobs is not None else None
        self.grammar = None  # a structured_output.GrammarState, set by the engine at admission
        # Speculative decoding: tokens proposed to follow the last one, verified in the next step
        # (set by the engine after each step while the request decodes; jaxserve.speculative.verification).
        self.spec_token_ids: list[int] = []
        # LoRA: the slot of the request's adapter in the step (set by the engine before each step;
        # 0: the base model), and what the prefix cache keys its pages with (b"": the base model's).
        self.lora_slot = 0
        self.prefix_salt = b""
        # Image input (jaxserve.multimodal.inputs.MultimodalInputs: the images' spans, encoder
        # inputs and hashes, M-RoPE positions), set by the engine at admission; None: text only.
        self.multimodal = None

    def prefix_key_ids(self, stop: int | None = None) -> list[int]:
        """The token ids the prefix cache keys pages with, positions 0 .. stop - 1 (default all):
        the tokens, with each image's positions holding its content hash instead."""
        ids = self.all_token_ids if stop is None else self.all_token_ids[:stop]
        return ids if self.multimodal is None else self.multimodal.prefix_key_ids(ids)

    @property
    def num_prompt_logprobs_missing(self) -> int:
        """Prompt tokens whose logprob is still to be computed (0 without prompt_logprobs)."""
        if self.prompt_logprobs is None:
            return 0
        return max(len(self.prompt_token_ids) - 1 - len(self.prompt_logprobs), 0)

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


# ---- server-wide sampling defaults ---------------------------------------------------------------

# The SamplingParams fields a server may default (from the model's generation_config.json or
# --default_sampling); a request's own value always wins.
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                           "frequency_penalty", "max_tokens")


def check_sampling_defaults(defaults: Any) -> dict[str, Any]:
    """`defaults` checked as SamplingParams values: a dict of SAMPLING_DEFAULT_FIELDS. Raises
    InvalidRequestError naming the first key that is unknown or out of range."""
    if not isinstance(defaults, dict):
        raise InvalidRequestError("sampling defaults must be a JSON object")
    for name in defaults:
        if name not in SAMPLING_DEFAULT_FIELDS:
            raise InvalidRequestError(f"{name!r} cannot be a sampling default (allowed: "
                                      f"{', '.join(SAMPLING_DEFAULT_FIELDS)})", param=name)
    check_sampling_params(SamplingParams(**defaults))
    return dict(defaults)
