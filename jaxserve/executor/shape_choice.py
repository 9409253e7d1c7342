"""Which compiled shape serves a step while a background warm-up is still compiling.

A step's own shape (the smallest bucket that holds it) may not be compiled yet right after a
server says it is ready: only what a first request needs is (jaxserve.executor.warmup). Rather
than wait for a compile, which on a busy machine takes many seconds, the runner serves the step
through shapes that are compiled: the smallest compiled bucket that holds it
(`compiled_bucket_holding`), or for a step with decoding rows beside prefill chunks its decode
half and its prefill half as two calls (`split`, `merge_outputs`). Both give the tokens the step's
own shape gives: a row's result does not depend on the padding or the other rows (tests check
it). Only when nothing compiled holds the step does it wait, and then the warm-up takes its
shape next. Plain data in, plain data out: no jax here.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Sequence

import numpy as np

from jaxserve.core.step import Bucket, ScheduledBatch, StepOutput


def _holds(bucket: Bucket, needed: Bucket) -> bool:
    return (not bucket.num_verify and not needed.num_verify and bucket.num_decode >= needed.num_decode
            and bucket.num_prefill_tokens >= needed.num_prefill_tokens and bucket.pages_per_seq >= needed.pages_per_seq)


def compiled_bucket_holding(needed: Bucket, buckets: Sequence[Bucket], cache,
                            sampler_key: Callable[[Bucket], Hashable]) -> Bucket:
    """`needed`, unless a warm-up has promised it and not compiled it yet (with the sampler of
    its rows) and a compiled bucket holds the step: then the cheapest such one (fewest tokens,
    then the narrowest block table)."""
    def ready(bucket: Bucket) -> bool:
        return cache.ready("forward", bucket) and cache.ready("sample", sampler_key(bucket))

    if not cache.will_compile("forward", needed) or ready(needed):
        return needed
    holding = [b for b in buckets if _holds(b, needed) and ready(b)]
    return min(holding, key=lambda b: (b.num_decode + b.num_prefill_tokens, b.pages_per_seq), default=needed)


def split(batch: ScheduledBatch, bucket: Bucket, bucket_of: Callable[[ScheduledBatch], Bucket],
          runs_now: Callable[[ScheduledBatch, Bucket], bool]) -> list | None:
    """A step of decoding rows beside prefill chunks that cannot run now in `bucket` (the one it
    would run in), as [(its decode rows, their bucket), (its prefill chunks, theirs)] when each of
    those can; else None (run it as it is)."""
    if not (batch.decode and batch.prefill) or runs_now(batch, bucket):
        return None
    halves = [(half, bucket_of(half)) for half in (ScheduledBatch(decode=batch.decode),
                                                   ScheduledBatch(prefill=batch.prefill))]
    return halves if all(runs_now(half, half_bucket) for half, half_bucket in halves) else None


def _rows(outputs: Sequence[StepOutput], name: str) -> np.ndarray | None:
    """One field of the halves' outputs, rows concatenated (zeros where a half has none)."""
    parts = [getattr(out, name) for out in outputs]
    present = next((part for part in parts if part is not None), None)
    if present is None:
        return None
    return np.concatenate([part if part is not None else np.zeros((len(out.token_ids), *present.shape[1:]),
                                                                  present.dtype)
                           for part, out in zip(parts, outputs)])


def merge_outputs(outputs: Sequence[StepOutput]) -> StepOutput:
    """The StepOutput of a split step from its halves' (decode rows first, as the step's order):
    its bucket is the halves' combined (decode rows of one, prefill tokens of the other), its
    times their sums."""
    prompt = None
    if any(out.prompt_logprobs is not None for out in outputs):
        prompt = [entry for out in outputs
                  for entry in (out.prompt_logprobs if out.prompt_logprobs is not None else [None] * len(out.token_ids))]
    buckets = [out.bucket for out in outputs]
    bucket = Bucket(sum(b.num_decode for b in buckets), sum(b.num_prefill_tokens for b in buckets),
                    max(b.pages_per_seq for b in buckets))
    return dataclasses.replace(
        outputs[0], token_ids=_rows(outputs, "token_ids"), logprobs=_rows(outputs, "logprobs"),
        top_ids=_rows(outputs, "top_ids"), top_logprobs=_rows(outputs, "top_logprobs"), bucket=bucket,
        device_seconds=sum(out.device_seconds for out in outputs), host_seconds=sum(out.host_seconds for out in outputs),
        prompt_logprobs=prompt)


def prompt_logprob_rows(sizes: Sequence[int], num_rows: int, cache) -> int | None:
    """The prompt-logprob shape a step of `num_rows` rows runs with: the smallest compiled one
    that holds them, else the smallest that does (a step then waits for it); None: more rows
    than the largest."""
    holding = [size for size in sizes if size >= num_rows]
    return next((size for size in holding if cache.ready("prompt_logprobs", size)), holding[0] if holding else None)
