"""One step's work as plain, immutable data: what the scheduler hands the runner.

`Scheduler.schedule()` decides a `StepPlan` over live `Request`s; `StepPlan.to_batch()` snapshots
it into a `ScheduledBatch` (token ids, positions, block-table rows and sampling rows per row) that
`ModelRunner.execute` packs into the bucketed device arrays. The runner never sees a `Request`, so
nothing on the device side can read or change host bookkeeping. No jax here.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxserve.request import SamplingParams


@dataclasses.dataclass(frozen=True, slots=True)
class RowParams:
    """How one row is sampled: the request's sampling parameters (read only), where its random
    stream is, and its token history (needed, and filled by the scheduler, only with a penalty)."""

    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    seed: int = 0
    step: int = 0  # number of output tokens so far
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()

    @property
    def has_penalties(self) -> bool:
        return uses_penalties(self.params)


def uses_penalties(params: SamplingParams) -> bool:
    """Whether sampling reads the token history (repetition, presence or frequency penalty)."""
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class ScheduledRow:
    """One sequence's part of a step: `token_ids` at positions `start ..` of the sequence whose
    K/V pages are `page_ids` (positions before `start` are already in the cache)."""

    request_id: str
    token_ids: tuple[int, ...]  # computed this step: one for a decode row, a chunk for prefill
    start: int  # position of token_ids[0]
    page_ids: tuple[int, ...]  # the sequence's block-table row; holds positions up to `end`
    sampling: RowParams | None  # None: a prefill chunk short of the sequence's end (its sample is dropped)

    @property
    def end(self) -> int:
        """Context length after the step (positions 0 .. end - 1 are in the cache)."""
        return self.start + len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class ScheduledBatch:
    """One step: decode rows (one token each) and prefill chunks, in the order of the sampled ids."""

    decode: tuple[ScheduledRow, ...] = ()
    prefill: tuple[ScheduledRow, ...] = ()

    @property
    def rows(self) -> tuple[ScheduledRow, ...]:
        return self.decode + self.prefill

    @property
    def num_prefill_tokens(self) -> int:
        return sum(len(row.token_ids) for row in self.prefill)

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + self.num_prefill_tokens

    @property
    def max_num_pages(self) -> int:
        """Block-table width the step needs: pages of its widest row."""
        return max((len(row.page_ids) for row in self.rows), default=0)

    @property
    def num_attention_pairs(self) -> int:
        """(query, key) pairs the step's causal attention covers: a query at position p sees p + 1 keys."""
        return sum(len(row.token_ids) * row.start + len(row.token_ids) * (len(row.token_ids) + 1) // 2
                   for row in self.rows)

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill
