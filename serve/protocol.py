"""The OpenAI protocol, both ways: JSON bodies -> GenerationRequest -> SamplingParams, and engine
deltas -> completion / chat JSON objects and SSE chunks.

Requests: this module reads the JSON (types, the OpenAI fields the server supports, the text of prompts and
messages; fields OpenAI or vLLM define that the server does not implement are refused, fields of
neither API ignored and logged); the bounds of every value are the engine's admission check (`jaxserve.core.request.
check_request`), whose refusals `admission_error` turns into the same 400s. Every problem becomes
a ProtocolError carrying the HTTP status and the fields of an OpenAI-style error body.
Responses: plain dicts; `token_text(token_id) -> str` turns a token id into its text for logprobs.
No jax here: this module is unit-tested in milliseconds.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from typing import Any, Callable

import jinja2

from jaxserve.core.outputs import RequestOutput, TokenLogprob
from jaxserve.core.request import InvalidRequestError, SamplingParams, encode_chat, encode_text, is_valid_unicode
from jaxserve.core.structured_output import StructuredOutputParams
from serve.chat_output import ChoiceOutput
from serve.structured import (StructuredRequestError, ToolsRequest, nesting_depth, parse_structured_output,
                              parse_tool_call_message, parse_tools)

logger = logging.getLogger(__name__)

MAX_CHOICES = 16  # upper bound on `n` and `best_of`
MAX_REQUEST_SEQUENCES = 256  # engine requests one HTTP request may start: prompts x best_of
DEFAULT_COMPLETION_MAX_TOKENS = 16  # what OpenAI and vLLM use when a completion names none
_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _is_false(value: Any) -> bool:
    return value is False


def _is_empty(value: Any) -> bool:
    return value in ([], {}, "")


def _only_null(value: Any) -> bool:
    return False


# Fields OpenAI or vLLM define that jaxserve does not implement, each with the test of its neutral
# value (null always is): a request that sets one to anything else gets a 400 naming the field,
# never an answer that silently ignored it. Fields of neither API are ignored, as vLLM does, with
# one WARNING line naming them (`_check_field_support`).
_UNSUPPORTED_COMMON = {
    "use_beam_search": _is_false, "length_penalty": lambda v: v == 1 and not isinstance(v, bool),
    "spaces_between_special_tokens": lambda v: v is True, "truncate_prompt_tokens": _only_null,
    "allowed_token_ids": _only_null, "bad_words": _is_empty, "priority": lambda v: v == 0 and v is not False,
    "logits_processors": _is_empty, "return_tokens_as_token_ids": _is_false, "return_token_ids": _is_false,
    "prompt_embeds": _only_null, "cache_salt": _only_null, "kv_transfer_params": _only_null,
    "vllm_xargs": _only_null, "mm_processor_kwargs": _is_empty, "request_id": _only_null,
    "service_tier": lambda v: v in ("auto", "default"),
}
UNSUPPORTED_COMPLETION_FIELDS = dict(_UNSUPPORTED_COMMON)
UNSUPPORTED_CHAT_FIELDS = {
    **_UNSUPPORTED_COMMON, "function_call": lambda v: v == "none", "audio": _only_null,
    "modalities": lambda v: v == ["text"], "prediction": _only_null, "reasoning_effort": _only_null,
    "web_search_options": _only_null, "verbosity": _only_null, "store": _is_false,
    "continue_final_message": _is_false, "documents": _only_null, "chat_template": _only_null,
}
# Fields read elsewhere in this module, or that change nothing in the output (OpenAI's end-user and
# caching hints: `user`, `metadata`, `prompt_cache_key`, `safety_identifier`).
_SERVED_COMMON = {
    "model", "n", "best_of", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
    "logprobs", "logit_bias", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
    "add_special_tokens", "user", "metadata", "prompt_cache_key", "safety_identifier",
    # structured output, tools, echo and prompt logprobs (their own code paths)
    "echo", "prompt_logprobs", "response_format", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs",
    "tools", "tool_choice", "parallel_tool_calls",
}
_SERVED_COMPLETION_FIELDS = _SERVED_COMMON | {"prompt", "suffix"}
_SERVED_CHAT_FIELDS = _SERVED_COMMON | {"messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt",
                                        "functions", "chat_template_kwargs", "include_reasoning"}
# apply_chat_template's own arguments and the variables it sets: not for chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})
MAX_TEMPLATE_KWARGS_DEPTH = 64  # nesting of chat_template_kwargs' values (templates recurse)


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
    prompts: list[str | list[int]] | None = None  # completions: one or more prompts, each text or token ids
    messages: list[dict[str, str]] | None = None  # chat: role/content strings for the template
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk
    best_of: int = 1  # candidates per prompt, of which the n with the highest cumulative logprob return
    add_special_tokens: bool = True  # the tokenizer's special tokens (BOS): completions yes, chat no (vLLM)
    add_generation_prompt: bool = True  # chat: end the template with the assistant's turn
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: returned as such
    echo: bool = False  # completions: the prompt (and with logprobs its logprobs) before the completion
    structured_output: StructuredOutputParams | None = None  # response_format / guided_*
    tools: ToolsRequest | None = None  # chat: tools and tool_choice
    chat_template_kwargs: dict[str, Any] | None = None  # chat: extra variables for the template (enable_thinking)
    include_reasoning: bool = True  # chat, with a reasoning parser: false leaves the reasoning out

    @property
    def num_prompts(self) -> int:
        return 1 if self.is_chat else len(self.prompts)


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
    _check_field_support(body, UNSUPPORTED_COMPLETION_FIELDS, _SERVED_COMPLETION_FIELDS)
    if fields.present("suffix"):
        raise ProtocolError("'suffix' is not supported", param="suffix")
    request = _build(fields, served_model, is_chat=False, max_tokens=fields.integer("max_tokens"),
                     max_tokens_param="max_tokens", logprobs=fields.integer("logprobs"),
                     prompts=_parse_prompts(body.get("prompt")))
    request.echo = fields.boolean("echo")
    return _with_structured_fields(request, fields)


def parse_chat_request(body: Any, served_model: str) -> GenerationRequest:
    """Validates a /v1/chat/completions body."""
    fields = _common_checks(body, served_model)
    _check_field_support(body, UNSUPPORTED_CHAT_FIELDS, _SERVED_CHAT_FIELDS)
    if body.get("functions"):
        raise ProtocolError("'functions' is not supported: use 'tools'", param="functions")
    if fields.boolean("echo"):
        raise ProtocolError("'echo' is not supported for chat completions", param="echo")
    max_tokens_param = "max_completion_tokens" if fields.present("max_completion_tokens") else "max_tokens"
    top_logprobs = fields.integer("top_logprobs")
    wants_logprobs = fields.boolean("logprobs")
    if top_logprobs is not None and not wants_logprobs:
        raise ProtocolError("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")
    logprobs = (top_logprobs or 0) if wants_logprobs else None
    request = _build(fields, served_model, is_chat=True, max_tokens=fields.integer(max_tokens_param),
                     max_tokens_param=max_tokens_param, logprobs=logprobs,
                     messages=_parse_messages(body.get("messages")))
    request.chat_template_kwargs = _parse_chat_template_kwargs(body.get("chat_template_kwargs"))
    request.include_reasoning = fields.boolean("include_reasoning", default=True)
    return _with_structured_fields(request, fields)


def _parse_chat_template_kwargs(value: Any) -> dict[str, Any] | None:
    """vLLM's `chat_template_kwargs`: a JSON object of variables for the chat template (e.g.
    {"enable_thinking": false}); none of apply_chat_template's own arguments."""
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise ProtocolError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    for key in value:
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise ProtocolError(f"'chat_template_kwargs' may not set {key!r}: it is a field of its own or the "
                                "server's", param=f"chat_template_kwargs.{key}")
    if nesting_depth(value) > MAX_TEMPLATE_KWARGS_DEPTH:
        raise ProtocolError(f"'chat_template_kwargs' is nested deeper than {MAX_TEMPLATE_KWARGS_DEPTH} levels",
                            param="chat_template_kwargs")
    return value


