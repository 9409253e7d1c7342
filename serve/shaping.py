"""The OpenAI protocol's responses: engine deltas -> completion / chat JSON objects and SSE chunks.

Plain dicts; `token_text(token_id) -> str` turns a token id into its text for logprobs. A chat
choice's reasoning and tool calls are parsed by its `serve.chat_output.ChoiceOutput`. No jax here.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable

from jaxserve.core.outputs import RequestOutput, TokenLogprob
from serve.chat_output import ChoiceOutput

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
        self.token_ids: list[int] = []
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
        self.token_ids.extend(output.new_token_ids)
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
                 continuous_usage: bool = False, want_token_ids: bool = False) -> None:
        """`prompts`: (text, token ids) of each prompt, choice i's being prompt i //
        `choices_per_prompt`; `echo` puts a completion's prompt (and its logprobs) before its
        text; `want_prompt_logprobs` adds vLLM's prompt_logprobs; `output_parser()` gives each chat
        choice its parser of reasoning and tool calls (serve/chat_output.py; None: plain content);
        `continuous_usage` puts each choice's usage so far in each of its chunks (vLLM's
        continuous_usage_stats); `want_token_ids` adds vLLM's return_token_ids fields: each
        choice's (or chunk's) generated `token_ids`, and the `prompt_token_ids` (a completion
        choice's; a chat response's own), in the first chunk when streaming."""
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
        self.want_token_ids = want_token_ids
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
        if self.want_token_ids:
            item["token_ids"] = list(choice.token_ids)
            if not self.is_chat:
                item["prompt_token_ids"] = list(prompt_ids)
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
        if self.want_token_ids and self.is_chat:  # vLLM: chat's prompt ids are the response's
            response["prompt_token_ids"] = list(self._prompt(0)[1])
        response["usage"] = usage if usage is not None else total_usage(choices)
        return response

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = self._envelope("chat.completion.chunk" if self.is_chat else "text_completion", [choice])
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def role_chunk(self, index: int) -> dict[str, Any]:
        """The first chat chunk of a choice: the assistant role and no content (with
        return_token_ids, the prompt's token ids)."""
        chunk = self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
        if self.want_token_ids:
            chunk["choices"][0]["token_ids"] = []
            chunk["prompt_token_ids"] = list(self._prompt(index)[1])
        return chunk

    def delta_chunk(self, index: int, output: RequestOutput) -> dict[str, Any]:
        first = index not in self._started
        chunk = self._delta_chunk(index, output)
        if self.want_token_ids:
            chunk["choices"][0]["token_ids"] = list(output.new_token_ids)
            if first and not self.is_chat:
                chunk["choices"][0]["prompt_token_ids"] = list(self._prompt(index)[1])
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
