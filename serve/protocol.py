"""The OpenAI protocol, both ways: JSON bodies -> GenerationRequest -> SamplingParams, and engine
deltas -> completion / chat JSON objects and SSE chunks.

Requests: this module reads the JSON (types, the OpenAI fields the server supports, the text of prompts and
messages); the bounds of every value are the engine's admission check (`jaxserve.request.
check_request`), whose refusals `admission_error` turns into the same 400s. Every problem becomes
a ProtocolError carrying the HTTP status and the fields of an OpenAI-style error body.
Responses: plain dicts; `token_text(token_id) -> str` turns a token id into its text for logprobs.
No jax here: this module is unit-tested in milliseconds.
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, Callable

import jinja2

from jaxserve.outputs import RequestOutput, TokenLogprob
from jaxserve.request import InvalidRequestError, SamplingParams, encode_chat, encode_text, is_valid_unicode

MAX_CHOICES = 16  # upper bound on `n`
DEFAULT_COMPLETION_MAX_TOKENS = 16  # what OpenAI and vLLM use when a completion names none
_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


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
    max_tokens_param: str  # the field the client used for it ("max_tokens" or "max_completion_tokens")
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

    def number(self, name: str) -> float | None:
        value = self.body.get(name)
        if value is None:
            return None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ProtocolError(f"'{name}' must be a number, got {value!r}", param=name)
        return value

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
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise ProtocolError(f"'{name}' must be a string or a list of strings", param=name)
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
    return _build(fields, served_model, is_chat=False, max_tokens=fields.integer("max_tokens"),
                  max_tokens_param="max_tokens", logprobs=fields.integer("logprobs"),
                  prompt=_parse_prompt(body.get("prompt")))


def parse_chat_request(body: Any, served_model: str) -> GenerationRequest:
    """Validates a /v1/chat/completions body."""
    fields = _common_checks(body, served_model)
    for name in ("tools", "functions"):
        if body.get(name):
            raise ProtocolError(f"'{name}' is not supported", param=name)
    max_tokens_param = "max_completion_tokens" if fields.present("max_completion_tokens") else "max_tokens"
    top_logprobs = fields.integer("top_logprobs")
    wants_logprobs = fields.boolean("logprobs")
    if top_logprobs is not None and not wants_logprobs:
        raise ProtocolError("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    logprobs = (top_logprobs or 0) if wants_logprobs else None
    return _build(fields, served_model, is_chat=True, max_tokens=fields.integer(max_tokens_param),
                  max_tokens_param=max_tokens_param, logprobs=logprobs,
                  messages=_parse_messages(body.get("messages")))


def _common_checks(body: Any, served_models: str | tuple[str, ...]) -> _Fields:
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError("'model' must be a string", param="model")
    served = (served_models,) if isinstance(served_models, str) else served_models
    if model is not None and model not in served:
        raise ProtocolError(f"The model `{_printable(model)}` does not exist", status=404, param="model",
                            code="model_not_found")
    fields = _Fields(body)
    if fields.integer("best_of", low=1, default=1) != 1:
        raise ProtocolError("'best_of' other than 1 is not supported", param="best_of")
    if body.get("logit_bias"):
        raise ProtocolError("'logit_bias' is not supported", param="logit_bias")
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise ProtocolError("only {'type': 'text'} is supported for 'response_format'", param="response_format")
    return fields


def _build(fields: _Fields, served_models: str | tuple[str, ...], *, is_chat: bool, max_tokens: int | None,
           max_tokens_param: str, logprobs: int | None, prompt: Any = None, messages: Any = None) -> GenerationRequest:
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
        "temperature": fields.number("temperature"),
        "top_p": fields.number("top_p"),
        "top_k": fields.integer("top_k"),
        "min_p": fields.number("min_p"),
        "repetition_penalty": fields.number("repetition_penalty"),
        "presence_penalty": fields.number("presence_penalty"),
        "frequency_penalty": fields.number("frequency_penalty"),
        "seed": fields.integer("seed"),
        "stop": fields.string_list("stop"),
        "stop_token_ids": _parse_token_ids(fields.body.get("stop_token_ids"), "stop_token_ids", allow_empty=True),
        "ignore_eos": fields.boolean("ignore_eos"),
    }
    model = fields.body.get("model")
    return GenerationRequest(
        is_chat=is_chat,
        model=model if model is not None else (served_models if isinstance(served_models, str) else served_models[0]),
        n=fields.integer("n", low=1, high=MAX_CHOICES, default=1),
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        logprobs=logprobs,
        sampling={k: v for k, v in sampling.items() if v is not None},
        prompt=prompt,
        messages=messages,
    )


def _parse_token_ids(value: Any, param: str, *, allow_empty: bool = False) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ProtocolError(f"'{param}' must be a list of integer token ids", param=param)
    if not value and not allow_empty:
        raise ProtocolError(f"'{param}' must not be empty", param=param)
    return value


def _parse_prompt(prompt: Any) -> str | list[int]:
    if prompt is None:
        raise ProtocolError("'prompt' is required", param="prompt")
    if isinstance(prompt, str):
        return _text(prompt, "prompt")
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


def _text(value: str, param: str) -> str:
    if not is_valid_unicode(value):
        raise ProtocolError(f"'{param}' is not valid Unicode: it holds a lone surrogate (e.g. \\ud800)",
                            param=param)
    return value


def _printable(value: str, limit: int = 100) -> str:
    """A client string safe to echo in an error: valid Unicode, at most `limit` characters."""
    text = value.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[:limit] + "..."


def _message_text(content: Any, role: str, param: str) -> str:
    if isinstance(content, str):
        return _text(content, param)
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ProtocolError(f"'{param}' parts must be {{'type': 'text', 'text': <string>}}; "
                                    "other content types are not supported", param=param)
            texts.append(_text(part["text"], param))
        return "".join(texts)
    raise ProtocolError(f"'{param}' must be a string or a list of text parts", param=param)


def num_prompt_chars(request: GenerationRequest) -> int:
    """Characters of the client's text: the prompt, or the messages' contents (0 for token ids)."""
    if request.is_chat:
        return sum(len(m["content"]) for m in request.messages)
    return len(request.prompt) if isinstance(request.prompt, str) else 0


def check_prompt_chars(request: GenerationRequest, max_seq_len: int, max_token_chars: int) -> None:
    """Refuses, before any tokenizing, text that is longer than the context could hold even if
    every token were the vocabulary's longest (`max_token_chars` characters)."""
    num_chars = num_prompt_chars(request)
    if num_chars > max_seq_len * max_token_chars:
        raise ProtocolError(
            f"This model's maximum context length is {max_seq_len} tokens; the prompt has {num_chars} "
            f"characters, which is at least {-(-num_chars // max_token_chars)} tokens (no token is longer "
            f"than {max_token_chars} characters)", param="messages" if request.is_chat else "prompt",
            code="context_length_exceeded")