def _with_structured_fields(request: GenerationRequest, fields: _Fields) -> GenerationRequest:
    """`prompt_logprobs`, the output constraint (response_format, guided_*) and, for chat, tools."""
    request.prompt_logprobs = fields.integer("prompt_logprobs", low=0)
    try:
        request.structured_output = parse_structured_output(fields.body)
        request.tools = parse_tools(fields.body) if request.is_chat else None
    except StructuredRequestError as e:
        raise ProtocolError(str(e), param=e.param) from None
    if request.tools is not None and request.tools.grammar() is not None and request.structured_output is not None:
        if request.structured_output.param.startswith("response_format"):
            # A forced call is the whole output and `response_format` shapes a text answer, which this
            # output cannot hold (OpenAI accepts both; vLLM's tool schema replaces the format): the
            # call's grammar applies. The Agents SDK sends both for an agent with an output_type.
            request.structured_output = None
            return request
        raise ProtocolError(f"'tool_choice' {request.tools.choice!r} constrains the output: it cannot be combined "
                            f"with '{request.structured_output.param}'", param="tool_choice")
    return request


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
    for hint in ("user", "prompt_cache_key", "safety_identifier"):  # hints: unused, but typed as OpenAI types them
        if body.get(hint) is not None and not isinstance(body[hint], str):
            raise ProtocolError(f"'{hint}' must be a string", param=hint)
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise ProtocolError("'metadata' must be an object", param="metadata")
    return _Fields(body)


