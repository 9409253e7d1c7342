"""Speculative decoding, the host side: the acceptance rule and its counters (no jax; its settings
are EngineConfig's, checked there).

A decoding request may carry up to K proposed tokens (`Request.spec_token_ids`, set by the engine
after each step). The scheduler then runs a *verification step*: every decode row becomes a
query of its last token plus its proposals ([x, d1 .. dk], through the ragged attention path over
the paged cache), and the sampler draws a token at every position, exactly as a decode step
would have drawn it there: row parameters, penalties over the history including the earlier
proposals, and the random key of (seed, output step). The host keeps the longest prefix where the
draws equal the proposals, plus the first draw that differs (or the bonus token after the last
proposal): `accepted_tokens`.

Why this is exact, and what the seed guarantees: every emitted token is the target's own draw at
its position, with the key a plain decode step would use there, given the tokens before it. A
proposal only decides how many of those draws one step can keep. So the output distribution is
the target's, and with a seed the output is the same token sequence as without speculation
(greedy: the target's argmax at every position). The one caveat is floating point: a position
computed inside a multi-token verification chunk may round differently from the same position in
a one-token decode step, which can flip a near-tie. For a deterministic proposal (ngram) the
acceptance probability is p(d), as in standard rejection sampling; for a draft model the draft
draws with the same key (`jaxserve.speculative.draft_proposer`), so its proposal equals the target's draw
whenever both distributions put the same Gumbel-max winner first. Standard rejection sampling
would accept min(1, p/q) of a draft's tokens, a little more often, but it cannot keep the
seeded sequence of non-speculative decoding, which this rule does.

Rejected proposals cost nothing later: their K/V slots lie past the sequence's computed length
and are overwritten; pages taken only for them are returned after the step; prefix caching
hashes computed (accepted) tokens only.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence


def draft_scratch_pages_per_row(num_speculative_tokens: int, page_size: int) -> int:
    """Pages a draft model's proposal pass may write past a row's own pages (positions n .. n + k - 2)."""
    return -(-num_speculative_tokens // page_size) + 1


def max_verify_rows(cfg) -> int:
    """The most decode rows one verification step holds: max_num_seqs, as far as every row's
    K + 1 tokens fit the step's token budget and speculative_disable_by_batch_size allows."""
    rows = min(cfg.max_num_seqs, cfg.max_num_batched_tokens // (cfg.num_speculative_tokens + 1))
    if cfg.speculative_disable_by_batch_size is not None:
        rows = min(rows, cfg.speculative_disable_by_batch_size)
    return max(rows, 1)


def accepted_tokens(proposed: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a verified row emits: `sampled[i]` is the target's draw after the row's last
    token and proposals 0 .. i - 1 (len(proposed) + 1 draws); the draws while they equal the
    proposals, then the first that differs (or the draw after the last proposal)."""
    num_accepted = 0
    while num_accepted < len(proposed) and sampled[num_accepted] == proposed[num_accepted]:
        num_accepted += 1
    return [int(t) for t in sampled[:num_accepted + 1]]


@dataclasses.dataclass
class SpeculationStats:
    """Counters of a speculating engine (what /metrics and `generate` report)."""
    num_speculative_tokens: int = 0
    num_verify_steps: int = 0
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted_per_position[i]: proposals at position i (0-based) that were accepted
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_proposed_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_proposed_tokens if self.num_proposed_tokens else None