def prompt_token_ids(tokenizer: Any, request: GenerationRequest) -> list[int]:
    """The prompt's token ids: the chat template for chat (with the generation prompt), else the
    tokenizer (with its special tokens, e.g. BOS) or the client's own ids."""
    if request.is_chat:
        try:
            return encode_chat(tokenizer, request.messages)
        except (ValueError, TypeError, jinja2.TemplateError) as e:
            raise ProtocolError(f"the chat template rejected the messages: {e}", param="messages") from None
    if isinstance(request.prompt, str):
        return encode_text(tokenizer, request.prompt)
    return list(request.prompt)


def build_sampling_params(request: GenerationRequest, num_prompt_tokens: int, max_seq_len: int) -> SamplingParams:
    """SamplingParams for one choice, with the endpoint's default max_tokens (vLLM's: the rest of
    the context for chat, 16 for completions). Checked by the engine at admission."""
    max_tokens = request.max_tokens
    if max_tokens is None:
        room = max(max_seq_len - num_prompt_tokens, 1)  # no room: admission names the prompt
        max_tokens = room if request.is_chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room)
    return SamplingParams(max_tokens=max_tokens, logprobs=request.logprobs, **request.sampling)


def admission_error(error: InvalidRequestError, request: GenerationRequest) -> ProtocolError:
    """The 400 for a request the engine's admission check refused, naming the client's field."""
    param = error.param
    if param == "prompt" and request.is_chat:
        param = "messages"
    elif param == "max_tokens":
        param = request.max_tokens_param
    elif param == "logprobs" and request.is_chat:
        param = "top_logprobs"
    return ProtocolError(str(error), param=param, code=error.code)