def _check_field_support(body: dict[str, Any], unsupported: dict[str, Callable[[Any], bool]],
                         served: set[str]) -> None:
    """400 for an OpenAI / vLLM field jaxserve does not implement set to a non-neutral value; one
    WARNING line for fields of neither API (ignored, as vLLM does)."""
    for name, is_neutral in unsupported.items():
        value = body.get(name)
        if value is not None and not is_neutral(value):
            raise ProtocolError(f"'{name}' is not supported by this server", param=name, code="unsupported_field")
    unknown = [name for name in body if name not in served and name not in unsupported]
    if unknown:
        shown = ", ".join(repr(_printable(name, 40)) for name in unknown[:5])
        logger.warning("request fields ignored (neither OpenAI nor vLLM fields): %s%s", shown,
                       f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")


def _parse_logit_bias(value: Any) -> dict[int, float] | None:
    """OpenAI's `logit_bias`: token ids (JSON object keys, so strings) -> numbers; the range of
    both is admission's (`check_request`)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError("'logit_bias' must be an object mapping token ids to biases", param="logit_bias")
    parsed = {}
    for key, bias in value.items():
        token = key.strip()
        if not (token.isascii() and token.isdigit()) or len(token) > 10:
            raise ProtocolError(f"'logit_bias' keys must be token ids, got {_printable(key, 20)!r}", param="logit_bias")
        if not isinstance(bias, (int, float)) or isinstance(bias, bool):
            raise ProtocolError(f"'logit_bias' values must be numbers, got {bias!r} for {token}", param="logit_bias")
        parsed[int(token)] = bias
    return parsed


def _build(fields: _Fields, served_models: str | tuple[str, ...], *, is_chat: bool, max_tokens: int | None,
           max_tokens_param: str, logprobs: int | None, prompts: Any = None, messages: Any = None) -> GenerationRequest:
    stream = fields.boolean("stream")
    stream_options = fields.body.get("stream_options")
    include_usage = continuous_usage = False
    if stream_options is not None:
        if not stream:
            raise ProtocolError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        if not isinstance(stream_options, dict):
            raise ProtocolError("'stream_options' must be an object", param="stream_options")
        include_usage = _Fields(stream_options).boolean("include_usage")
        # vLLM's: usage in every chunk too (a choice's tokens so far), with include_usage only
        continuous_usage = _Fields(stream_options).boolean("continuous_usage_stats") and include_usage
    n = fields.integer("n", low=1, high=MAX_CHOICES, default=1)
    best_of = fields.integer("best_of", low=1, high=MAX_CHOICES, default=n)
    if best_of < n:
        raise ProtocolError(f"'best_of' must be >= 'n' ({n}), got {best_of}", param="best_of")
    if best_of > n and stream:
        raise ProtocolError("'best_of' greater than 'n' cannot be streamed", param="best_of")
    num_prompts = 1 if is_chat else len(prompts)
    if num_prompts * best_of > MAX_REQUEST_SEQUENCES:
        raise ProtocolError(f"one request may generate at most {MAX_REQUEST_SEQUENCES} sequences; it asks for "
                            f"{num_prompts} prompts x {best_of}", param="n" if best_of == n else "best_of")
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
        "logit_bias": _parse_logit_bias(fields.body.get("logit_bias")) or None,
        "min_tokens": fields.integer("min_tokens", low=0),
        "include_stop_str_in_output": fields.boolean("include_stop_str_in_output", default=None),
        "skip_special_tokens": fields.boolean("skip_special_tokens", default=None),
    }
    model = fields.body.get("model")
    return GenerationRequest(
        is_chat=is_chat,
        model=model if model is not None else (served_models if isinstance(served_models, str) else served_models[0]),
        n=n,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        logprobs=logprobs,
        sampling={k: v for k, v in sampling.items() if v is not None},
        prompts=prompts,
        messages=messages,
        best_of=best_of,
        add_special_tokens=fields.boolean("add_special_tokens", default=not is_chat),
        add_generation_prompt=fields.boolean("add_generation_prompt", default=True),
    )


def _parse_token_ids(value: Any, param: str, *, allow_empty: bool = False) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ProtocolError(f"'{param}' must be a list of integer token ids", param=param)
    if not value and not allow_empty:
        raise ProtocolError(f"'{param}' must not be empty", param=param)
    return value


def _parse_prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's `prompt`: a string, a list of token ids, or a batch: a list of strings or of token
    id lists (one choice per prompt, times n)."""
    if prompt is None:
        raise ProtocolError("'prompt' is required", param="prompt")
    if isinstance(prompt, str):
        return [_text(prompt, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_REQUEST_SEQUENCES:
            raise ProtocolError(f"'prompt' may hold at most {MAX_REQUEST_SEQUENCES} prompts, got {len(prompt)}",
                                param="prompt")
        return [_batched_prompt(p, i) for i, p in enumerate(prompt)]
    if isinstance(prompt, list):
        return [_parse_token_ids(prompt, "prompt")]
    raise ProtocolError("'prompt' must be a string, a list of token ids, or a list of either", param="prompt")


def _batched_prompt(prompt: str | list, index: int) -> str | list[int]:
    try:
        return _text(prompt, "prompt") if isinstance(prompt, str) else _parse_token_ids(prompt, "prompt")
    except ProtocolError as e:
        raise ProtocolError(f"prompt {index}: {e.message}", param="prompt") from None


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
        content = message.get("content")
        if role == "assistant" and message.get("tool_calls") is not None and content is None:
            content = ""
        parsed.append({"role": role, "content": _message_text(content, role, f"{param}.content")})
        if role == "assistant" and message.get("tool_calls") is not None:  # a turn that called tools
            try:
                calls = parse_tool_call_message(message, param)
            except StructuredRequestError as e:
                raise ProtocolError(str(e), param=e.param) from None
            if calls:  # an empty list is no calls (templates test for the key)
                parsed[-1]["tool_calls"] = calls
        if role == "assistant":
            parsed[-1].update(_message_reasoning(message, param))
        if role == "tool":  # a tool's result: which call it answers
            for name in ("tool_call_id", "name"):
                if isinstance(message.get(name), str):
                    parsed[-1][name] = message[name]
    return parsed


def _message_reasoning(message: dict[str, Any], param: str) -> dict[str, str]:
    """An assistant turn's reasoning (`reasoning`, or its former name `reasoning_content`), given
    to the template under both names (Qwen3's reads `reasoning_content`); {} without one."""
    for name in ("reasoning", "reasoning_content"):
        value = message.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ProtocolError(f"'{param}.{name}' must be a string", param=f"{param}.{name}")
        return {"reasoning": _text(value, f"{param}.{name}"), "reasoning_content": value}
    return {}


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


def num_prompt_chars(request: GenerationRequest, index: int = 0) -> int:
    """Characters of the client's text: prompt `index`, or the messages' contents (0 for token ids)."""
    if request.is_chat:
        return sum(len(m["content"]) + len(m.get("reasoning", "")) for m in request.messages)
    prompt = request.prompts[index]
    return len(prompt) if isinstance(prompt, str) else 0


def check_prompt_chars(request: GenerationRequest, max_seq_len: int, max_token_chars: int) -> None:
    """Refuses, before any tokenizing, text that is longer than the context could hold even if
    every token were the vocabulary's longest (`max_token_chars` characters)."""
    for index in range(request.num_prompts):
        num_chars = num_prompt_chars(request, index)
        if num_chars > max_seq_len * max_token_chars:
            which = f"prompt {index} has" if request.num_prompts > 1 else "prompt has"
            raise ProtocolError(
                f"This model's maximum context length is {max_seq_len} tokens; the {which} {num_chars} "
                f"characters, which is at least {-(-num_chars // max_token_chars)} tokens (no token is longer "
                f"than {max_token_chars} characters)", param="messages" if request.is_chat else "prompt",
                code="context_length_exceeded")


def prompt_token_ids(tokenizer: Any, request: GenerationRequest, index: int = 0) -> list[int]:
    """The token ids of prompt `index`: the chat template for chat (with the generation prompt
    unless the client turned it off), else the tokenizer (with its special tokens, e.g. BOS,
    unless `add_special_tokens` is false) or the client's own ids."""
    if request.is_chat:
        return _encode_chat_request(tokenizer, request)
    prompt = request.prompts[index]
    if isinstance(prompt, str):
        return encode_text(tokenizer, prompt, add_special_tokens=request.add_special_tokens)
    return list(prompt)


# What a chat template may raise on a request's messages or variables (its raise_exception is a TemplateError).
_TEMPLATE_ERRORS = (ValueError, TypeError, ArithmeticError, LookupError, AttributeError, jinja2.TemplateError)


def _encode_chat_request(tokenizer: Any, request: GenerationRequest, with_kwargs: bool = True) -> list[int]:
    """The chat template's token ids; a template that refuses the request is a 400 naming
    `chat_template_kwargs` when the messages alone render, else `messages`."""
    kwargs = request.chat_template_kwargs if with_kwargs else None
    try:
        return encode_chat(tokenizer, request.messages, add_generation_prompt=request.add_generation_prompt,
                           add_special_tokens=request.add_special_tokens, chat_template_kwargs=kwargs,
                           tools=request.tools.template_tools if request.tools is not None else None)
    except _TEMPLATE_ERRORS as e:
        error = e
    except RecursionError:
        raise ProtocolError("the messages are nested too deeply for the chat template", param="messages") from None
    if kwargs:
        try:
            _encode_chat_request(tokenizer, request, with_kwargs=False)
        except ProtocolError:
            pass
        else:
            raise ProtocolError(f"the chat template rejected 'chat_template_kwargs': {error}",
                                param="chat_template_kwargs")
    raise ProtocolError(f"the chat template rejected the messages: {error}", param="messages")


def build_sampling_params(request: GenerationRequest, num_prompt_tokens: int, max_seq_len: int,
                          defaults: dict[str, Any] | None = None) -> SamplingParams:
    """SamplingParams for one choice: the client's fields, then the server's `defaults` (the
    model's generation config or --default_sampling; `jaxserve.core.request.SAMPLING_DEFAULT_FIELDS`),
    then SamplingParams'. max_tokens defaults to vLLM's (the rest of the context for chat, 16 for
    completions), capped by a default max_tokens. Checked by the engine at admission."""
    defaults = dict(defaults or {})
    max_tokens = request.max_tokens
    if max_tokens is None:
        room = max(max_seq_len - num_prompt_tokens, 1)  # no room: admission names the prompt
        max_tokens = min(room, defaults.get("max_tokens") or room)
        if not request.is_chat:
            max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, max_tokens)
    defaults.pop("max_tokens", None)
    # Prompt logprobs: vLLM's prompt_logprobs, and echo's (the completion's logprobs, k each); echo
    # with max_tokens 0 runs the prompt alone (the engine's prefill-only request).
    wanted = [k for k in (request.prompt_logprobs, request.logprobs if request.echo else None) if k is not None]
    prompt_logprobs = max(wanted) if wanted else (0 if request.echo and max_tokens == 0 else None)
    structured_output = request.structured_output
    if structured_output is None and request.tools is not None:
        structured_output = request.tools.grammar()
    return SamplingParams(max_tokens=max_tokens, logprobs=request.logprobs, prompt_logprobs=prompt_logprobs,
                          structured_output=structured_output, **{**defaults, **request.sampling})


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


# ---- /tokenize and /detokenize (vLLM's shapes) ---------------------------------------------------

_UNSUPPORTED_TOKENIZE_FIELDS = {name: UNSUPPORTED_CHAT_FIELDS[name] for name in (
    "continue_final_message", "chat_template", "documents", "mm_processor_kwargs")}
_UNSUPPORTED_TOKENIZE_FIELDS["tools"] = _is_empty
_SERVED_TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                           "return_token_strs", "chat_template_kwargs"}


def parse_tokenize_request(body: Any, served_models: str | tuple[str, ...]) -> tuple[GenerationRequest, bool]:
    """A /tokenize body: {"prompt": text} or {"messages": [...]}, with `add_special_tokens`
    (default: true for a prompt, false for messages, as vLLM), `add_generation_prompt` (messages,
    default true) and `return_token_strs`. Returns the prompt as a GenerationRequest (so it is
    encoded exactly as generation would; `chat_template_kwargs` too) and whether token strings were
    asked for."""
    fields = _common_checks(body, served_models)
    _check_field_support(body, _UNSUPPORTED_TOKENIZE_FIELDS, _SERVED_TOKENIZE_FIELDS)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise ProtocolError("give exactly one of 'prompt' or 'messages'", param="prompt")
    if has_prompt and not isinstance(body["prompt"], str):
        raise ProtocolError("'prompt' must be a string", param="prompt")
    model = body.get("model")
    request = GenerationRequest(
        is_chat=has_messages,
        model=model if model is not None else (served_models if isinstance(served_models, str) else served_models[0]),
        n=1, stream=False, include_usage=False, max_tokens=None, max_tokens_param="max_tokens", logprobs=None,
        sampling={}, prompts=[_text(body["prompt"], "prompt")] if has_prompt else None,
        messages=_parse_messages(body["messages"]) if has_messages else None,
        add_special_tokens=fields.boolean("add_special_tokens", default=has_prompt),
        add_generation_prompt=fields.boolean("add_generation_prompt", default=True))
    if has_messages:
        request.chat_template_kwargs = _parse_chat_template_kwargs(body.get("chat_template_kwargs"))
    return request, fields.boolean("return_token_strs")


def parse_detokenize_request(body: Any, served_models: str | tuple[str, ...], vocab_size: int) -> list[int]:
    """A /detokenize body: {"tokens": [ids]} -> the ids (each in [0, vocab_size))."""
    _common_checks(body, served_models)
    _check_field_support(body, {}, {"model", "tokens"})
    tokens = _parse_token_ids(body.get("tokens"), "tokens", allow_empty=True)
    if tokens is None:
        raise ProtocolError("'tokens' is required", param="tokens")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ProtocolError(f"token id {bad} is not in [0, {vocab_size})", param="tokens")
    return tokens


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
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.error_param: str | None = None  # the client's field that caused the error, if it did
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[TokenLogprob] | None = None  # prompt tokens 2.. (with the first delta)

    def add(self, output: RequestOutput) -> None:
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.text_parts.append(output.new_text)
        self.logprobs.extend(output.new_logprobs or [])
        self.num_prompt_tokens = output.num_prompt_tokens
        self.num_output_tokens = output.num_output_tokens
        self.num_cached_tokens = output.num_cached_tokens
        if output.finished:
            self.finish_reason = output.finish_reason
            self.stop_reason = output.stop_reason
            self.error = output.error
            self.error_param = output.error_param

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def cumulative_logprob(self) -> float:
        """Sum of the sampled tokens' logprobs (what best_of ranks candidates by)."""
        return sum(entry.logprob for entry in self.logprobs)


def total_usage(choices: list[ChoiceState], choices_per_prompt: int | None = None) -> dict[str, Any]:
    """Usage of a response whose choices come in groups of `choices_per_prompt` per prompt (default:
    one prompt): each prompt is counted once (as OpenAI does for n > 1), completion tokens add up."""
    per_prompt = choices_per_prompt or len(choices)
    firsts = choices[::per_prompt]
    return usage(sum(c.num_prompt_tokens for c in firsts), sum(c.num_output_tokens for c in choices),
                 sum(c.num_cached_tokens for c in firsts))


def select_best(choices: list[ChoiceState], best_of: int, n: int) -> list[ChoiceState]:
    """Of each prompt's `best_of` candidates (consecutive), the `n` with the highest cumulative
    logprob, best first (ties keep candidate order)."""
    selected = []
    for start in range(0, len(choices), best_of):
        candidates = choices[start:start + best_of]
        selected += sorted(candidates, key=lambda c: -c.cumulative_logprob)[:n]
    return selected


def completion_logprobs(entries: list[TokenLogprob], token_text: TokenText, text_offset: int) -> dict[str, Any]:
    """The legacy completions logprobs object; `text_offset` is where these tokens start in the text.
    Each `top_logprobs` dict holds the top k and the sampled token (up to k + 1 entries, as OpenAI)."""
    tokens, offsets = [], []
    for entry in entries:
        text = token_text(entry.token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [{token_text(entry.token_id): entry.logprob, **{token_text(t): lp for t, lp in entry.top}}
                         for entry in entries],
        "text_offset": offsets,
    }


def echo_logprobs(prompt_ids: list[int], entries: list[TokenLogprob] | None, token_text: TokenText,
                  completion: dict[str, Any] | None = None) -> dict[str, Any]:
    """The completions logprobs object of an echoed prompt (its first token has none), followed by
    the `completion`'s (built with text offsets after the prompt's tokens)."""
    tokens = [token_text(t) for t in prompt_ids]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    entries = entries or []
    shaped = {
        "tokens": tokens,
        "token_logprobs": [None] + [entry.logprob for entry in entries],
        "top_logprobs": [None] + [{token_text(entry.token_id): entry.logprob, **{token_text(t): lp for t, lp in entry.top}}
                                  for entry in entries],
        "text_offset": offsets,
    }
    for name, values in (completion or {}).items():
        shaped[name] = shaped[name] + values
    return shaped


def prompt_logprobs_field(entries: list[TokenLogprob] | None, token_text: TokenText) -> list[Any]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per token a dict of token
    id (as text) -> {logprob, rank, decoded_token} holding the prompt token and the top k."""
    shaped: list[Any] = [None]
    for entry in entries or []:
        item = {str(t): {"logprob": lp, "rank": rank, "decoded_token": token_text(t)}
                for rank, (t, lp) in enumerate(entry.top, 1)}
        item[str(entry.token_id)] = {"logprob": entry.logprob, "rank": entry.rank,
                                     "decoded_token": token_text(entry.token_id)}
        shaped.append(item)
    return shaped


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
                 include_usage: bool = False, prompts: list[tuple[str, list[int]]] | None = None,
                 choices_per_prompt: int = 1, echo: bool = False, want_prompt_logprobs: bool = False,
                 output_parser: Callable[[], ChoiceOutput | None] | None = None,
                 continuous_usage: bool = False) -> None:
        """`prompts`: (text, token ids) of each prompt, choice i's being prompt i //
        `choices_per_prompt`; `echo` puts a completion's prompt (and its logprobs) before its
        text; `want_prompt_logprobs` adds vLLM's prompt_logprobs; `output_parser()` gives each chat
        choice its parser of reasoning and tool calls (serve/chat_output.py; None: plain content);
        `continuous_usage` puts each choice's usage so far in each of its chunks (vLLM's
        continuous_usage_stats)."""
        self.is_chat = is_chat
        self.model = model
        self.token_text = token_text
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.response_id = new_response_id(is_chat)
        self.created = int(time.time())
        self._text_offsets: dict[int, int] = {}
        self.prompts = prompts or []
        self.choices_per_prompt = choices_per_prompt
        self.echo = echo and not is_chat
        self.want_prompt_logprobs = want_prompt_logprobs
        self.output_parser = output_parser or (lambda: None)
        self._output_parsers: dict[int, ChoiceOutput | None] = {}  # streaming: per choice
        self._started: set[int] = set()  # streaming: choices whose first chunk was built

    def _prompt(self, index: int) -> tuple[str, list[int]]:
        return self.prompts[index // self.choices_per_prompt] if self.prompts else ("", [])

    def _structured_item(self, item: dict[str, Any], index: int, choice: ChoiceState) -> None:
        """Echo and prompt logprobs (completions), reasoning and tool calls (chat) on one choice of a
        full response."""
        text, prompt_ids = self._prompt(index)
        if self.echo:
            item["text"] = text + item["text"]
            if item["logprobs"] is not None:
                item["logprobs"] = echo_logprobs(prompt_ids, choice.prompt_logprobs, self.token_text,
                                                 completion_logprobs(choice.logprobs, self.token_text, len(text)))
        if self.want_prompt_logprobs and not self.is_chat:
            item["prompt_logprobs"] = prompt_logprobs_field(choice.prompt_logprobs, self.token_text)
        parser = self.output_parser() if self.is_chat else None
        if parser is not None:
            fields, item["finish_reason"] = parser.parse(choice.text, choice.finish_reason)
            item["message"].update(fields)

    def _structured_chunk(self, chunk: dict[str, Any], index: int, output: RequestOutput) -> dict[str, Any]:
        """Echo and prompt logprobs on a choice's first chunk; a chat choice's delta through its
        reasoning and tool-call parser."""
        choice = chunk["choices"][0]
        first = index not in self._started
        self._started.add(index)
        if self.is_chat:
            if index not in self._output_parsers:
                self._output_parsers[index] = self.output_parser()
            parser = self._output_parsers[index]
            if parser is not None:
                choice["delta"], choice["finish_reason"] = parser.stream(
                    output.new_text, output.finished, output.finish_reason if output.finished else None)
        elif first and self.echo:
            text, prompt_ids = self._prompt(index)
            choice["text"] = text + choice["text"]
            self._text_offsets[index] = self._text_offsets.get(index, 0) + len(text)
            if choice["logprobs"] is not None:
                choice["logprobs"] = echo_logprobs(prompt_ids, output.prompt_logprobs, self.token_text,
                                                   completion_logprobs(output.new_logprobs or [], self.token_text,
                                                                       len(text)))
        if first and self.want_prompt_logprobs:
            shaped = prompt_logprobs_field(output.prompt_logprobs, self.token_text)
            (chunk if self.is_chat else choice)["prompt_logprobs"] = shaped
        return chunk

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.response_id, "object": object_name, "created": self.created, "model": self.model,
                "choices": choices}

    def full_response(self, choices: list[ChoiceState], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """The whole response; choice i gets index i (prompt p, choice j: p * n + j, as OpenAI).
        `usage` defaults to `total_usage(choices)` (one prompt)."""
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
            item["stop_reason"] = choice.stop_reason
            self._structured_item(item, index, choice)
            shaped.append(item)
        response = self._envelope("chat.completion" if self.is_chat else "text_completion", shaped)
        if self.want_prompt_logprobs and self.is_chat and choices:  # vLLM: chat's is the response's
            response["prompt_logprobs"] = prompt_logprobs_field(choices[0].prompt_logprobs, self.token_text)
        response["usage"] = usage if usage is not None else total_usage(choices)
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
        chunk = self._delta_chunk(index, output)
        if self.continuous_usage:
            chunk["usage"] = usage(output.num_prompt_tokens, output.num_output_tokens, output.num_cached_tokens)
        return chunk

    def _delta_chunk(self, index: int, output: RequestOutput) -> dict[str, Any]:
        finish_reason = output.finish_reason if output.finished else None
        stop_reason = output.stop_reason if output.finished else None
        entries = output.new_logprobs or []
        if self.is_chat:
            delta = {"content": output.new_text} if output.new_text or not output.finished else {}
            logprobs = chat_logprobs(entries, self.token_text) if self.want_logprobs else None
            return self._structured_chunk(self._chunk({"index": index, "delta": delta, "logprobs": logprobs,
                                                       "finish_reason": finish_reason, "stop_reason": stop_reason}),
                                          index, output)
        offset = self._text_offsets.get(index, 0)
        self._text_offsets[index] = offset + len(output.new_text)
        logprobs = completion_logprobs(entries, self.token_text, offset) if self.want_logprobs else None
        return self._structured_chunk(self._chunk({"index": index, "text": output.new_text, "logprobs": logprobs,
                                                   "finish_reason": finish_reason, "stop_reason": stop_reason}),
                                      index, output)

    def usage_chunk(self, choices: list[ChoiceState], choices_per_prompt: int | None = None) -> dict[str, Any]:
        chunk = self._envelope("chat.completion.chunk" if self.is_chat else "text_completion", [])
        chunk["usage"] = total_usage(choices, choices_per_prompt)
        return chunk
