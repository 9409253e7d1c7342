"""The Responses API (`POST /v1/responses`), stateless: a Responses body becomes the chat request
it stands for, and that generation's output becomes a Response object or its stream of events.

Requests: `parse_responses_request` reads the Responses fields (`input` as text or items,
`instructions`, flat function `tools`, `tool_choice`, `text.format`, `max_output_tokens`, ...),
refuses what it cannot honour with a 400 naming the field (`store: true`, `previous_response_id`,
hosted tools, files, ...) and builds the chat body that `serve.protocol.parse_chat_request`
validates as for /v1/chat/completions: the same chat template, tools, structured output and
sampling. Chat's field names in its refusals are turned into the Responses ones (`client_error`).
Nothing is stored: `store` may be false or absent, and no response can be fetched later.

Responses: `ResponsesShaper` builds the Response (an assistant message and/or function calls, the
calls parsed by `serve.tool_parsers.ToolCallParser` as on chat) and, streamed, OpenAI's events in
OpenAI's order, each numbered by `sequence_number`. No jax and no aiohttp here.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import re
import time
import uuid
from typing import Any, Callable

from jaxserve.core.outputs import RequestOutput
from jaxserve.core.request import SamplingParams, is_valid_unicode
from serve.protocol import (UNSUPPORTED_CHAT_FIELDS, GenerationRequest, ProtocolError, check_field_support,
                            is_empty, is_false, only_null, parse_chat_request, printable)
from serve.shaping import ChoiceState, total_usage
from serve.tool_parsers import ToolCallParser, vllm_call_id

MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits
_FORMAT_NAME = re.compile(r"[A-Za-z0-9_\-]{1,64}")
_CHAT_TOOL_FIELD = re.compile(r"^(tools\[\d+\])\.function\.")
_CHAT_NAME_IN_MESSAGE = re.compile(r"'([^'\s]+)'|\b(max_tokens|response_format(?:\.json_schema\.schema)?)\b")
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")
_IMAGE_PART = "input_image"  # {"type": "input_image", "image_url": <url>}: given to chat as it is
_KEEP_WHOLE_CONVERSATION = "this server keeps no responses (it is stateless): send the whole conversation in 'input'"


def _all_null(value: Any) -> bool:
    return isinstance(value, dict) and all(v is None for v in value.values())


# Fields that need stored responses, refused with the reason (null, and `store`/`background` false, pass).
_STATEFUL_FIELDS = {
    "store": (is_false, "'store': true is not supported: " + _KEEP_WHOLE_CONVERSATION + " and send 'store' false "
              "or leave it out"),
    "previous_response_id": (only_null, "'previous_response_id' is not supported: " + _KEEP_WHOLE_CONVERSATION),
    "conversation": (only_null, "'conversation' is not supported: " + _KEEP_WHOLE_CONVERSATION),
    "background": (is_false, "'background' is not supported: it needs stored responses, and this server keeps none"),
    "prompt": (only_null, "'prompt' (a stored prompt template) is not supported: send the text in 'input'"),
}
# Responses fields (OpenAI's, vLLM's) jaxserve does not implement, each with the test of its neutral
# value (null always is): anything else is a 400 naming the field, as on chat.
UNSUPPORTED_RESPONSES_FIELDS = {
    **{name: test for name, (test, _) in _STATEFUL_FIELDS.items()},
    "include": is_empty, "max_tool_calls": only_null, "truncation": lambda v: v == "disabled",
    "reasoning": _all_null, "top_logprobs": lambda v: v == 0 and v is not False, "context_management": is_empty,
    "stream_options": lambda v: v in ({}, {"include_obfuscation": False}),
    "prompt_cache_retention": lambda v: v == "in_memory", "prompt_cache_options": only_null,
    "moderation": only_null, "image": only_null, "access_programs": only_null, "background_options": only_null,
    "media_io_kwargs": is_empty, "enable_response_messages": is_false, "previous_input_messages": only_null,
    **{name: UNSUPPORTED_CHAT_FIELDS[name] for name in (
        "service_tier", "priority", "cache_salt", "kv_transfer_params", "mm_processor_kwargs", "vllm_xargs",
        "request_id")},
}
# Fields passed to the chat parser as they are: OpenAI's, and vLLM's extensions of the Responses API.
_CHAT_FIELDS = ("model", "stream", "temperature", "top_p", "parallel_tool_calls", "user", "metadata",
                "prompt_cache_key", "safety_identifier", "top_k", "repetition_penalty", "seed", "stop", "ignore_eos",
                "logit_bias", "skip_special_tokens", "include_stop_str_in_output", "structured_outputs",
                "chat_template_kwargs")
_SERVED_RESPONSES_FIELDS = set(_CHAT_FIELDS) | {"input", "instructions", "max_output_tokens", "tools", "tool_choice",
                                                "text"}
# Function tool fields OpenAI defines that change how a call is made or answered: not implemented.
_UNSUPPORTED_TOOL_FIELDS = ("defer_loading", "allowed_callers", "async", "output_schema", "namespace")



def responses_call_ids(server_ids: Callable[[], str]) -> Callable[[], str]:
    """The call ids of a Responses output: OpenAI's `call_...` form, unless the server's tool-call
    format needs its own (Mistral's 9 characters, which its template checks in the history)."""
    return (lambda: f"call_{uuid.uuid4().hex}") if server_ids is vllm_call_id else server_ids

@dataclasses.dataclass
class ResponsesRequest(GenerationRequest):
    """A validated /v1/responses request: the chat request it runs as, and the fields of the
    request that the Response object repeats (`instructions`, `tools`, `text`, `metadata`, ...)."""

    response_fields: dict[str, Any] = dataclasses.field(default_factory=dict)


def parse_responses_request(body: Any, served_models: str | tuple[str, ...]) -> ResponsesRequest:
    """Validates a /v1/responses body into the chat request it stands for."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    for name, (is_neutral, message) in _STATEFUL_FIELDS.items():
        if body.get(name) is not None and not is_neutral(body[name]):
            raise ProtocolError(message, param=name, code="unsupported_field")
    check_field_support(body, UNSUPPORTED_RESPONSES_FIELDS, _SERVED_RESPONSES_FIELDS)
    instructions = body.get("instructions")
    if instructions is not None:
        _checked_text(instructions, "instructions")
    _check_metadata(body.get("metadata"))
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        raise ProtocolError("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    response_format, text = _response_format(body.get("text"))
    chat_body = {name: body[name] for name in _CHAT_FIELDS if body.get(name) is not None}
    chat_body.update(messages=_input_messages(body.get("input"), instructions), tools=_chat_tools(body.get("tools")),
                     tool_choice=_chat_tool_choice(body.get("tool_choice")), response_format=response_format,
                     max_tokens=body.get("max_output_tokens"))
    try:
        chat = parse_chat_request({k: v for k, v in chat_body.items() if v is not None}, served_models)
    except ProtocolError as e:
        raise client_error(e) from None
    chat.max_tokens_param = "max_output_tokens"  # what the engine's admission refusals name
    if chat.structured_output is not None:
        chat.structured_output.param = responses_name(chat.structured_output.param)
    fields = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
              "metadata": body.get("metadata") or {},
              "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
              "text": text, "tool_choice": body.get("tool_choice") or "auto", "tools": _echoed_tools(body.get("tools")),
              "user": body.get("user"), "prompt_cache_key": body.get("prompt_cache_key"),
              "safety_identifier": body.get("safety_identifier")}
    return ResponsesRequest(**{f.name: getattr(chat, f.name) for f in dataclasses.fields(chat)},
                            response_fields=fields)


def responses_name(name: str | None) -> str | None:
    """The Responses field for a chat field the chat parser or the engine named."""
    if name is None:
        return None
    if name.startswith("messages"):
        return "input"
    if name.startswith("response_format"):
        return "text.format.schema" if name.endswith(".schema") else "text.format"
    if name == "max_tokens":
        return "max_output_tokens"
    return _CHAT_TOOL_FIELD.sub(r"\1.", name)


def client_error(error: ProtocolError) -> ProtocolError:
    """`error` naming the client's Responses fields: its `param`, and in its message the quoted
    names and the bare chat names of the length and format fields."""
    error.param = responses_name(error.param)
    error.message = _CHAT_NAME_IN_MESSAGE.sub(
        lambda m: f"'{responses_name(m.group(1))}'" if m.group(1) else responses_name(m.group(2)), error.message)
    return error


def not_stored_error(response_id: str) -> ProtocolError:
    """The answer to fetching, deleting or cancelling a response by id: none is ever stored."""
    return ProtocolError(f"Response with id '{printable(response_id)}' not found: {_KEEP_WHOLE_CONVERSATION}",
                         status=404, code="not_found")


# ---- request parts ------------------------------------------------------------------------------

def _checked_text(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise ProtocolError(f"'{param}' must be a string", param=param)
    if not is_valid_unicode(value):
        raise ProtocolError(f"'{param}' is not valid Unicode: it holds a lone surrogate (e.g. \\ud800)", param=param)
    return value


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise ProtocolError(f"'metadata' must be an object of at most {MAX_METADATA_PAIRS} pairs", param="metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS or not isinstance(value, str) or len(value) > MAX_METADATA_VALUE_CHARS:
            raise ProtocolError(f"'metadata' keys must be at most {MAX_METADATA_KEY_CHARS} characters and its values "
                                f"strings of at most {MAX_METADATA_VALUE_CHARS}", param="metadata")


def _input_messages(value: Any, instructions: str | None) -> list[dict[str, Any]]:
    """`instructions` (a system message) and `input` as chat messages: messages keep their role,
    function calls join the assistant turn before them (or start one), and their outputs are
    tool messages answering them by call id."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions is not None else []
    if value is None:
        raise ProtocolError("'input' is required", param="input")
    if isinstance(value, str):
        return messages + [{"role": "user", "content": _checked_text(value, "input")}]
    if not isinstance(value, list) or not value:
        raise ProtocolError("'input' must be a string or a non-empty list of input items", param="input")
    call_names: dict[str, str] = {}  # call id -> function name, of the calls so far
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise ProtocolError(f"'{param}' must be an object", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, param))
        elif kind == "function_call":
            _add_function_call(messages, item, param, call_names)
        elif kind == "function_call_output":
            messages.append(_function_call_output(item, param, call_names))
        elif kind == "item_reference":
            raise ProtocolError(f"'{param}': item references are not supported: {_KEEP_WHOLE_CONVERSATION}",
                                param=f"{param}.type", code="unsupported_field")
        else:
            raise ProtocolError(f"'{param}.type' {printable(str(kind), 40)!r} is not supported: input items are "
                                "messages, function_call and function_call_output", param=f"{param}.type",
                                code="unsupported_field")
    return messages


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise ProtocolError(f"'{param}.role' must be one of {', '.join(_ROLES)}; got {role!r}", param=f"{param}.role")
    return {"role": role, "content": _content_text(item.get("content"), f"{param}.content", images=True)}


