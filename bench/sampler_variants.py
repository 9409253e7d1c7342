"""What each sampler variant costs: compile seconds and run time per call, by rows.

The runner compiles the sampler per row count in four variants (with and without the penalty
stage's token histories, with and without the logit-bias stage), 36 of the 68 warm-up shapes for
SmolLM2 at default flags. A variant is worth its compile only if the shared code would be slower
where it is not needed: this prints, per row count, each variant's compile time and median run
time (greedy rows, no penalty or bias values set: the common step), so the cost of running the
bias stage (or the penalty stage) on every step can be read off.

  python bench/sampler_variants.py [--vocab=49152] [--history=2048] [--rows=1,8,16,32] [--iters=50]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from jaxserve.executor import sampler  # noqa: E402


def measure(rows: int, vocab: int, history: int, penalties: bool, bias: bool, iters: int) -> tuple[float, float]:
    """(compile seconds, median seconds per call) of one variant."""
    inputs = sampler.build_sampling_inputs([None] * rows, rows, history, penalties, bias, (2,), vocab_size=vocab)
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((rows, vocab), np.float32))
    start = time.perf_counter()
    compiled = jax.jit(lambda l, i: sampler.sample(l, i, max_logprobs=20)).lower(logits, inputs).compile()
    compile_s = time.perf_counter() - start
    device_inputs = jax.device_put(inputs)
    jax.block_until_ready(compiled(logits, device_inputs))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(compiled(logits, device_inputs))
        times.append(time.perf_counter() - t)
    return compile_s, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)  # SmolLM2
    parser.add_argument("--history", type=int, default=2048)  # max_model_len at default flags
    parser.add_argument("--rows", default="1,8,16,32")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    print(common.machine_line(common.machine_info(with_jax=True)))
    print(f"vocab {args.vocab}, history {args.history}, median of {args.iters} calls")
    print(f"{'rows':>5} {'variant':<20} {'compile s':>9} {'run ms':>8} {'vs plain':>8}")
    for rows in (int(r) for r in args.rows.split(",")):
        plain = None
        for penalties, bias in ((False, False), (False, True), (True, False), (True, True)):
            compile_s, run_s = measure(rows, args.vocab, args.history, penalties, bias, args.iters)
            plain = plain or run_s
            name = "+".join(n for n, on in (("penalties", penalties), ("bias", bias)) if on) or "plain"
            print(f"{rows:>5} {name:<20} {compile_s:>9.2f} {run_s * 1e3:>8.3f} {run_s / plain:>7.2f}x")


if __name__ == "__main__":
    main()
