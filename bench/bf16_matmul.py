"""The bfloat16-weight CPU kernel (cpu_kernels.bf16_matmul) against XLA:CPU on the same product:
float32 rows x a bfloat16 weight, for decode-sized row counts.

Each row of the table is one shape [K, N] and row count R: the median time of one jitted call of
  kernel   cpu_kernels.bf16_matmul(x, pack_bf16(w), N)       (2 bytes a weight read)
  xla_f32  x @ w.astype(float32), the weight stored float32  (4 bytes a weight)
  xla_bf16 x @ w, the weight stored bfloat16                 (XLA converts it element by element)
with the kernel's weight bandwidth (GB/s of bf16 weight) and its speed-up over both. The
kernel's largest difference from x @ w.astype(float32) (relative to that result's largest
magnitude) is checked on every row.

  python bench/bf16_matmul.py
  python bench/bf16_matmul.py --rows=1,8 --shapes=576x1536 --min_seconds=0.2   # quick look
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

SHAPES = "576x1536,1536x576,576x576,576x49152"  # SmolLM2-135M's up/gate, down, q/o, and lm_head
ROWS = "1,8,32,64"


def median_seconds(fn, args, min_seconds: float, min_calls: int) -> float:
    """Median wall time of fn(*args) (blocked on its result) over at least min_calls calls and
    min_seconds, after two warm-up calls (compilation)."""
    for _ in range(2):
        fn(*args).block_until_ready()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_calls or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
        if len(times) >= 10 * min_calls and time.perf_counter() - start > min_seconds:
            break
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=SHAPES, help="comma-separated KxN weight shapes")
    parser.add_argument("--rows", default=ROWS, help="comma-separated row counts (at most cpu_kernels.MAX_ROWS)")
    parser.add_argument("--min_seconds", type=float, default=1.0, help="time spent on each measurement, at least")
    parser.add_argument("--min_calls", type=int, default=20, help="calls per measurement, at least")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the table and machine to this JSON file")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import cpu_kernels

    if not cpu_kernels.available():
        sys.exit("the CPU kernels are not available on this machine")
    rng = np.random.default_rng(args.seed)
    kernel = jax.jit(cpu_kernels.bf16_matmul, static_argnums=2)
    xla = jax.jit(lambda x, w: x @ w)
    results = []
    for shape in args.shapes.split(","):
        k, n = map(int, shape.lower().split("x"))
        w_bf16 = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
        w_f32 = w_bf16.astype(jnp.float32)
        packed = cpu_kernels.pack_bf16(w_bf16).block_until_ready()
        for rows in map(int, args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((rows, k)), jnp.float32)
            want = np.asarray(xla(x, w_f32))
            got = np.asarray(kernel(x, packed, n))
            error = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
            row = {"shape": f"{k}x{n}", "rows": rows, "error": error}
            for name, fn, operands in (("kernel", kernel, (x, packed, n)), ("xla_f32", xla, (x, w_f32)),
                                       ("xla_bf16", xla, (x, w_bf16))):
                call = (lambda *a, fn=fn: fn(*a)) if name != "kernel" else (lambda x, p, fn=fn: fn(x, p, n))
                row[name] = 1e3 * median_seconds(call, operands[:2], args.min_seconds, args.min_calls)
            row["kernel_gbs"] = k * n * 2 / (row["kernel"] * 1e-3) / 1e9
            row["vs_f32"] = row["xla_f32"] / row["kernel"]
            row["vs_bf16"] = row["xla_bf16"] / row["kernel"]
            results.append(row)
            print(f"{row['shape']:>10} R={rows:<3} kernel {row['kernel']:.4f} ms  xla_f32 {row['xla_f32']:.4f} ms  "
                  f"xla_bf16 {row['xla_bf16']:.4f} ms  error {error:.1e}", file=sys.stderr, flush=True)
    info = common.machine_info(with_jax=True)
    print(common.format_table(results, [
        ("shape", "K x N", "s"), ("rows", "rows", "d"), ("kernel", "kernel ms", ".4f"),
        ("xla_f32", "XLA f32 ms", ".4f"), ("xla_bf16", "XLA bf16 ms", ".4f"), ("kernel_gbs", "kernel GB/s", ".1f"),
        ("vs_f32", "x vs f32", ".2f"), ("vs_bf16", "x vs bf16", ".1f"), ("error", "max rel err", ".1e")]))
    print(common.machine_line(info))
    worst = max(row["error"] for row in results)
    if worst > 1e-5:
        sys.exit(f"the kernel differs from x @ w.astype(float32) by {worst:.1e} (relative)")
    common.write_json(args.out, {"machine": info, "results": results})


if __name__ == "__main__":
    main()
