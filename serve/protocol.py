"""OpenAI request validation: JSON bodies -> GenerationRequest -> SamplingParams.

Every problem with a request becomes a ProtocolError carrying the HTTP status and the fields of
an OpenAI-style error body. No jax here: this module is unit-tested in milliseconds.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jinja2

from jaxserve.tokenization import encode_chat, encode_text

from jaxserve.request import MAX_LOGPROBS, SamplingParams

MAX_CHOICES = 16  # upper bound on `n`
MAX_STOP_SEQUENCES = 16
DEFAULT_COMPLETION_MAX_TOKENS = 16  # what OpenAI and vLLM use when a completion names none
_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_INT64_MAX = 2**63 - 1


class ProtocolError(Exception):
    """A request the server refuses; `status` is the HTTP status, the rest fills the error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        error_type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.error_type = error_type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, param=self.param, code=self.code)


def error_body(message: str, error_type: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


@dataclasses.dataclass
class GenerationRequest:
    """A validated /v1/completions or /v1/chat/completions request."""

    is_chat: bool
    model: str
    n: int
    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: the endpoint's default
    logprobs: int | None  # None: no logprobs; k: the sampled token's logprob plus the top k
    sampling: dict[str, Any]  # the other SamplingParams fields the client set
    prompt: str | list[int] | None = None  # completions: text or token ids
    messages: list[dict[str, str]] | None = None  # chat: role/content strings for the template


class _Fields:
    """Typed readers over one JSON object; each raises ProtocolError naming the field."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def present(self, name: str) -> bool:
        return self.body.get(name) is not None

    def integer(self, name: str, *, low: int | None = None, high: int | None = None, default: Any = None) -> Any:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, int) or isinstance(value, bool):
            raise ProtocolError(f"'{name}' must be an integer, got {value!r}", param=name)
        if (low is not None and value < low) or (high is not None and value > high):
            raise ProtocolError(f"'{name}' must be {_range_text(low, high)}, got {value}", param=name)
        return value

    def number(self, name: str, *, low: float, high: float, low_open: bool = False) -> float | None:
        value = self.body.get(name)
        if value is None:
            return None
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ProtocolError(f"'{name}' must be a finite number, got {value!r}", param=name)
        if value > high or value < low or (low_open and value == low):
            bracket = "(" if low_open else "["
            raise ProtocolError(f"'{name}' must be in {bracket}{low}, {high}], got {value}", param=name)
        return float(value)

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ProtocolError(f"'{name}' must be a boolean, got {value!r}", param=name)
        return value

    def string_list(self, name: str) -> list[str] | None:
        value = self.body.get(name)
        if value is None:
            return None
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
            raise ProtocolError(f"'{name}' must be a non-empty string or a list of non-empty strings", param=name)
        if len(items) > MAX_STOP_SEQUENCES:
            raise ProtocolError(f"'{name}' allows at most {MAX_STOP_SEQUENCES} sequences", param=name)
        return items


def _range_text(low: int | None, high: int | None) -> str:
    if low is not None and high is not None:
        return f"in [{low}, {high}]"
    return f">= {low}" if low is not None else f"<= {high}"


def parse_completion_request(body: Any, served_model: str) -> GenerationRequest:
    """Validates a /v1/completions body."""
    fields = _common_checks(body, served_model)
    if fields.boolean("echo"):
        raise ProtocolError("'echo' is not supported", param="echo")
    if fields.present("suffix"):
        raise ProtocolError("'suffix' is not supported", param="suffix")
    logprobs = fields.integer("logprobs", low=0, high=MAX_LOGPROBS)
    return _build(fields, served_model, is_chat=False, max_tokens=fields.integer("max_tokens", low=1),
                  logprobs=logprobs, prompt=_parse_prompt(body.get("prompt")))


def parse_chat_request(body: Any, served_model: str) -> GenerationRequest:
    """Validates a /v1/chat/completions body."""
    fields = _common_checks(body, served_model)
    for name in ("tools", "functions"):
        if body.get(name):
            raise ProtocolError(f"'{name}' is not supported", param=name)
    max_tokens = fields.integer("max_completion_tokens", low=1)
    if max_tokens is None:
        max_tokens = fields.integer("max_tokens", low=1)
    top_logprobs = fields.integer("top_logprobs", low=0, high=MAX_LOGPROBS)
    wants_logprobs = fields.boolean("logprobs")
    if top_logprobs is not None and not wants_logprobs:
        raise ProtocolError("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    logprobs = (top_logprobs or 0) if wants_logprobs else None
    return _build(fields, served_model, is_chat=True, max_tokens=max_tokens, logprobs=logprobs,
                  messages=_parse_messages(body.get("messages")))


def _common_checks(body: Any, served_model: str) -> _Fields:
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError("'model' must be a string", param="model")
    if model is not None and model != served_model:
        raise ProtocolError(f"The model `{model}` does not exist", status=404, param="model", code="model_not_found")
    fields = _Fields(body)
    if fields.integer("best_of", low=1, default=1) != 1:
        raise ProtocolError("'best_of' other than 1 is not supported", param="best_of")
    if body.get("logit_bias"):
        raise ProtocolError("'logit_bias' is not supported", param="logit_bias")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise ProtocolError("only {'type': 'text'} is supported for 'response_format'", param="response_format")
    return fields


def _build(fields: _Fields, served_model: str, *, is_chat: bool, max_tokens: int | None,
           logprobs: int | None, prompt: Any = None, messages: Any = None) -> GenerationRequest:
    stream = fields.boolean("stream")
    stream_options = fields.body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not stream:
            raise ProtocolError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if not isinstance(stream_options, dict):
            raise ProtocolError("'stream_options' must be an object", param="stream_options")
        include_usage = _Fields(stream_options).boolean("include_usage")
    sampling: dict[str, Any] = {
        "temperature": fields.number("temperature", low=0.0, high=2.0),
        "top_p": fields.number("top_p", low=0.0, high=1.0, low_open=True),
        "top_k": fields.integer("top_k", low=-1),
        "min_p": fields.number("min_p", low=0.0, high=1.0),
        "repetition_penalty": fields.number("repetition_penalty", low=0.0, high=math.inf, low_open=True),
        "presence_penalty": fields.number("presence_penalty", low=-2.0, high=2.0),
        "frequency_penalty": fields.number("frequency_penalty", low=-2.0, high=2.0),
        "seed": fields.integer("seed", low=0, high=_INT64_MAX),
        "stop": fields.string_list("stop"),
        "stop_token_ids": _parse_token_ids(fields.body.get("stop_token_ids"), "stop_token_ids", allow_empty=True),
        "ignore_eos": fields.boolean("ignore_eos"),
    }
    return GenerationRequest(
        is_chat=is_chat,
        model=served_model,
        n=fields.integer("n", low=1, high=MAX_CHOICES, default=1),
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        logprobs=logprobs,
        sampling={k: v for k, v in sampling.items() if v is not None},
        prompt=prompt,
        messages=messages,
    )


def _parse_token_ids(value: Any, param: str, *, allow_empty: bool = False) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ProtocolError(f"'{param}' must be a list of non-negative integer token ids", param=param)
    if not value and not allow_empty:
        raise ProtocolError(f"'{param}' must not be empty", param=param)
    return value


def _parse_prompt(prompt: Any) -> str | list[int]:
    if prompt is None:
        raise ProtocolError("'prompt' is required", param="prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return _parse_prompt(prompt[0])  # a batch of one prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ProtocolError("batched prompts are not supported: send one prompt per request (use 'n' for "
                            "several choices)", param="prompt")
    if isinstance(prompt, list):
        return _parse_token_ids(prompt, "prompt")
    raise ProtocolError("'prompt' must be a string or a list of token ids", param="prompt")


def _parse_messages(messages: Any) -> list[dict[str, str]]:
    if messages is None:
        raise ProtocolError("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("'messages' must be a non-empty list", param="messages")
    parsed = []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ProtocolError(f"'{param}' must be an object", param=param)
        role = message.get("role")
        if role not in _CHAT_ROLES:
            raise ProtocolError(f"'{param}.role' must be one of {', '.join(_CHAT_ROLES)}; got {role!r}",
                                param=f"{param}.role")
        parsed.append({"role": role, "content": _message_text(message.get("content"), role, f"{param}.content")})
    return parsed


def _message_text(content: Any, role: str, param: str) -> str:
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ProtocolError(f"'{param}' parts must be {{'type': 'text', 'text': <string>}}; "
                                    "other content types are not supported", param=param)
            texts.append(part["text"])
        return "".join(texts)
    raise ProtocolError(f"'{param}' must be a string or a list of text parts", param=param)


def prompt_token_ids(tokenizer: Any, request: GenerationRequest) -> list[int]:
    """The prompt's token ids: the chat template for chat (with the generation prompt), else the
    tokenizer (with its special tokens, e.g. BOS) or the client's own ids. Checked against the vocabulary."""
    if request.is_chat:
        try:
            token_ids = encode_chat(tokenizer, request.messages)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise ProtocolError(f"the chat template rejected the messages: {e}", param="messages") from None
    elif isinstance(request.prompt, str):
        token_ids = encode_text(tokenizer, request.prompt)
    else:
        token_ids = list(request.prompt)
    check_prompt_token_ids(token_ids, len(tokenizer))
    return token_ids


def check_prompt_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """Refuses an empty prompt and token ids outside the vocabulary."""
    if not token_ids:
        raise ProtocolError("the prompt is empty", param="prompt")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ProtocolError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param="prompt")


def build_sampling_params(request: GenerationRequest, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """SamplingParams for one choice; checks the prompt and max_tokens against the context length."""
    param = "messages" if request.is_chat else "prompt"
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise ProtocolError(f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                            f"{num_prompt_tokens} tokens, leaving no room for a completion",
                            param=param, code="context_length_exceeded")
    max_tokens = request.max_tokens
    if max_tokens is None:
        max_tokens = room if request.is_chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room)
    elif max_tokens > room:
        name = "max_completion_tokens" if request.is_chat else "max_tokens"
        raise ProtocolError(f"This model's maximum context length is {max_model_len} tokens; you requested "
                            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
                            "for the completion)", param=name, code="context_length_exceeded")
    params = SamplingParams(max_tokens=max_tokens, logprobs=request.logprobs, **request.sampling)
    try:
        params.validate()
    except ValueError as e:
        raise ProtocolError(str(e)) from None
    return params
