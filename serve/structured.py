"""Structured output and tool calling, the protocol side (no jax).

Requests: OpenAI's `response_format` (`json_object`, `json_schema`) and vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (or `structured_outputs` with the same keys)
become one `StructuredOutputParams` (`parse_structured_output`); chat's `tools` and `tool_choice`
become a `ToolsRequest` (`parse_tools`). "required" and a named function are enforced by a JSON
schema grammar (`ToolsRequest.grammar`); "auto" lets the model choose and parses its tool-call
format where the chat template defines one (Hermes: `<tool_call>{"name": ..., "arguments": ...}
</tool_call>`, as Qwen's templates); "none" leaves the tools out of the prompt.

Responses: `ToolCallParser` turns a choice's text into (content, tool_calls), whole or as a stream
of deltas (content streams until a tool call starts; a named function's arguments stream as they
come; other tool calls are sent complete when the choice ends).
"""
from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any

from jaxserve.structured_output import StructuredOutputParams

MAX_TOOLS = 128
MAX_ARGUMENT_DEPTH = 64  # nesting of a tool call's arguments given back in messages (templates recurse)
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
# vLLM's guided_* fields and the keys of its structured_outputs object, with the kind each names.
_GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
_STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                            "json_object": "json_object"}
# structured_outputs options that change nothing here: one grammar library, JSON without free whitespace.
_STRUCTURED_OUTPUTS_NO_OPS = {"disable_fallback", "disable_any_whitespace", "backend"}


