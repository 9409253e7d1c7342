"""Step times of an engine's candidate buckets, measured on this machine (`plan --measure_buckets`).

For each decode row count of the engine's buckets, a decode-only step of that many rows, each
at `context_len` tokens of context; for each prefill token count, a prefill-only step of one
sequence's first that many tokens. Each step goes through the runner's own packing
(`ModelRunner.build_batch`) into its bucket, whose forward is compiled once and then timed in
`repeats` rounds, one call per bucket in every round (so load from other processes falls on all
of them alike); the median of each is its step time. Full buckets are timed: a real step padded
into a bucket has cheaper padding rows (no context), so the measured cost of a larger bucket is
an upper bound and the choice errs towards keeping buckets. The block-table width is the one a
`context_len` context needs (one width on the CPU). The forward only: the sampler's cost grows
with the rows too, but is small beside it. Mixed steps (decode rows beside a prefill chunk, in
the combined buckets) are not timed: the decode and prefill sizes chosen from these pure steps
are the ones they combine.
"""
from __future__ import annotations

import dataclasses
import statistics

from jaxserve.core.step import Bucket, ScheduledBatch, ScheduledRow

MEASURE_TOKEN_ID = 1  # the measured steps' tokens (any id: their K/V are written and never read by a request)


@dataclasses.dataclass(frozen=True)
class BucketTimes:
    """Median step seconds of each candidate size: {decode rows: s}, {prefill tokens: s}."""
    decode: dict[int, float]
    prefill: dict[int, float]
    context_len: int


def pages_needed(decode_rows: int, prefill_tokens: int, context_len: int, page_size: int) -> int:
    """KV pages (null page included) the measured steps write: every decode row its own."""
    return 1 + max(decode_rows * -(-context_len // page_size), -(-prefill_tokens // page_size))


def decode_step(rows: int, context_len: int, page_size: int) -> ScheduledBatch:
    """`rows` decode rows, each the last token of a `context_len`-token context on its own pages."""
    per_row = -(-context_len // page_size)
    return ScheduledBatch(decode=tuple(
        ScheduledRow(f"measure-{i}", (MEASURE_TOKEN_ID,), context_len - 1,
                     tuple(range(1 + i * per_row, 1 + (i + 1) * per_row)), None) for i in range(rows)))


def prefill_step(tokens: int, page_size: int) -> ScheduledBatch:
    """One sequence's first `tokens` prompt tokens as one prefill chunk."""
    pages = tuple(range(1, 1 + -(-tokens // page_size)))
    return ScheduledBatch(prefill=(ScheduledRow("measure", (MEASURE_TOKEN_ID,) * tokens, 0, pages, None),))


def measure(runner, context_len: int, repeats: int) -> BucketTimes:
    """The median step times of `runner`'s (jaxserve.executor.runner.ModelRunner) candidate
    decode and prefill sizes (its BucketSet's decode_sizes and prefill_sizes); its KV pool must
    hold pages_needed of them. Compiles each of those shapes once (about a warm-up's worth)."""
    buckets = runner.buckets
    steps: dict[tuple[str, int], tuple[Bucket, dict]] = {}
    for kind, sizes, make in (("decode", buckets.decode_sizes, lambda n: decode_step(n, context_len, runner.page_size)),
                              ("prefill", buckets.prefill_sizes, lambda n: prefill_step(n, runner.page_size))):
        for size in sizes:
            bucket, arrays, _ = runner.build_batch(make(size))
            if (bucket.num_decode, bucket.num_prefill_tokens) != ((size, 0) if kind == "decode" else (0, size)):
                raise RuntimeError(f"a {kind} step of {size} went into {bucket}, not its own bucket")
            runner.time_forward(bucket, arrays)  # compiled and warm
            steps[kind, size] = bucket, arrays
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in steps}
    for _ in range(repeats):
        for key, (bucket, arrays) in steps.items():
            samples[key].append(runner.time_forward(bucket, arrays))
    medians = {key: statistics.median(times) for key, times in samples.items()}
    return BucketTimes({size: t for (kind, size), t in medians.items() if kind == "decode"},
                       {size: t for (kind, size), t in medians.items() if kind == "prefill"}, context_len)
