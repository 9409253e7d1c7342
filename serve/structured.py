"""Structured output and tool calling, the request side (no jax).

Requests: OpenAI's `response_format` (`json_object`, `json_schema`) and vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (or `structured_outputs` with the same keys)
become one `StructuredOutputParams` (`parse_structured_output`); chat's `tools` and `tool_choice`
become a `ToolsRequest` (`parse_tools`). "required" and a named function are enforced by a JSON
schema grammar (`ToolsRequest.grammar`); "auto" lets the model choose, and the server parses the
tool-call format of its chat template or of `--tool_call_parser` (`resolve_auto_tool_choice`;
the formats are serve/tool_parsers.py's); "none" leaves the tools out of the prompt.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from jaxserve.core.structured_output import StructuredOutputParams, reference_loop
from serve.tool_parsers import TOOL_PARSERS, detect_tool_format

MAX_TOOLS = 128
MAX_ARGUMENT_DEPTH = 64  # nesting of a tool call's arguments given back in messages (templates recurse)
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
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
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": _own_document(name, schema)},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, schema in self.parameters.items()]
        schema = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputParams("json_schema", schema, "tools")


def _own_document(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters schema as a document of its own inside the "required" grammar: its
    local references ("#", "#/$defs/...") keep meaning its parameters, not the wrapping array."""
    return schema if "$id" in schema else {"$id": f"urn:jaxserve:tool:{name}", **schema}


def _check_enforced_parameters(tools: ToolsRequest) -> None:
    """A tool a grammar enforces ("required": every tool; a named one) whose parameters describe no
    value (a schema that is only a reference to itself) is refused, naming it: no call could match."""
    for i, name in enumerate(tools.parameters):
        if tools.choice == "required" or name == tools.name:
            loop = reference_loop(tools.parameters[name])
            if loop is not None:
                param = f"tools[{i}].function.parameters"
                raise StructuredRequestError(f"'{param}' describes no value: {loop}", param)


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
        request = ToolsRequest(tools, parameters, tool_choice, parallel=parallel is not False)
        _check_enforced_parameters(request)
        return request
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function":
        raise StructuredRequestError("'tool_choice' must be 'none', 'auto', 'required' or "
                                     "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if not isinstance(name, str) or name not in parameters:
        raise StructuredRequestError(f"'tool_choice' names a function that is not in 'tools': {str(name)[:64]!r}",
                                     "tool_choice")
    request = ToolsRequest(tools, parameters, "named", name, parallel=parallel is not False)
    _check_enforced_parameters(request)
    return request


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
        if isinstance(arguments, dict) and nesting_depth(arguments) > MAX_ARGUMENT_DEPTH:
            raise StructuredRequestError(f"'{where}.function.arguments' is nested deeper than {MAX_ARGUMENT_DEPTH} "
                                         "levels", f"{where}.function.arguments")
        parsed.append({"id": str(call.get("id", "")), "type": "function",
                       "function": {"name": function["name"], "arguments": arguments}})
    return parsed


def nesting_depth(value: Any, limit: int = 1000) -> int:
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


class ToolConfigError(ValueError):
    """Tool flags the model's chat template cannot serve (a startup error)."""


@dataclasses.dataclass(frozen=True)
class AutoToolChoice:
    """What tool_choice "auto" does on this server: `format`, the tool-call format parsed from
    the output (None: plain content), or `refusal`, why it is a 400; `source` says where the
    format came from (for the startup log)."""
    format: str | None
    refusal: str | None = None
    source: str = ""


_NOT_RENDERED = ("tool_choice 'auto' (the default with 'tools') needs a chat template that shows the model its tools, "
                 "and this model's does not: the tools would be ignored. Use tool_choice 'required' or a named "
                 "function (enforced by a grammar), or 'none'")


def resolve_auto_tool_choice(tokenizer: Any, tool_call_parser: str | None = None,
                             enable_auto_tool_choice: bool | None = None) -> AutoToolChoice:
    """"auto" for the server's flags (vLLM's --tool_call_parser and --enable_auto_tool_choice).

    Neither flag: the format the chat template asks for, if any (a template that does not render
    tools refuses "auto"). `tool_call_parser` chooses the format; `enable_auto_tool_choice` true
    requires one (the flag's or the template's), false refuses "auto" as vLLM does without it.
    Raises ToolConfigError where a flag cannot work: a parser for a template that never shows the
    model its tools, or auto tool choice with no format to parse."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ToolConfigError(f"--tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {tool_call_parser!r}")
    renders = template_renders_tools(tokenizer)
    if tool_call_parser is not None and not renders:
        raise ToolConfigError(f"--tool_call_parser={tool_call_parser}: the model's chat template does not show the "
                              "model its tools, so it would never write such calls")
    detected = detect_tool_format(getattr(tokenizer, "chat_template", None))
    format, source = (tool_call_parser, "--tool_call_parser") if tool_call_parser else (detected, "the chat template")
    if enable_auto_tool_choice and not renders:
        raise ToolConfigError("--enable_auto_tool_choice: the model's chat template does not show the model its "
                              "tools, so it would never call one")
    if enable_auto_tool_choice and format is None:
        raise ToolConfigError("--enable_auto_tool_choice needs --tool_call_parser (" + ", ".join(TOOL_PARSERS) +
                              "): the model's chat template asks for no tool-call format jaxserve recognizes")
    if enable_auto_tool_choice is False:
        return AutoToolChoice(format, "tool_choice 'auto' is turned off on this server (--noenable_auto_tool_choice): "
                                      "use 'required', a named function or 'none'", source)
    return AutoToolChoice(format, None if renders else _NOT_RENDERED, source)
