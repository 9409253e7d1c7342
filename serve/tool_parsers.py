"""Tool calls in a chat choice's output (no jax): one parser per tool-call format, named as vLLM's
`--tool_call_parser` names them, and `ToolCallParser`, which applies a request's tool choice to one
choice's text, whole or as a stream of deltas.

Formats ("auto" tool choice: the model decides whether to call):
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, after optional
  content (Qwen 2.5 / 3, Hermes templates).
- `llama3_json`: the whole output is `{"name": ..., "parameters": {...}}` ("arguments" too), several
  separated by `;`, optionally after `<|python_tag|>` (Llama 3.1 / 3.2 / 3.3 templates).
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}` (Mistral v0.3's template),
  or `[TOOL_CALLS]name[ARGS]{...}` once per call (newer Mistral tokenizers), after optional content.
An output whose calls do not parse is all content, with no calls, as vLLM's parsers treat it.

Streaming: content is sent as it comes, up to where a call starts or may start (a parser's
`content_end`); the calls are sent whole when the choice ends. A named function's arguments
stream as they come (the grammar makes the whole output its arguments).

Tool-call ids are vLLM's: `chatcmpl-tool-<32 hex>`, or 9 letters and digits where the server
parses Mistral calls (Mistral's template refuses any other id when the history comes back).
"""
from __future__ import annotations

import json
import re
import secrets
import string
import uuid
from typing import Any, Callable

CallIds = Callable[[], str]
Call = tuple[str, str]  # (function name, arguments as JSON text)
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_ID_ALPHABET = string.ascii_letters + string.digits


def vllm_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def mistral_call_id() -> str:
    """9 letters and digits: the only id Mistral's chat template accepts back."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def call_from_json(value: Any, argument_keys: tuple[str, ...], optional: bool = True) -> Call | None:
    """{"name": str, <one of argument_keys>: object or JSON text} -> (name, arguments), else None.
    With `optional`, a call without arguments has "{}" (where markers say it is a call)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    for key in argument_keys:
        if key in value:
            return (value["name"], _arguments_text(value[key])) if isinstance(value[key], (dict, str)) else None
    return (value["name"], "{}") if optional else None


def _loads(text: str) -> Any:
    """JSON text -> value; None where it is not JSON (or nests past Python's recursion limit)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def _content_or_none(text: str) -> str | None:
    return text if text.strip() else None


class ToolParser:
    """One tool-call format. `parse` reads a whole output; `content_end` says how much of a
    partial one may already go out as content (nothing from where a call starts or may start)."""

    name = ""

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        """The output -> (content, or None when it is only whitespace before calls; the calls)."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        raise NotImplementedError


class _MarkedCallsParser(ToolParser):
    """A format whose calls start with a marker (Hermes' tag, Mistral's token), content before it."""

    marker = ""

    def content_end(self, text: str) -> int:
        start = text.find(self.marker)
        return start if start >= 0 else len(text) - partial_suffix(text, self.marker)

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        start = text.find(self.marker)
        if start < 0:
            return text, []
        calls = self.parse_calls(text[start:])
        if calls is None:
            return text, []
        return _content_or_none(text[:start]), calls

    def parse_calls(self, text: str) -> list[Call] | None:
        """The calls of `text` (which starts with the marker), or None where one does not parse."""
        raise NotImplementedError


class HermesToolParser(_MarkedCallsParser):
    """`<tool_call>{json}</tool_call>`, repeated; an unclosed last call runs to the end."""

    name = "hermes"
    marker = "<tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def parse_calls(self, text: str) -> list[Call] | None:
        calls = []
        for match in self._CALL.finditer(text):
            call = call_from_json(_loads((match.group(1) or match.group(2) or "").strip()), ("arguments", "parameters"))
            if call is None:
                return None
            calls.append(call)
        return calls


class MistralToolParser(_MarkedCallsParser):
    """`[TOOL_CALLS][{"name", "arguments"}, ...]` or `[TOOL_CALLS]name[ARGS]{...}` per call."""

    name = "mistral"
    marker = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def parse_calls(self, text: str) -> list[Call] | None:
        calls: list[Call] = []
        for segment in text.split(self.marker)[1:]:
            if self.ARGS in segment:
                name, _, arguments = segment.partition(self.ARGS)
                decoded = _loads(arguments.strip())
                if not _TOOL_NAME.fullmatch(name.strip()) or not isinstance(decoded, dict):
                    return None
                calls.append((name.strip(), _arguments_text(decoded)))
                continue
            decoded = _loads(segment.strip())
            items = decoded if isinstance(decoded, list) else [decoded]
            parsed = [call_from_json(item, ("arguments",)) for item in items]
            if not parsed or None in parsed:
                return None
            calls += parsed
        return calls


