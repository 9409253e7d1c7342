"""A few-second probe of this machine's ceilings for the latency predictor (jaxserve.planning.predict):
the copy bandwidth of a buffer larger than the caches, and the float32 matmul rate jax reaches for the
engine's [rows, hidden] x [hidden, intermediate] products (its dtype and shape class) at the rows of a
full CPU decode step and of a prefill chunk, the better of the two being the peak (a roofline's
ceiling is the most the machine does; small-row matmuls reach less of it)."""
from __future__ import annotations

import time

import numpy as np

COPY_BYTES = 256 << 20  # far past any last-level cache
PROBE_ROWS = (64, 512)  # the largest CPU decode bucket, and the default prefill chunk


def _best_seconds(fn, budget_s: float) -> float:
    """The fastest of repeated calls of `fn` within about `budget_s` (at least 3)."""
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 3 or spent < budget_s:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        best, spent, calls = min(best, took), spent + took, calls + 1
    return best


def copy_bandwidth(budget_s: float = 1.0) -> float:
    """Bytes/s of a large numpy copy (read + write counted)."""
    src = np.ones(COPY_BYTES // 4, np.float32)  # [n]
    dst = np.empty_like(src)
    return 2 * src.nbytes / _best_seconds(lambda: np.copyto(dst, src), budget_s)


def matmul_rate(hidden: int, intermediate: int, rows: int, budget_s: float = 0.75) -> float:
    """FLOP/s of a jitted float32 [rows, hidden] x [hidden, intermediate] matmul."""
    import jax  # the probe alone needs jax: the predictor's arithmetic stays without it
    import jax.numpy as jnp
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, hidden), np.float32))  # [rows, hidden]
    w = jnp.asarray(rng.standard_normal((hidden, intermediate), np.float32))  # [hidden, intermediate]
    matmul = jax.jit(jnp.matmul)
    matmul(x, w).block_until_ready()  # compile
    return 2 * rows * hidden * intermediate / _best_seconds(lambda: matmul(x, w).block_until_ready(), budget_s)


def probe(hidden: int, intermediate: int) -> tuple[float, float]:
    """(memory bytes/s, FLOP/s) of this machine, in about 3 s."""
    return copy_bandwidth(), max(matmul_rate(hidden, intermediate, rows) for rows in PROBE_ROWS)