# ---- responses -----------------------------------------------------------------------------------

TokenText = Callable[[int], str]
SSE_DONE = b"data: [DONE]\n\n"


def new_response_id(is_chat: bool) -> str:
    return f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}"


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


class ChoiceState:
    """What one choice has produced so far (for non-streaming responses and usage)."""

    def __init__(self) -> None:
        self.text_parts: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0

    def add(self, output: RequestOutput) -> None:
        self.text_parts.append(output.new_text)
        self.logprobs.extend(output.new_logprobs or [])
        self.num_prompt_tokens = output.num_prompt_tokens
        self.num_output_tokens = output.num_output_tokens
        self.num_cached_tokens = output.num_cached_tokens
        if output.finished:
            self.finish_reason = output.finish_reason
            self.error = output.error

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def total_usage(choices: list[ChoiceState]) -> dict[str, Any]:
    """The prompt is counted once (as OpenAI does for n > 1); completion tokens add up."""
    first = choices[0]
    return usage(first.num_prompt_tokens, sum(c.num_output_tokens for c in choices), first.num_cached_tokens)


def completion_logprobs(entries: list[TokenLogprob], token_text: TokenText, text_offset: int) -> dict[str, Any]:
    """The legacy completions logprobs object; `text_offset` is where these tokens start in the text."""
    tokens, offsets = [], []
    for entry in entries:
        text = token_text(entry.token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [{token_text(t): lp for t, lp in entry.top} for entry in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[TokenLogprob], token_text: TokenText) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [
        {**item(entry.token_id, entry.logprob), "top_logprobs": [item(t, lp) for t, lp in entry.top]}
        for entry in entries
    ]}


class ResponseShaper:
    """Builds every object of one HTTP response (all chunks share id, created and model)."""

    def __init__(self, *, is_chat: bool, model: str, token_text: TokenText, want_logprobs: bool,
                 include_usage: bool = False) -> None:
        self.is_chat = is_chat
        self.model = model
        self.token_text = token_text
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.response_id = new_response_id(is_chat)
        self.created = int(time.time())
        self._text_offsets: dict[int, int] = {}

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.response_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def full_response(self, choices: list[ChoiceState]) -> dict[str, Any]:
        shaped = []
        for index, choice in enumerate(choices):
            if self.is_chat:
                item = {"index": index, "message": {"role": "assistant", "content": choice.text},
                        "logprobs": chat_logprobs(choice.logprobs, self.token_text) if self.want_logprobs else None}
            else:
                item = {"index": index, "text": choice.text,
                        "logprobs": (completion_logprobs(choice.logprobs, self.token_text, 0)
                                     if self.want_logprobs else None)}
            item["finish_reason"] = choice.finish_reason
            shaped.append(item)
        response = self._envelope("chat.completion" if self.is_chat else "text_completion", shaped)
        response["usage"] = total_usage(choices)
        return response

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self._envelope("chat.completion.chunk" if self.is_chat else "text_completion", [choice])
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def role_chunk(self, index: int) -> dict[str, Any]:
        """The first chat chunk of a choice: the assistant role and no content."""
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def delta_chunk(self, index: int, output: RequestOutput) -> dict[str, Any]:
        finish_reason = output.finish_reason if output.finished else None
        entries = output.new_logprobs or []
        if self.is_chat:
            delta = {"content": output.new_text} if output.new_text or not output.finished else {}
            logprobs = chat_logprobs(entries, self.token_text) if self.want_logprobs else None
            return self._chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})
        offset = self._text_offsets.get(index, 0)
        self._text_offsets[index] = offset + len(output.new_text)
        logprobs = completion_logprobs(entries, self.token_text, offset) if self.want_logprobs else None
        return self._chunk({"index": index, "text": output.new_text, "logprobs": logprobs,
                            "finish_reason": finish_reason})

    def usage_chunk(self, choices: list[ChoiceState]) -> dict[str, Any]:
        chunk = self._envelope("chat.completion.chunk" if self.is_chat else "text_completion", [])
        chunk["usage"] = total_usage(choices)
        return chunk
