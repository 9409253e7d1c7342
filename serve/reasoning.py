"""Reasoning in a chat choice's output (no jax): the `<think>...</think>` part that vLLM's
`--reasoning_parser` returns as `reasoning` apart from `content`, whole or as a stream.

Parsers (vLLM's names):
- `deepseek_r1`: text before `</think>` is reasoning, after it content. The opening `<think>` may
  be in the output or already in the prompt (the template opens it), so it is optional; an output
  with no `</think>` is all reasoning (thinking cut short by max_tokens).
- `qwen3`: the same, unless the request turned thinking off (`chat_template_kwargs:
  {"enable_thinking": false}`, which makes the template close an empty think block in the prompt):
  then the whole output is content.

A grammar covers the whole output (jaxserve does not exempt a reasoning part from it), so on a
constrained output (`needs_end`) text counts as reasoning only before a `</think>` the grammar
let through; without one the output is all content (and a stream holds it back until it knows).
"""
from __future__ import annotations

from typing import Any

from serve.tool_parsers import partial_suffix

START, END = "<think>", "</think>"


class ReasoningParser:
    """A `<think>...</think>` format; `applies` says whether a request's output has one."""

    name = ""

    def applies(self, chat_template_kwargs: dict[str, Any]) -> bool:
        return True

    def split(self, text: str, needs_end: bool = False) -> tuple[str | None, str | None]:
        """A whole output -> (reasoning, content), each None when empty."""
        body = text.lstrip()
        body = body[len(START):] if body.startswith(START) else text
        if END in body:
            reasoning, _, content = body.partition(END)
            return reasoning or None, content or None
        return (None, text or None) if needs_end else (body or None, None)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def applies(self, chat_template_kwargs: dict[str, Any]) -> bool:
        return chat_template_kwargs.get("enable_thinking", True) is not False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


class ReasoningStream:
    """Splits a stream of text deltas as `ReasoningParser.split` splits their whole: `feed` and
    `finish` give (reasoning delta, content delta). It holds back what may be the start of a tag
    (and, with `needs_end`, all reasoning until `</think>` shows there is some)."""

    def __init__(self, needs_end: bool = False) -> None:
        self.needs_end = needs_end
        self._text = ""  # everything fed
        self._pending = ""  # fed, not yet given out
        self._state = "start"  # "start": may still open with <think>; "reasoning"; "content"

    def feed(self, delta: str) -> tuple[str, str]:
        self._text += delta
        self._pending += delta
        if self._state == "start":
            head = self._pending.lstrip()
            if not head or (START.startswith(head) and head != START):
                return "", ""  # the output may still open with <think>
            if head.startswith(START):
                self._pending = head[len(START):]
            self._state = "reasoning"
        reasoning = ""
        if self._state == "reasoning":
            end = self._pending.find(END)
            if end >= 0:
                reasoning, self._pending = self._pending[:end], self._pending[end + len(END):]
                self._state = "content"
            elif self.needs_end:
                return "", ""
            else:
                keep = len(self._pending) - partial_suffix(self._pending, END)
                reasoning, self._pending = self._pending[:keep], self._pending[keep:]
        content = ""
        if self._state == "content":
            content, self._pending = self._pending, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held when the output ends."""
        pending, self._pending = self._pending, ""
        if self._state == "content":
            return "", pending
        if self.needs_end:  # no </think>: the grammar's output is all content
            return "", self._text
        return pending, ""
