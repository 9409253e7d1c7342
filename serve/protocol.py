"""The OpenAI protocol's requests: JSON bodies -> GenerationRequest -> SamplingParams, and the
errors every refusal becomes.

This module reads the JSON (types, the OpenAI fields the server supports, the text of prompts and
messages; fields OpenAI or vLLM define that the server does not implement are refused, fields of
neither API ignored and logged); the bounds of every value are the engine's admission check
(`jaxserve.core.request.check_request`), whose refusals `admission_error` turns into the same 400s.
Every problem becomes a ProtocolError carrying the HTTP status and the fields of an OpenAI-style
error body. Prompts are encoded by `serve.prompts`, responses shaped by `serve.shaping`.
No jax here: this module is unit-tested in milliseconds.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from jaxserve.core.request import InvalidRequestError, SamplingParams, is_valid_unicode
from jaxserve.core.structured_output import StructuredOutputParams
from jaxserve.multimodal.media import IMAGE_PART_TYPES, ImageRef, MediaError, part_url
from serve.structured import (StructuredRequestError, ToolsRequest, nesting_depth, parse_structured_output,
                              parse_tool_call_message, parse_tools)

logger = logging.getLogger(__name__)

MAX_CHOICES = 16  # upper bound on `n` and `best_of`
MAX_REQUEST_SEQUENCES = 256  # engine requests one HTTP request may start: prompts x best_of
DEFAULT_COMPLETION_MAX_TOKENS = 16  # what OpenAI and vLLM use when a completion names none
_CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


# Neutral-value tests of unsupported fields (here and in serve/responses.py); null always is neutral.
def is_false(value: Any) -> bool:
    return value is False


def is_empty(value: Any) -> bool:
    return value in ([], {}, "")


def only_null(value: Any) -> bool:
    return False


# Fields OpenAI or vLLM define that jaxserve does not implement, each with the test of its neutral
# value (null always is): a request that sets one to anything else gets a 400 naming the field,
# never an answer that silently ignored it. Fields of neither API are ignored, as vLLM does, with
# one WARNING line naming them (`check_field_support`).
_UNSUPPORTED_COMMON = {
    "use_beam_search": is_false, "length_penalty": lambda v: v == 1 and not isinstance(v, bool),
    "spaces_between_special_tokens": lambda v: v is True, "truncate_prompt_tokens": only_null,
    "allowed_token_ids": only_null, "bad_words": is_empty, "priority": lambda v: v == 0 and v is not False,
    "logits_processors": is_empty, "return_tokens_as_token_ids": is_false,
    "prompt_embeds": only_null, "cache_salt": only_null, "kv_transfer_params": only_null,
    "vllm_xargs": only_null, "mm_processor_kwargs": is_empty, "request_id": only_null,
    "service_tier": lambda v: v in ("auto", "default"),
}
UNSUPPORTED_COMPLETION_FIELDS = dict(_UNSUPPORTED_COMMON)
UNSUPPORTED_CHAT_FIELDS = {
    **_UNSUPPORTED_COMMON, "function_call": lambda v: v == "none", "audio": only_null,
    "modalities": lambda v: v == ["text"], "prediction": only_null, "reasoning_effort": only_null,
    "web_search_options": only_null, "verbosity": only_null, "store": is_false,
    "continue_final_message": is_false, "documents": only_null, "chat_template": only_null,
}
# Fields read elsewhere in this module, or that change nothing in the output (OpenAI's end-user and
# caching hints: `user`, `metadata`, `prompt_cache_key`, `safety_identifier`).
_SERVED_COMMON = {
    "model", "n", "best_of", "stream", "stream_options", "max_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos",
    "logprobs", "logit_bias", "min_tokens", "include_stop_str_in_output", "skip_special_tokens",
    "add_special_tokens", "user", "metadata", "prompt_cache_key", "safety_identifier", "return_token_ids",
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
    messages: list[dict[str, Any]] | None = None  # chat: role, content (a string, or parts with images)...
    images: list[ImageRef] = dataclasses.field(default_factory=list)  # chat: the images of the messages, in order
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
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the response

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
    check_field_support(body, UNSUPPORTED_COMPLETION_FIELDS, _SERVED_COMPLETION_FIELDS)
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
    check_field_support(body, UNSUPPORTED_CHAT_FIELDS, _SERVED_CHAT_FIELDS)
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
    messages, images = parse_messages(body.get("messages"))
    request = _build(fields, served_model, is_chat=True, max_tokens=fields.integer(max_tokens_param),
                     max_tokens_param=max_tokens_param, logprobs=logprobs, messages=messages)
    request.images = images
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
        raise ProtocolError(f"The model `{printable(model)}` does not exist", status=404, param="model",
                            code="model_not_found")
    for hint in ("user", "prompt_cache_key", "safety_identifier"):  # hints: unused, but typed as OpenAI types them
        if body.get(hint) is not None and not isinstance(body[hint], str):
            raise ProtocolError(f"'{hint}' must be a string", param=hint)
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise ProtocolError("'metadata' must be an object", param="metadata")
    return _Fields(body)


def check_field_support(body: dict[str, Any], unsupported: dict[str, Callable[[Any], bool]],
                         served: set[str]) -> None:
    """400 for an OpenAI / vLLM field jaxserve does not implement set to a non-neutral value; one
    WARNING line for fields of neither API (ignored, as vLLM does)."""
    for name, is_neutral in unsupported.items():
        value = body.get(name)
        if value is not None and not is_neutral(value):
            raise ProtocolError(f"'{name}' is not supported by this server", param=name, code="unsupported_field")
    unknown = [name for name in body if name not in served and name not in unsupported]
    if unknown:
        shown = ", ".join(repr(printable(name, 40)) for name in unknown[:5])
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
            raise ProtocolError(f"'logit_bias' keys must be token ids, got {printable(key, 20)!r}", param="logit_bias")
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
        return_token_ids=fields.boolean("return_token_ids"),
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


def parse_messages(messages: Any) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """Chat messages -> (the messages for the chat template, the images they refer to in order).

    A content is a string or a list of text and image parts (`image_url` / `input_image`, in user
    messages only); the template gets a string where a message has no image (its text parts
    joined), else its parts as `{"type": "text", "text": ...}` and `{"type": "image"}`."""
    if messages is None:
        raise ProtocolError("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise ProtocolError("'messages' must be a non-empty list", param="messages")
    parsed, images = [], []
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
        parsed.append({"role": role, "content": _message_content(content, role, f"{param}.content", i, images)})
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
    return parsed, images


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


def printable(value: str, limit: int = 100) -> str:
    """A client string safe to echo in an error: valid Unicode, at most `limit` characters."""
    text = value.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[:limit] + "..."


def _message_content(content: Any, role: str, param: str, index: int, images: list[ImageRef]) -> str | list[dict]:
    """Message `index`'s content for the template; its images are appended to `images`."""
    if isinstance(content, str):
        return _text(content, param)
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise ProtocolError(f"'{param}' must be a string or a list of content parts", param=param)
    parts, first_image = [], len(images)
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": _text(part["text"], param)})
        elif kind in IMAGE_PART_TYPES:
            ref = ImageRef("", len(images), index + 1, len(images) - first_image + 1)
            try:
                images.append(dataclasses.replace(ref, url=part_url(part, ref.label)))
            except MediaError as e:
                raise ProtocolError(f"'{param}': {e}", param=param) from None
            parts.append({"type": "image"})
        else:
            raise ProtocolError(f"'{param}' parts must be {{'type': 'text', 'text': <string>}} or images "
                                "{'type': 'image_url', 'image_url': {'url': <url>}}", param=param)
    if len(images) > first_image and role != "user":
        raise ProtocolError(f"'{param}': images are allowed in user messages only, not in {role} ones", param=param)
    return parts if len(images) > first_image else "".join(part["text"] for part in parts)


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
_UNSUPPORTED_TOKENIZE_FIELDS["tools"] = is_empty
_SERVED_TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                           "return_token_strs", "chat_template_kwargs"}


def parse_tokenize_request(body: Any, served_models: str | tuple[str, ...]) -> tuple[GenerationRequest, bool]:
    """A /tokenize body: {"prompt": text} or {"messages": [...]}, with `add_special_tokens`
    (default: true for a prompt, false for messages, as vLLM), `add_generation_prompt` (messages,
    default true) and `return_token_strs`. Returns the prompt as a GenerationRequest (so it is
    encoded exactly as generation would; `chat_template_kwargs` too) and whether token strings were
    asked for."""
    fields = _common_checks(body, served_models)
    check_field_support(body, _UNSUPPORTED_TOKENIZE_FIELDS, _SERVED_TOKENIZE_FIELDS)
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
        add_special_tokens=fields.boolean("add_special_tokens", default=has_prompt),
        add_generation_prompt=fields.boolean("add_generation_prompt", default=True))
    if has_messages:
        request.messages, request.images = parse_messages(body["messages"])
        request.chat_template_kwargs = _parse_chat_template_kwargs(body.get("chat_template_kwargs"))
    return request, fields.boolean("return_token_strs")


def parse_detokenize_request(body: Any, served_models: str | tuple[str, ...], vocab_size: int) -> list[int]:
    """A /detokenize body: {"tokens": [ids]} -> the ids (each in [0, vocab_size))."""
    _common_checks(body, served_models)
    check_field_support(body, {}, {"model", "tokens"})
    tokens = _parse_token_ids(body.get("tokens"), "tokens", allow_empty=True)
    if tokens is None:
        raise ProtocolError("'tokens' is required", param="tokens")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ProtocolError(f"token id {bad} is not in [0, {vocab_size})", param="tokens")
    return tokens

