"""The output side of the engine: core results -> the deltas callers stream (no jax).

The engine core (scheduling, the model step, stop tokens, length limits, recovery) reports what
happened to each request as a `CoreOutput`: the token it got, if any, and whether the core ended
it. The `OutputProcessor` turns that into a `RequestOutput`: incremental detokenization, stop
strings (the one way a request ends here, which the engine then applies to the scheduler) and
the shaping of the step's raw logprob rows into `TokenLogprob`s.

`IncrementalDetokenizer` turns one new token id at a time into a text delta. It decodes a short
window of recent tokens twice (with and without the new tokens) and emits the difference, holding
the text back while it ends with U+FFFD (a multi-byte character split across tokens).
`StopChecker` cuts the streamed text before the first stop string (after it, with
`include_stop_str_in_output`) and holds back any suffix that could still grow into one, releasing
it once it turns out not to match. As in vLLM, stop strings are looked for only once a request has
more than `min_tokens` output tokens (its stop tokens are masked in the sampler until then), and
a finished delta names what stopped it (`stop_reason`: the stop string, the stop token id, or None).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from jaxserve.core.outputs import RequestOutput, TokenLogprob
from jaxserve.core.request import SamplingParams


REPLACEMENT_CHAR = "\ufffd"
_NUM_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first output tokens (spacing, merges)


class IncrementalDetokenizer:
    """Detokenizes the output of one request token by token.

    `tokenizer` is anything with `decode(ids, skip_special_tokens=...)`: a Hugging Face
    tokenizer or a `tokenizers.Tokenizer`.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self._prefix_offset = max(len(self.token_ids) - _NUM_CONTEXT_TOKENS, 0)
        self._read_offset = len(self.token_ids)
        self.output_text = ""

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Appends one generated token; returns the text it completes ("" while held back)."""
        self.token_ids.append(int(token_id))
        prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """Returns the text still held back (possibly with U+FFFD) when the request ends."""
        if self._read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset:])
        delta = full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.output_text += delta
        return delta


def find_stop_string(text: str, stop: Sequence[str], search_from: int = 0) -> tuple[int, str] | None:
    """The earliest stop string occurring in `text` at or after `search_from`: (index, string)."""
    best: tuple[int, str] | None = None
    for stop_string in stop:
        index = text.find(stop_string, search_from)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop_string)
    return best


def partial_stop_suffix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop_string in stop:
        for length in range(min(len(stop_string) - 1, len(text)), longest, -1):
            if text.endswith(stop_string[:length]):
                longest = length
                break
    return longest


class StopChecker:
    """Streams text with stop strings cut out.

    Feed each text delta to `add`; it returns the text that is safe to emit now and whether a stop
    string matched (then the emitted text ends right before it and later deltas are ignored). At
    the end of a request without a stop match, `flush` releases the held-back tail.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""  # everything seen (up to the stop string once one matched)
        self.num_emitted_chars = 0
        self.matched_stop: str | None = None
        self._search_floor = 0  # stop strings start at or after this (text added with search=False is not searched)

    @property
    def stopped(self) -> bool:
        return self.matched_stop is not None

    @property
    def output_text(self) -> str:
        """The text so far, without the stop string and what followed it."""
        return self.text

    def add(self, delta: str, search: bool = True) -> tuple[str, bool]:
        """`search=False` (a request short of its min_tokens): the delta is emitted whole and never
        searched, later matches start after it."""
        if self.stopped:
            return "", True
        if not search:
            self.text += delta
            self._search_floor = len(self.text)
            return self._emit(len(self.text)), False
        search_from = max(self._search_floor, len(self.text) - self._max_stop_len + 1)
        self.text += delta
        match = find_stop_string(self.text, self.stop, search_from)
        if match is not None:
            index, self.matched_stop = match
            end = index + len(self.matched_stop) if self.include_stop_str_in_output else index
            self.text = self.text[:end]
            return self._emit(end), True
        safe_end = len(self.text) - partial_stop_suffix_len(self.text[self._search_floor:], self.stop)
        return self._emit(safe_end), False

    def flush(self) -> str:
        """Releases the held-back suffix (call when the request ends without a stop match)."""
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        if end <= self.num_emitted_chars:
            return ""
        out = self.text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return out


@dataclasses.dataclass(frozen=True)
class RowLogprobs:
    """The step's logprob outputs for one row (raw: before penalties and temperature)."""
    logprob: float  # of the sampled token
    top_ids: np.ndarray  # int32[max_logprobs], best first
    top_logprobs: np.ndarray  # float32[max_logprobs]