def _content_text(content: Any, param: str, images: bool = False) -> str | list[dict[str, Any]]:
    """A string, or the text of a list of input_text / output_text parts; with `images` (a
    message's content), input_image parts too: then chat's parts (text and image), for the chat
    parser to check (images in user messages only)."""
    if isinstance(content, str):
        return _checked_text(content, param)
    if not isinstance(content, list):
        raise ProtocolError(f"'{param}' must be a string or a list of input_text parts", param=param)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if images and kind == _IMAGE_PART:
            parts.append(part)
        elif kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": _checked_text(part.get("text"), f"{param}[{j}].text")})
        else:
            kinds = "input_text or input_image" if images else "input_text"
            raise ProtocolError(f"'{param}[{j}]' must be an {kinds} part: files and audio are not supported",
                                param=f"{param}[{j}]")
    if any(part["type"] == _IMAGE_PART for part in parts):
        return parts
    return "".join(part["text"] for part in parts)


def _add_function_call(messages: list[dict[str, Any]], item: dict[str, Any], param: str,
                       call_names: dict[str, str]) -> None:
    for name in ("call_id", "name", "arguments"):
        _checked_text(item.get(name), f"{param}.{name}")
    call = {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}
    if messages and messages[-1]["role"] == "assistant":  # the turn's text, or its earlier calls
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    call_names[item["call_id"]] = item["name"]


