"""The output side of the engine: core results -> the deltas callers stream (no jax).

The engine core (scheduling, the model step, stop tokens, length limits, recovery) reports what
happened to each request as a `CoreOutput`: the token it got, if any, and whether the core ended
it. The `OutputProcessor` turns that into a `RequestOutput`: incremental detokenization, stop
strings (the one way a request ends here, which the engine then applies to the scheduler) and
the shaping of the step's raw logprob rows into `TokenLogprob`s.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from jaxserve.detokenizer import IncrementalDetokenizer, StopChecker
from jaxserve.outputs import RequestOutput, TokenLogprob
from jaxserve.request import SamplingParams


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


class _RequestState:
    """Text state of one request: its detokenizer and stop strings."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids) if tokenizer is not None else None
        self.stop_checker = StopChecker(params.stop)
        self.num_logprobs = params.logprobs


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
        if state is not None and core.new_token_ids:
            token_id = core.new_token_ids[-1]
            detokenizer, stop_checker = state.detokenizer, state.stop_checker
            # A stop token ("stop" from the core) is not text; it still ends the request.
            if detokenizer is not None and core.finish_reason != "stop":
                text, stop_string_matched = stop_checker.add(detokenizer.add(token_id))
            if core.finish_reason is not None and not stop_string_matched and detokenizer is not None:
                text += stop_checker.add(detokenizer.flush())[0] + stop_checker.flush()  # the held-back tail
            if core.logprobs is not None and state.num_logprobs is not None:
                logprobs = [_token_logprob(token_id, core.logprobs, state.num_logprobs)]
        finish_reason = "stop" if stop_string_matched else core.finish_reason
        if finish_reason is not None:
            self._states.pop(core.request_id, None)
        return RequestOutput(
            request_id=core.request_id, new_token_ids=list(core.new_token_ids), new_text=text,
            finished=finish_reason is not None, finish_reason=finish_reason,
            num_prompt_tokens=core.num_prompt_tokens, num_output_tokens=core.num_output_tokens,
            num_cached_tokens=core.num_cached_tokens, new_logprobs=logprobs, error=core.error), stop_string_matched


def _token_logprob(token_id: int, row: RowLogprobs, k: int) -> TokenLogprob:
    """The sampled token's logprob and the request's top-k alternatives (of the step's max_logprobs)."""
    return TokenLogprob(token_id, float(row.logprob),
                        [(int(t), float(lp)) for t, lp in zip(row.top_ids[:k], row.top_logprobs[:k])])
