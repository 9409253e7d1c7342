"""Which step buckets are worth compiling, from measured step times (no jax).

Every bucket costs a compile at start-up (and an executable kept); a bucket earns that only if
its steps would cost noticeably more padded up to the next bucket. `choose_buckets` applies that
test to the step times `jaxserve plan --measure_buckets` measures (jaxserve.planning.bucket_measure)
for one kind of size (decode rows, or prefill tokens); its answer is an explicit bucket list
(EngineConfig.decode_buckets / prefill_buckets).
"""
from __future__ import annotations

import math
from typing import Mapping

DEFAULT_TOLERANCE = 0.1  # a bucket whose steps padded to the next one cost at most 10% more is dropped


def choose_buckets(step_seconds: Mapping[int, float], tolerance: float = DEFAULT_TOLERANCE) -> tuple[int, ...]:
    """The bucket sizes worth keeping, ascending, given the measured time of a step in each
    candidate size (`step_seconds`: {size: seconds}, e.g. median seconds of a decode step of that
    many rows).

    The rule: the largest candidate is always kept (a step that large must fit). Going down from
    it, candidate s with time t(s) is dropped when k, the smallest size kept so far above s (the
    bucket its steps would be padded into), has t(k) <= (1 + tolerance) * t(s); otherwise s is
    kept. So a tie (t(k) == t(s)) drops s, and with tolerance 0 only buckets strictly faster than
    the next kept one stay. Guarantee: padded into the chosen buckets, a step of any candidate
    size takes at most (1 + tolerance) times that size's own step time. With step times that grow
    with the size, no smaller set of candidates keeps that guarantee, and a larger tolerance never
    keeps more buckets.

    Raises ValueError for no candidates, a size below 1, a time that is not positive and finite,
    or a negative tolerance."""
    if not step_seconds:
        raise ValueError("no candidate bucket sizes")
    if not (tolerance >= 0 and math.isfinite(tolerance)):
        raise ValueError(f"the tolerance must be a finite fraction >= 0, got {tolerance}")
    for size, seconds in step_seconds.items():
        if int(size) != size or size < 1:
            raise ValueError(f"bucket sizes must be positive integers, got {size!r}")
        if not (seconds > 0 and math.isfinite(seconds)):
            raise ValueError(f"the step time of bucket {size} must be positive and finite, got {seconds!r}")
    sizes = sorted(step_seconds)
    kept = [sizes[-1]]
    for size in reversed(sizes[:-1]):
        if step_seconds[kept[-1]] > (1 + tolerance) * step_seconds[size]:
            kept.append(size)
    return tuple(reversed(kept))


def padded_into(size: int, kept: tuple[int, ...]) -> int:
    """The kept bucket a step of `size` is padded into: the smallest kept size >= it."""
    return next(k for k in kept if k >= size)