def _function_call_output(item: dict[str, Any], param: str, call_names: dict[str, str]) -> dict[str, Any]:
    call_id = _checked_text(item.get("call_id"), f"{param}.call_id")
    if call_id not in call_names:
        raise ProtocolError(f"'{param}.call_id' {printable(call_id, 64)!r} answers no function_call before it in "
                            f"'input' ({_KEEP_WHOLE_CONVERSATION})", param=f"{param}.call_id")
    return {"role": "tool", "tool_call_id": call_id, "name": call_names[call_id],
            "content": _content_text(item.get("output"), f"{param}.output")}


def _chat_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's `{"type": "function", "function": {...}}` (the
    chat parser checks names, parameters and descriptions)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ProtocolError("'tools' must be a list of function tools", param="tools")
    chat_tools = []
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise ProtocolError(f"'{param}' must be a function tool {{'type': 'function', 'name', 'parameters'}}; "
                                f"hosted tools ({printable(str(kind), 40)!r}) are not supported", param=param)
        for name in _UNSUPPORTED_TOOL_FIELDS:
            if tool.get(name) not in (None, False):
                raise ProtocolError(f"'{param}.{name}' is not supported by this server", param=f"{param}.{name}",
                                    code="unsupported_field")
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise ProtocolError(f"'{param}.strict' must be a boolean", param=f"{param}.strict")
        chat_tools.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}})
    return chat_tools