class StructuredRequestError(ValueError):
    """A structured output or tools field that cannot be served; `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def parse_structured_output(body: dict[str, Any]) -> StructuredOutputParams | None:
    """The one output constraint a body asks for, or None. Only the shape is read here; the
    engine compiles it at admission (a bad schema, regex or grammar is a 400 naming its field)."""
    found: list[StructuredOutputParams] = []
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict) or response_format.get("type") not in (
                "text", "json_object", "json_schema"):
            raise StructuredRequestError("'response_format' must be {'type': 'text' | 'json_object' | 'json_schema'}",
                                         "response_format")
        kind = response_format["type"]
        if kind == "json_object":
            found.append(StructuredOutputParams("json_object", None, "response_format"))
        elif kind == "json_schema":
            json_schema = response_format.get("json_schema")
            if not isinstance(json_schema, dict) or "schema" not in json_schema:
                raise StructuredRequestError("'response_format.json_schema' must be an object with a 'schema'",
                                             "response_format.json_schema")
            found.append(StructuredOutputParams("json_schema", json_schema["schema"],
                                                "response_format.json_schema.schema"))
    for name, kind in _GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append(StructuredOutputParams(kind, body[name], name))
    structured = body.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise StructuredRequestError("'structured_outputs' must be an object", "structured_outputs")
        for key, value in structured.items():
            if key in _STRUCTURED_OUTPUTS_NO_OPS:
                continue
            if key not in _STRUCTURED_OUTPUTS_KEYS and value not in (None, False):
                raise StructuredRequestError(f"'structured_outputs.{key}' is not supported by this server",
                                             f"structured_outputs.{key}")
            if key in _STRUCTURED_OUTPUTS_KEYS and value not in (None, False):
                kind = _STRUCTURED_OUTPUTS_KEYS[key]
                found.append(StructuredOutputParams(kind, None if kind == "json_object" else value,
                                                    f"structured_outputs.{key}"))
    if body.get("guided_whitespace_pattern") is not None:
        raise StructuredRequestError("'guided_whitespace_pattern' is not supported by this server (JSON is written "
                                     "as json.dumps does: ', ' and ': ')", "guided_whitespace_pattern")
    if len(found) > 1:
        raise StructuredRequestError(f"give at most one output constraint, got {', '.join(f.param for f in found)}",
                                     found[1].param)
    return found[0] if found else None


# ---- tools --------------------------------------------------------------------------------------

@dataclasses.dataclass
class ToolsRequest:
    """A chat request's tools: `tools` as the client sent them (for the chat template), each
    function's parameters schema, and `choice`: "none", "auto", "required" or "named" (`name`)."""
    tools: list[dict[str, Any]]
    parameters: dict[str, Any]  # function name -> its JSON schema ({"type": "object"} when absent)
    choice: str
    name: str | None = None
    parallel: bool = True  # parallel_tool_calls: "required" may produce several calls

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template gets: the tools, unless the model may not call any."""
        return None if self.choice == "none" else self.tools

    def grammar(self) -> StructuredOutputParams | None:
        """The constraint that enforces "required" (a JSON array of calls, each {"name", "arguments"}
        matching its function) or a named function (its arguments); None otherwise."""
        if self.choice == "named":
            return StructuredOutputParams("json_schema", self.parameters[self.name], "tools")
        if self.choice != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, schema in self.parameters.items()]
        schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputParams("json_schema", schema, "tools")


def parse_tools(body: dict[str, Any]) -> ToolsRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat body (None without tools)."""
    tools, tool_choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise StructuredRequestError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise StructuredRequestError(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    parameters: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise StructuredRequestError(f"'{param}' must be {{'type': 'function', 'function': {{...}}}}", param)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise StructuredRequestError(f"'{param}.function.name' must be 1 to 64 letters, digits, '_', '.' or '-'",
                                         f"{param}.function.name")
        if name in parameters:
            raise StructuredRequestError(f"two tools are named {name!r}", f"{param}.function.name")
        schema = function.get("parameters")
        if schema is None:
            schema = {"type": "object", "properties": {}}
        if not isinstance(schema, dict):
            raise StructuredRequestError(f"'{param}.function.parameters' must be a JSON schema object",
                                         f"{param}.function.parameters")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise StructuredRequestError(f"'{param}.function.description' must be a string",
                                         f"{param}.function.description")
        parameters[name] = schema
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise StructuredRequestError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tool_choice is None:
        tool_choice = "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise StructuredRequestError("'tool_choice' must be 'none', 'auto', 'required' or a named function",
                                         "tool_choice")
        return ToolsRequest(tools, parameters, tool_choice, parallel=parallel is not False)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise StructuredRequestError("'tool_choice' must be 'none', 'auto', 'required' or "
                                     "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if not isinstance(name, str) or name not in parameters:
        raise StructuredRequestError(f"'tool_choice' names a function that is not in 'tools': {str(name)[:64]!r}",
                                     "tool_choice")
    return ToolsRequest(tools, parameters, "named", name, parallel=parallel is not False)


def parse_tool_call_message(message: dict[str, Any], param: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` for the chat template: arguments given as JSON text
    become objects (what templates expect), others are passed as they are."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list):
        raise StructuredRequestError(f"'{param}.tool_calls' must be a list", f"{param}.tool_calls")
    parsed = []
    for j, call in enumerate(calls):
        where = f"{param}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise StructuredRequestError(f"'{where}' must be {{'id', 'type': 'function', 'function': "
                                         "{'name', 'arguments'}}", where)
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
                arguments = decoded if isinstance(decoded, dict) else arguments
            except (ValueError, RecursionError):  # not JSON (or nested past Python's limit): kept as text
                pass
        elif not isinstance(arguments, dict):
            raise StructuredRequestError(f"'{where}.function.arguments' must be a JSON string", where)
        if isinstance(arguments, dict) and _depth(arguments) > MAX_ARGUMENT_DEPTH:
            raise StructuredRequestError(f"'{where}.function.arguments' is nested deeper than {MAX_ARGUMENT_DEPTH} "
                                         "levels", f"{where}.function.arguments")
        parsed.append({"id": str(call.get("id", "")), "type": "function",
                       "function": {"name": function["name"], "arguments": arguments}})
    return parsed


def _depth(value: Any, limit: int = 1000) -> int:
    """How deeply lists and dicts nest in `value` (iteratively: no recursion limit to meet)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    call = {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index, **call}


def _call_from_json(value: Any) -> dict[str, Any] | None:
    """{"name": str, "arguments": object} (Hermes calls "parameters" too) -> a tool call, else None."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return tool_call(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                                            ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes-style output -> (content before the first call or None, tool calls). Text with a
    call that is not valid JSON is all content (no calls), as vLLM's parser does."""
    if HERMES_START not in text:
        return text, []
    calls = []
    for match in _HERMES_CALL.finditer(text):
        try:
            call = _call_from_json(json.loads((match.group(1) or match.group(2) or "").strip()))
        except (ValueError, RecursionError):
            call = None
        if call is None:
            return text, []
        calls.append(call)
    content = text[:text.index(HERMES_START)]
    return (content if content.strip() else None), calls


class ToolCallParser:
    """The tool calls in one choice's output. `mode`: "named" (the text is the function's
    arguments), "required" (a JSON array of {"name", "arguments"}), "hermes" (auto, on a
    template with Hermes tool calls)."""

    def __init__(self, mode: str, name: str | None = None) -> None:
        self.mode = mode
        self.name = name
        self._text = ""
        self._sent = 0  # characters of the text already streamed as content (hermes) or arguments (named)
        self._call_id: str | None = None

    @classmethod
    def for_request(cls, tools: ToolsRequest | None, template_format: str | None) -> "ToolCallParser | None":
        if tools is None or tools.choice == "none":
            return None
        if tools.choice in ("named", "required"):
            return cls(tools.choice, tools.name)
        return cls("hermes") if template_format == "hermes" else None

    def parse(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict[str, Any]], str | None]:
        """The whole output -> (content, tool calls, finish_reason: "tool_calls" when there are
        calls and the output ended on its own)."""
        if self.mode == "named":  # the output is the call's arguments, complete or cut by max_tokens (as streamed)
            calls, content = [tool_call(self.name, text)], None
        elif self.mode == "required":
            try:
                calls = [c for c in (_call_from_json(v) for v in json.loads(text)) if c is not None]
            except (ValueError, TypeError, RecursionError):
                calls = []
            content = None if calls else text
        else:
            content, calls = parse_hermes(text)
        if calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return content, calls, finish_reason

    def stream(self, delta: str, finished: bool, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """One text delta -> (the chat delta to send: "content" and/or "tool_calls" keys, possibly
        empty; the finish reason to report)."""
        self._text += delta
        out: dict[str, Any] = {}
        if self.mode == "named":  # arguments stream as they come
            if self._call_id is None and (delta or finished):
                self._call_id = new_call_id()
                out["tool_calls"] = [{"index": 0, "id": self._call_id, "type": "function",
                                      "function": {"name": self.name, "arguments": delta}}]
            elif delta:
                out["tool_calls"] = [{"index": 0, "function": {"arguments": delta}}]
            return out, ("tool_calls" if finished and finish_reason == "stop" else finish_reason)
        if self.mode == "hermes":  # content until a tool call may be starting
            start = self._text.find(HERMES_START)
            safe = start if start >= 0 else len(self._text) - _partial_suffix(self._text, HERMES_START)
            if safe > self._sent:
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


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template writes the tools it is given into the prompt (a
    template that ignores them would answer tool_choice "auto" with an invented reply)."""
    messages = [{"role": "user", "content": "x"}]
    probe = [{"type": "function", "function": {"name": "jaxserve_probe_tool", "description": "d",
                                               "parameters": {"type": "object", "properties": {}}}}]
    try:
        plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        with_tools = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=probe)
    except Exception:  # no template, or one that fails on tools: it renders none
        return False
    return with_tools != plain


def template_tool_format(chat_template: Any) -> str | None:
    """The tool-call format a chat template defines: "hermes" when it writes <tool_call> tags."""
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""]
    return "hermes" if any(HERMES_START in str(t) for t in templates) else None