class Llama3JsonToolParser(ToolParser):
    """The whole output is one or more `{"name", "parameters"}` objects separated by `;`, maybe
    after `<|python_tag|>` (kept in the text only when special tokens are not skipped)."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"
    _DECODER = json.JSONDecoder()

    def _body(self, text: str) -> str:
        body = text.lstrip()
        return body[len(self.PYTHON_TAG):].lstrip() if body.startswith(self.PYTHON_TAG) else body

    def content_end(self, text: str) -> int:
        body = text.lstrip()
        if not body or self.PYTHON_TAG.startswith(body) or body.startswith((self.PYTHON_TAG, "{")):
            return 0  # may be a call: it decides when the choice ends
        return len(text)

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        body = self._body(text).rstrip()
        if not body.startswith("{"):
            return text, []
        calls, position = [], 0
        while True:
            try:
                value, end = self._DECODER.raw_decode(body, position)
            except (ValueError, RecursionError):
                return text, []
            call = call_from_json(value, ("parameters", "arguments"), optional=False)
            if call is None:
                return text, []
            calls.append(call)
            rest = body[end:].lstrip()
            if rest and not rest.startswith(";"):
                return text, []
            rest = rest[1:].lstrip()
            if not rest:  # the end (a trailing ";" allowed)
                break
            position = len(body) - len(rest)
        return None, calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}
# What marks each format in a chat template that asks for it.
_TEMPLATE_MARKERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",),
                     "llama3_json": ("<|python_tag|>", '"parameters": dictionary of argument name')}


def detect_tool_format(chat_template: Any) -> str | None:
    """The tool-call format a chat template asks the model for (a TOOL_PARSERS name), or None."""
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""]
    text = "\n".join(str(t) for t in templates)
    for name, markers in _TEMPLATE_MARKERS.items():
        if any(marker in text for marker in markers):
            return name
    return None


class ToolCallParser:
    """The tool calls in one choice's output. `mode`: "named" (the text is the function's
    arguments), "required" (a JSON array of {"name", "arguments"}), "auto" (the calls of
    `format`'s syntax, if any). `new_id` makes each call's id."""

    def __init__(self, mode: str, name: str | None = None, format: ToolParser | None = None,
                 new_id: CallIds = vllm_call_id) -> None:
        self.mode = mode
        self.name = name
        self.format = format
        self.new_id = new_id
        self._text = ""
        self._sent = 0  # characters of the text already streamed as content (auto) or arguments (named)
        self._call_id: str | None = None

    @classmethod
    def for_request(cls, tools: Any, format: ToolParser | None,
                    new_id: CallIds = vllm_call_id) -> "ToolCallParser | None":
        """The parser of a request's `tools` (serve.structured.ToolsRequest) on a server whose
        "auto" parses `format`; None where the output is plain content (no tools, "none", or
        "auto" with no format)."""
        if tools is None or tools.choice == "none" or (tools.choice == "auto" and format is None):
            return None
        return cls(tools.choice, tools.name, format if tools.choice == "auto" else None, new_id)

    def _calls(self, calls: list[Call]) -> list[dict[str, Any]]:
        return [{"id": self.new_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
                for name, arguments in calls]

    def parse(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict[str, Any]], str | None]:
        """The whole output -> (content, tool calls, finish_reason: "tool_calls" when there are
        calls and the output ended on its own)."""
        if self.mode == "named":  # the output is the call's arguments, complete or cut by max_tokens (as streamed)
            content, calls = None, [(self.name, text)]
        elif self.mode == "required":
            decoded = _loads(text)
            calls = [c for c in (call_from_json(v, ("arguments",)) for v in decoded) if c is not None] \
                if isinstance(decoded, list) else []
            content = None if calls else text
        else:
            content, calls = self.format.parse(text)
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return content, self._calls(calls), finish_reason

    def stream(self, delta: str, finished: bool, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """One text delta -> (the chat delta to send: "content" and/or "tool_calls" keys, possibly
        empty; the finish reason to report)."""
        self._text += delta
        out: dict[str, Any] = {}
        if self.mode == "named":  # arguments stream as they come
            if self._call_id is None and (delta or finished):
                self._call_id = self.new_id()
                out["tool_calls"] = [{"index": 0, "id": self._call_id, "type": "function",
                                      "function": {"name": self.name, "arguments": delta}}]
            elif delta:
                out["tool_calls"] = [{"index": 0, "function": {"arguments": delta}}]
            return out, ("tool_calls" if finished and finish_reason == "stop" else finish_reason)
        if self.mode == "auto":  # content until a call may be starting (and not while it is only whitespace)
            safe = self.format.content_end(self._text)
            if safe > self._sent and (self._sent or self._text[:safe].strip()):
                out["content"] = self._text[self._sent:safe]
                self._sent = safe
        if not finished:
            return out, finish_reason
        content, calls, finish_reason = self.parse(self._text, finish_reason)
        if calls:
            out["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        elif content and len(content) > self._sent:  # no call after all: the rest is content
            out["content"] = out.get("content", "") + content[self._sent:]
        return out, finish_reason