def _echoed_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    return [{"type": "function", "name": t["name"], "description": t.get("description"),
             "parameters": t.get("parameters"), "strict": t.get("strict")} for t in tools or []]


def _chat_tool_choice(value: Any) -> Any:
    """Responses' `{"type": "function", "name"}` as chat's named choice; strings as they are."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise ProtocolError("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...} "
                        "(allowed_tools and hosted tools are not supported)", param="tool_choice")


def _response_format(text: Any) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """`text` -> (chat's `response_format`, or None for plain text; the `text` the Response shows)."""
    plain = {"format": {"type": "text"}}
    if text is None:
        return None, plain
    if not isinstance(text, dict):
        raise ProtocolError("'text' must be an object", param="text")
    if text.get("verbosity") is not None:
        raise ProtocolError("'text.verbosity' is not supported by this server", param="text.verbosity",
                            code="unsupported_field")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None, plain
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise ProtocolError("'text.format' must be {'type': 'text' | 'json_object' | 'json_schema'}",
                            param="text.format")
    if fmt["type"] == "json_object":
        return {"type": "json_object"}, {"format": {"type": "json_object"}}
    name, schema = fmt.get("name"), fmt.get("schema")
    if not isinstance(name, str) or not _FORMAT_NAME.fullmatch(name):
        raise ProtocolError("'text.format.name' must be 1 to 64 letters, digits, '_' or '-'", param="text.format.name")
    if not isinstance(schema, dict):
        raise ProtocolError("'text.format.schema' must be a JSON schema object", param="text.format.schema")
    for key, kind in (("strict", bool), ("description", str)):
        if fmt.get(key) is not None and not isinstance(fmt[key], kind):
            raise ProtocolError(f"'text.format.{key}' must be a {kind.__name__}", param=f"text.format.{key}")
    shown = {"type": "json_schema", "name": name, "schema": schema, "strict": fmt.get("strict"),
             "description": fmt.get("description")}
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}, {"format": shown}


