"""OpenAI response shaping: engine deltas -> completion / chat JSON objects and SSE chunks.

Plain dicts, no jax. `token_text(token_id) -> str` turns a token id into its text for logprobs.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable

from jaxserve.outputs import RequestOutput, TokenLogprob

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