@dataclasses.dataclass(frozen=True)
class CoreOutput:
    """What the engine core reports for one request after a step, an abort or a failure."""
    request_id: str
    new_token_ids: tuple[int, ...]  # the token sampled this step; () when it ended without one
    finish_reason: str | None  # set when the core ended it: "length", "stop" (a stop token), "abort", "error"
    num_prompt_tokens: int
    num_output_tokens: int  # total so far
    num_cached_tokens: int = 0
    logprobs: RowLogprobs | None = None  # only for a request that asked for logprobs
    error: str | None = None  # message when finish_reason == "error"
    error_param: str | None = None  # the client's field that caused it (a 400, not a server error)
    prompt_logprobs: list[TokenLogprob] | None = None  # with the first token: the prompt's (tokens 2..)


class _RequestState:
    """Text state of one request: its detokenizer and stop strings."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.detokenizer = (IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
                            if tokenizer is not None else None)
        self.stop_checker = StopChecker(params.stop, params.include_stop_str_in_output)
        self.num_logprobs = params.logprobs
        self.params = params


class OutputProcessor:
    """Per-request detokenization, stop strings and logprob shaping.

    `add` a request when the engine admits it; `process` the core's outputs after each step. A
    request's state is dropped with its finished delta. Without a tokenizer the deltas carry
    token ids only (no text, no stop strings)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._states[request_id] = _RequestState(self.tokenizer, prompt_token_ids, params)

    def has(self, request_id: str) -> bool:
        return request_id in self._states

    def process(self, core_outputs: Sequence[CoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """The deltas of `core_outputs`, in order, and the ids of the requests a stop string ended
        (the engine finishes those in its scheduler)."""
        outputs, stopped = [], []
        for core in core_outputs:
            output, stop_string_matched = self._process(core)
            outputs.append(output)
            if stop_string_matched:
                stopped.append(core.request_id)
        return outputs, stopped

    def _process(self, core: CoreOutput) -> tuple[RequestOutput, bool]:
        state = self._states.get(core.request_id)
        text = ""
        stop_string_matched = False
        logprobs = None
        stop_reason = None
        if state is not None and core.new_token_ids:
            token_id = core.new_token_ids[-1]
            detokenizer, stop_checker, params = state.detokenizer, state.stop_checker, state.params
            search = core.num_output_tokens > params.min_tokens  # stop strings only past min_tokens (vLLM)
            # A stop token ("stop" from the core) is not text unless include_stop_str_in_output; it still
            # ends the request.
            if detokenizer is not None and (core.finish_reason != "stop" or params.include_stop_str_in_output):
                text, stop_string_matched = stop_checker.add(detokenizer.add(token_id), search)
            if core.finish_reason is not None and not stop_string_matched and detokenizer is not None:
                tail, stop_string_matched = stop_checker.add(detokenizer.flush(), search)
                text += tail + ("" if stop_string_matched else stop_checker.flush())  # the held-back tail
            if stop_string_matched:
                stop_reason = stop_checker.matched_stop
            elif core.finish_reason == "stop" and token_id in params.stop_token_ids:
                stop_reason = token_id
            if core.logprobs is not None and state.num_logprobs is not None:
                logprobs = [_token_logprob(token_id, core.logprobs, state.num_logprobs)]
        finish_reason = "stop" if stop_string_matched else core.finish_reason
        if finish_reason is not None:
            self._states.pop(core.request_id, None)
        return RequestOutput(
            request_id=core.request_id, new_token_ids=list(core.new_token_ids), new_text=text,
            finished=finish_reason is not None, finish_reason=finish_reason,
            num_prompt_tokens=core.num_prompt_tokens, num_output_tokens=core.num_output_tokens,
            num_cached_tokens=core.num_cached_tokens, new_logprobs=logprobs, error=core.error,
            error_param=core.error_param, stop_reason=stop_reason, prompt_logprobs=core.prompt_logprobs), \
            stop_string_matched


def _token_logprob(token_id: int, row: RowLogprobs, k: int) -> TokenLogprob:
    """The sampled token's logprob and the request's top-k alternatives (of the step's max_logprobs)."""
    return TokenLogprob(token_id, float(row.logprob),
                        [(int(t), float(lp)) for t, lp in zip(row.top_ids[:k], row.top_logprobs[:k])])