# ---- responses ----------------------------------------------------------------------------------

def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def sse_events(events: list[dict[str, Any]]) -> bytes:
    """Server-sent events as OpenAI sends them: the event's type, then its JSON."""
    return b"".join(f"event: {event['type']}\ndata: ".encode() +
                    json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n" for event in events)


def responses_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage object (`serve.shaping.usage`) with the Responses API's names."""
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(text: str | None, status: str) -> dict[str, Any]:
    return {"id": new_item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [] if text is None else [_text_part(text)]}


def _call_item(call: dict[str, Any], status: str) -> dict[str, Any]:
    """A chat tool call (`serve.structured.tool_call`) as a function_call output item."""
    return {"id": new_item_id("fc"), "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"].get("arguments") or "", "status": status}


def _status(finish_reason: str | None) -> str:
    """A finished generation's Response status ("length": cut by max_output_tokens or the context)."""
    return "incomplete" if finish_reason == "length" else "completed"


class ResponsesShaper:
    """Builds the Response of one request and, when it streams, its events.

    Streamed, `opening_events()` come first, then `output_events(delta)` for each engine delta:
    an output item is added when its first text or call arrives and done when the next one starts
    or the generation ends, which also brings `response.completed` (`response.incomplete` when
    cut by max_output_tokens) or, when it fails, `response.failed`.
    """

    def __init__(self, request: ResponsesRequest, params: SamplingParams,
                 tool_parser: Callable[[], ToolCallParser | None]) -> None:
        """`params`: the request's sampling parameters (the Response shows its temperature and
        top_p); `tool_parser()`: a fresh parser of the output's tool calls (None: plain text)."""
        self.response_id = new_item_id("resp")
        self.created_at = int(time.time())
        self.model = request.model
        self.fields = {**request.response_fields, "temperature": params.temperature, "top_p": params.top_p,
                       "store": False, "background": False, "previous_response_id": None, "max_tool_calls": None,
                       "reasoning": {"effort": None, "summary": None}, "service_tier": "default", "top_logprobs": 0,
                       "truncation": "disabled"}
        self.tool_parser = tool_parser
        self.finished = False  # streaming: the closing event was built
        self._stream_parser = tool_parser()
        self._choice = ChoiceState()
        self._sequence_number = 0
        self._items: list[dict[str, Any]] = []  # the output items streamed so far
        self._open: dict[str, Any] | None = None  # the last of them while it still gets deltas
        self._open_text: list[str] = []  # the open message's text deltas
        self._calls: dict[int, int] = {}  # the chat tool-call index -> its output index

    def _response(self, status: str, output: list[dict[str, Any]], *, usage: dict[str, Any] | None = None,
                  error: dict[str, Any] | None = None) -> dict[str, Any]:
        incomplete_details = {"reason": "max_output_tokens"} if status == "incomplete" else None
        response = {"id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
                    "error": error, "incomplete_details": incomplete_details, "model": self.model, "output": output,
                    "usage": usage, **self.fields}
        if status in ("completed", "incomplete"):
            response["completed_at"] = int(time.time())
        return response

    def full_response(self, choices: list[ChoiceState], usage: dict[str, Any]) -> dict[str, Any]:
        """The Response of a finished generation (one choice; `usage` is chat's usage object)."""
        choice = choices[0]
        parser = self.tool_parser()
        content, calls, finish_reason = (parser.parse(choice.text, choice.finish_reason) if parser is not None
                                         else (choice.text, [], choice.finish_reason))
        output = [_message_item(content, "completed")] if content is not None and (content or not calls) else []
        output += [_call_item(call, "completed") for call in calls]
        status = _status(finish_reason)
        if status == "incomplete" and output:
            output[-1]["status"] = "incomplete"
        return self._response(status, output, usage=responses_usage(usage))

    # -- streaming --

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, **copy.deepcopy(fields), "sequence_number": self._sequence_number}
        self._sequence_number += 1
        return event

    def opening_events(self) -> list[dict[str, Any]]:
        return [self._event(kind, response=self._response("in_progress", []))
                for kind in ("response.created", "response.in_progress")]

    def output_events(self, output: RequestOutput) -> list[dict[str, Any]]:
        """The events of one engine delta; with the last, the closing ones."""
        self._choice.add(output)
        if output.finished and output.finish_reason == "error" and output.error_param is not None:
            return self.failure_events(output.error or "invalid request", code="invalid_prompt",
                                       param=responses_name(output.error_param))
        if output.finished and output.finish_reason in ("error", "abort"):
            return self.failure_events(f"generation ended: {output.error or output.finish_reason}")
        finish_reason = output.finish_reason if output.finished else None
        if self._stream_parser is None:
            delta = {"content": output.new_text}
        else:
            delta, finish_reason = self._stream_parser.stream(output.new_text, output.finished, finish_reason)
        events = self._text_events(delta["content"]) if delta.get("content") else []
        for call in delta.get("tool_calls") or []:
            events += self._call_events(call)
        if output.finished:
            events += self._closing_events(finish_reason)
        return events

    def failure_events(self, message: str, *, code: str = "server_error", param: str | None = None) -> list[dict]:
        """`response.failed`, with what was streamed before the failure."""
        self.finished = True
        if self._open is not None and self._open["type"] == "message":  # its text so far
            self._open["content"] = [_text_part("".join(self._open_text))]
        error = {"code": code, "message": message, "param": param}
        return [self._event("response.failed", response=self._response("failed", self._items, error=error,
                                                                        usage=self._usage()))]

    def _usage(self) -> dict[str, Any]:
        return responses_usage(total_usage([self._choice]))

    def _add_item(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close_open("completed")
        self._items.append(item)
        self._open = item
        return events + [self._event("response.output_item.added", output_index=len(self._items) - 1, item=item)]

    def _open_message(self) -> list[dict[str, Any]]:
        item = _message_item(None, "in_progress")
        self._open_text = []
        return self._add_item(item) + [self._event("response.content_part.added", item_id=item["id"],
                                                   output_index=len(self._items) - 1, content_index=0,
                                                   part=_text_part(""))]

    def _text_events(self, text: str) -> list[dict[str, Any]]:
        events = self._open_message() if self._open is None or self._open["type"] != "message" else []
        self._open_text.append(text)
        return events + [self._event("response.output_text.delta", item_id=self._open["id"],
                                     output_index=len(self._items) - 1, content_index=0, delta=text, logprobs=[])]

    def _call_events(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat tool-call delta: a new call (it has an id) is a new item; arguments are its deltas."""
        events = []
        if "id" in call:
            events += self._add_item(_call_item({**call, "function": {**call["function"], "arguments": ""}},
                                                "in_progress"))
            self._calls[call["index"]] = len(self._items) - 1
        output_index = self._calls[call["index"]]
        item = self._items[output_index]
        arguments = call["function"].get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=output_index, delta=arguments))
        return events

    def _close_open(self, status: str) -> list[dict[str, Any]]:
        """The done events of the open item (the last one), now `status`."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        index = len(self._items) - 1
        if item["type"] == "message":
            text = "".join(self._open_text)
            item["content"] = [_text_part(text)]
            events = [self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=text, logprobs=[]),
                      self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=item["content"][0])]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"])]
        return events + [self._event("response.output_item.done", output_index=index, item=item)]

    def _closing_events(self, finish_reason: str | None) -> list[dict[str, Any]]:
        status = _status(finish_reason)
        events = self._open_message() if not self._items else []  # no output at all: an empty message
        events += self._close_open(status)
        self.finished = True
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self._event(kind, response=self._response(status, self._items, usage=self._usage()))]
