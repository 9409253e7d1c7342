"""One chat choice's text -> the message fields a client gets (no jax): `reasoning` (with vLLM's
former name `reasoning_content` beside it), `content` and `tool_calls`, whole or streamed.

The reasoning parser (the server's `--reasoning_parser`) splits the output first; tools are parsed
from the content part only. `choice_output_factory` decides, per request, which of the two apply.
"""
from __future__ import annotations

from typing import Any, Callable

from serve.reasoning import ReasoningParser, ReasoningStream
from serve.tool_parsers import CallIds, ToolCallParser, ToolParser

REASONING_FIELDS = ("reasoning", "reasoning_content")  # vLLM's current name, and the one clients still read


class ChoiceOutput:
    """Parses one choice. `tools` parses the content part (None: plain content); `reasoning`
    splits off the reasoning first (None: none); `needs_end`: a grammar wrote the output (see
    serve/reasoning.py); `include_reasoning` false drops the reasoning (vLLM's field);
    `reasoning_fields` puts the reasoning keys, null when empty, in every whole message."""

    def __init__(self, tools: ToolCallParser | None, reasoning: ReasoningParser | None, *, needs_end: bool = False,
                 include_reasoning: bool = True, reasoning_fields: bool = False) -> None:
        self.tools = tools
        self.reasoning = reasoning
        self.needs_end = needs_end
        self.include_reasoning = include_reasoning
        self.reasoning_fields = reasoning_fields
        self._stream = ReasoningStream(needs_end) if reasoning is not None else None

    def _reasoning(self, reasoning: str | None) -> dict[str, Any]:
        value = reasoning if self.include_reasoning else None
        if value is None and not self.reasoning_fields:
            return {}
        return {name: value for name in REASONING_FIELDS}

    def parse(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole output -> (the message's content, tool_calls and reasoning fields, finish_reason)."""
        reasoning, content = (self.reasoning.split(text, self.needs_end) if self.reasoning is not None
                              else (None, text))
        message: dict[str, Any] = {"content": content}
        if self.tools is not None and content is not None:
            message["content"], calls, finish_reason = self.tools.parse(content, finish_reason)
            if calls:
                message["tool_calls"] = calls
        message.update(self._reasoning(reasoning))
        return message, finish_reason

    def stream(self, delta: str, finished: bool, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """One text delta -> (the chat delta: any of "reasoning", "content", "tool_calls"; the finish reason)."""
        reasoning, content = self._stream.feed(delta) if self._stream is not None else ("", delta)
        if finished and self._stream is not None:
            more_reasoning, more_content = self._stream.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        out = self._reasoning(reasoning) if reasoning else {}
        out = {k: v for k, v in out.items() if v}  # a delta names only what it carries
        if self.tools is not None:
            tool_delta, finish_reason = self.tools.stream(content, finished, finish_reason)
            out.update(tool_delta)
        elif content:
            out["content"] = content
        return out, finish_reason


def choice_output_factory(request: Any, *, tool_format: ToolParser | None, new_call_id: CallIds,
                          reasoning: ReasoningParser | None) -> Callable[[], ChoiceOutput | None]:
    """Per choice of a chat `request` (serve.protocol.GenerationRequest): its parser, or None when
    the text is plain content. Tools are parsed unless the request has none or chose "none"; the
    reasoning is split unless the parser does not apply to the request (thinking turned off) or a
    JSON grammar (a schema, json_object, tool_choice "required" or named) writes the whole output."""
    tools = request.tools
    tool_mode = None if ToolCallParser.for_request(tools, tool_format) is None else tools.choice
    structured = request.structured_output
    json_grammar = tool_mode in ("named", "required") or (structured is not None and structured.kind in (
        "json_schema", "json_object"))
    splits = reasoning is not None and not json_grammar and reasoning.applies(request.chat_template_kwargs or {})
    if tool_mode is None and reasoning is None:
        return lambda: None

    def make() -> ChoiceOutput:
        return ChoiceOutput(ToolCallParser.for_request(tools, tool_format, new_call_id),
                            reasoning if splits else None, needs_end=structured is not None,
                            include_reasoning=request.include_reasoning, reasoning_fields=reasoning is not None)

    return make
