"""Roofline benchmark of the paged attention kernels, both families side by side: the Triton
lowering's (paged_decode, ragged_prefill) and Mosaic GPU's (mosaic_decode, mosaic_ragged, where the
installed jax has Mosaic GPU), on the same inputs, each row naming its backend and the largest
difference from the Triton kernel's output.

Decode: achieved HBM bandwidth against the bytes the kernel must move (the K/V pages in use,
q and the output), batch 64 at contexts 1k/4k/8k with Llama-3-8B heads (32 query heads, 8 KV
heads, head_dim 128, bfloat16, page size 16). Ragged: TFLOP/s of causal attention for 8 prefills
of 512 tokens. A device-to-device copy and a bf16 matmul measured in the same run give the
bandwidth and FLOP/s ceilings. Grouped matmul (the routed experts of a mixture-of-experts layer):
the Pallas kernel against XLA's ragged_dot on the gate projection of Qwen3-30B-A3B (128 experts,
2048 -> 768, top-8) at 1, 64 and 512 tokens and of Mixtral-8x7B (8 experts, 4096 -> 14336, top-2) at
8 tokens, each token routed to distinct random experts; bandwidth against the bytes of the experts
a call routes to (their weights, the rows in and out), FLOP/s against 2 * rows * K * N.

  python bench/kernel_speed.py --out bench/out/kernels.json            # on a GPU
  python bench/kernel_speed.py --interpret --quick --out /tmp/k.json   # anywhere, tiny shapes
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pallas_kernels import compat, dispatch, grouped_matmul, kv_quant, reference  # noqa: E402

# Grouped-matmul cases: (name, experts, K, N, top-k, tokens).
QWEN3_30B_A3B, MIXTRAL_8X7B = (128, 2048, 768, 8), (8, 4096, 14336, 2)
FULL = dict(batch=64, contexts=(1024, 4096, 8192), q_heads=32, kv_heads=8, head_dim=128,
            page_size=16, quantized_contexts=(4096,), prefills=8, prefill_len=512, copy_mib=1024, matmul=8192,
            repeats=20,
            grouped=[("qwen3-30b-a3b gate", *QWEN3_30B_A3B, 1), ("qwen3-30b-a3b gate", *QWEN3_30B_A3B, 64),
                     ("qwen3-30b-a3b gate", *QWEN3_30B_A3B, 512), ("mixtral-8x7b gate", *MIXTRAL_8X7B, 8)])
QUICK = dict(batch=2, contexts=(40, 100), q_heads=4, kv_heads=2, head_dim=64,
             page_size=16, quantized_contexts=(100,), prefills=2, prefill_len=24, copy_mib=4, matmul=128,
             repeats=2,
             grouped=[("tiny gate", 8, 64, 128, 2, 1), ("tiny gate", 8, 64, 128, 2, 16)])


def time_call(function, *args, repeats):
    """Median seconds of one call, after a warm-up call that compiles."""
    jax.block_until_ready(function(*args))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function(*args))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def copy_bandwidth(mib, repeats):
    """Device-to-device copy: bytes read + written per second."""
    source = jnp.ones((mib * 2**20 // 4,), jnp.float32)
    copy = jax.jit(lambda x: x * 1.0 + 0.0)  # forces a fresh output buffer
    seconds = time_call(copy, source, repeats=repeats)
    moved = 2 * source.nbytes
    return {"bytes": moved, "seconds": seconds, "gb_per_s": moved / seconds / 1e9}


def matmul_rate(n, repeats):
    """bf16 n x n x n matmul (float32 accumulation, bf16 out): FLOP/s, the compute ceiling."""
    key_a, key_b = jax.random.split(jax.random.key(3))
    a = jax.random.normal(key_a, (n, n), jnp.bfloat16)
    b = jax.random.normal(key_b, (n, n), jnp.bfloat16)
    matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    seconds = time_call(matmul, a, b, repeats=repeats)
    flops = 2 * n**3
    return {"n": n, "flops": flops, "seconds": seconds, "tflop_per_s": flops / seconds / 1e12}


def paged_cache(rng, seq_lens, shape, dtype):
    """K/V pages holding every sequence's context behind a randomly permuted block table."""
    batch = len(seq_lens)
    page_size, kv_heads, head_dim = shape
    pages_per_seq = [-(-int(n) // page_size) for n in seq_lens]
    max_pages = max(pages_per_seq)
    num_pages = sum(pages_per_seq) + 1
    order = 1 + rng.permutation(num_pages - 1)
    block_table = np.zeros((batch, max_pages), np.int32)
    used = 0
    for row, count in enumerate(pages_per_seq):
        block_table[row, :count] = order[used : used + count]
        used += count
    key_k, key_v = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    page_shape = (num_pages, page_size, kv_heads, head_dim)
    k_pages = jax.random.normal(key_k, page_shape, dtype)
    v_pages = jax.random.normal(key_v, page_shape, dtype)
    return k_pages, v_pages, jnp.asarray(block_table), sum(pages_per_seq)


def kernel_backends(interpret):
    """The dispatch names of the kernel families to time: Triton's, and Mosaic GPU's when this jax has it."""
    backends = {"triton": "interpret" if interpret else "pallas"}
    if compat.has_mosaic_gpu():
        backends["mosaic"] = "mosaic_interpret" if interpret else "mosaic"
    return backends


def time_backends(attention, args, interpret, repeats):
    """{family: (seconds, max |output - Triton's output|)} for each kernel family on the same args."""
    timed, first = {}, None
    for family, backend in kernel_backends(interpret).items():
        kernel = jax.jit(lambda *a, _b=backend: attention(_b, *a))
        out = np.asarray(kernel(*args), np.float32)
        first = out if first is None else first
        timed[family] = (time_call(kernel, *args, repeats=repeats), float(np.abs(out - first).max()))
    return timed


def quantize_pages(pages, kind):
    """bfloat16 pages [num_pages, page_size, kv_heads, d] as a `kind` ("int8", "fp8") cache (kv_quant)."""
    template = kv_quant.zeros((1, 1) + pages.shape[2:], kv_quant.KV_CACHE_DTYPES[kind])
    stored = kv_quant.quantize_rows(pages.reshape(-1, *pages.shape[2:]), template)
    return jax.tree.map(lambda a: a.reshape(pages.shape[:2] + a.shape[1:]), stored)


def cache_bytes(cache) -> int:
    """Bytes of a page array or of a quantized cache (its pages and scales)."""
    return sum(a.nbytes for a in jax.tree.leaves(cache))


def bench_decode(config, rng, interpret, with_reference):
    dtype = jnp.bfloat16
    results = []
    runs = [(context, "bfloat16") for context in config["contexts"]]
    runs += [(context, kind) for context in config["quantized_contexts"] for kind in ("int8", "fp8")]
    for context, kv_dtype in runs:
        seq_lens = np.full((config["batch"],), context, np.int32)
        shape = (config["page_size"], config["kv_heads"], config["head_dim"])
        k_pages, v_pages, block_table, pages_in_use = paged_cache(rng, seq_lens, shape, dtype)
        if kv_dtype != "bfloat16":
            k_pages, v_pages = quantize_pages(k_pages, kv_dtype), quantize_pages(v_pages, kv_dtype)
        q_shape = (config["batch"], config["q_heads"], config["head_dim"])
        q = jax.random.normal(jax.random.key(1), q_shape, dtype)
        args = (q, k_pages, v_pages, block_table, jnp.asarray(seq_lens))
        page_bytes = cache_bytes(k_pages) // kv_quant.values(k_pages).shape[0]  # values and scales of one page
        needed = 2 * pages_in_use * page_bytes + 2 * q.nbytes + block_table.nbytes + 4 * config["batch"]
        if with_reference:
            reference_fn = jax.jit(reference.paged_decode_attention)
            ref_seconds = time_call(reference_fn, *args, repeats=config["repeats"])
        for family, (seconds, difference) in time_backends(dispatch.decode_attention, args, interpret,
                                                           config["repeats"]).items():
            row = {"backend": family, "kv_dtype": kv_dtype, "batch": config["batch"], "context": context,
                   "bytes": needed, "seconds": seconds, "gb_per_s": needed / seconds / 1e9,
                   "max_abs_diff_vs_triton": difference}
            if with_reference:
                row.update(reference_seconds=ref_seconds, reference_gb_per_s=needed / ref_seconds / 1e9)
            results.append(row)
        del k_pages, v_pages
    return results


def causal_attention_flops(query_lens, q_heads, head_dim):
    """2 matmuls x 2 flops per multiply-add over the keys each query may see."""
    visible = sum(n * (n + 1) // 2 for n in query_lens)
    return 4 * visible * q_heads * head_dim


def bench_ragged(config, rng, interpret, with_reference):
    dtype = jnp.bfloat16
    lengths = [config["prefill_len"]] * config["prefills"]
    seq_lens = np.asarray(lengths, np.int32)
    shape = (config["page_size"], config["kv_heads"], config["head_dim"])
    k_pages, v_pages, block_table, _ = paged_cache(rng, seq_lens, shape, dtype)
    num_tokens = sum(lengths)
    q = jax.random.normal(jax.random.key(2), (num_tokens, config["q_heads"], config["head_dim"]), dtype)
    query_start_loc = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    args = (q, k_pages, v_pages, block_table, jnp.asarray(seq_lens), query_start_loc)
    flops = causal_attention_flops(lengths, config["q_heads"], config["head_dim"])
    results = []
    for family, (seconds, difference) in time_backends(dispatch.ragged_attention, args, interpret,
                                                       config["repeats"]).items():
        results.append({"backend": family, "prefills": config["prefills"], "prefill_len": config["prefill_len"],
                        "flops": flops, "seconds": seconds, "tflop_per_s": flops / seconds / 1e12,
                        "max_abs_diff_vs_triton": difference})
    if with_reference:
        reference_fn = jax.jit(reference.ragged_paged_attention)
        ref_seconds = time_call(reference_fn, *args, repeats=config["repeats"])
        for result in results:
            result.update(reference_seconds=ref_seconds, reference_tflop_per_s=flops / ref_seconds / 1e12)
    return results


def routed_rows(rng, num_experts, top_k, tokens):
    """Group sizes [E] of `tokens` tokens each routed to top_k distinct random experts, and how
    many experts got at least one row."""
    chosen = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(tokens)])  # [tokens, k]
    sizes = np.bincount(chosen.reshape(-1), minlength=num_experts).astype(np.int32)
    return jnp.asarray(sizes), int(np.count_nonzero(sizes))


def bench_grouped(config, rng, interpret):
    """The Pallas grouped matmul against jax.lax.ragged_dot (bf16) on each case of config["grouped"]."""
    dtype = jnp.bfloat16
    results = []
    for name, num_experts, k, n, top_k, tokens in config["grouped"]:
        rows = tokens * top_k
        group_sizes, experts_used = routed_rows(rng, num_experts, top_k, tokens)
        key_lhs, key_rhs = jax.random.split(jax.random.key(int(rng.integers(2**31))))
        lhs = jax.random.normal(key_lhs, (rows, k), dtype)
        rhs = (jax.random.normal(key_rhs, (num_experts, k, n), jnp.float32) / math.sqrt(k)).astype(dtype)
        kernel = jax.jit(lambda *a: grouped_matmul.grouped_matmul(*a, interpret=interpret))
        xla = jax.jit(jax.lax.ragged_dot)
        error = float(jnp.max(jnp.abs(kernel(lhs, rhs, group_sizes).astype(jnp.float32)
                                      - xla(lhs, rhs, group_sizes).astype(jnp.float32))))
        seconds = time_call(kernel, lhs, rhs, group_sizes, repeats=config["repeats"])
        xla_seconds = time_call(xla, lhs, rhs, group_sizes, repeats=config["repeats"])
        itemsize = jnp.dtype(dtype).itemsize
        needed = (experts_used * k * n + rows * (k + n)) * itemsize  # routed experts' weights, rows in and out
        flops = 2 * rows * k * n
        results.append({
            "case": name, "experts": num_experts, "k": k, "n": n, "top_k": top_k, "tokens": tokens, "rows": rows,
            "experts_routed": experts_used, "bytes": needed, "flops": flops, "max_abs_diff_vs_xla": error,
            "seconds": seconds, "gb_per_s": needed / seconds / 1e9, "tflop_per_s": flops / seconds / 1e12,
            "xla_seconds": xla_seconds, "xla_gb_per_s": needed / xla_seconds / 1e9,
            "kernel_speedup_over_xla": xla_seconds / seconds,
        })
        del lhs, rhs
    return results


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="path of the JSON report")
    parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (no GPU)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--with-reference", action="store_true", help="also time the plain-jnp reference")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    if not args.interpret and jax.default_backend() != "gpu":
        print("error: the compiled kernels need a GPU; pass --interpret elsewhere", file=sys.stderr)
        return 2
    config = QUICK if args.quick else FULL
    rng = np.random.default_rng(0)
    device = jax.devices()[0]
    report = {
        "device": getattr(device, "device_kind", str(device)),
        "jax_version": jax.__version__,
        "mode": "interpret" if args.interpret else "compiled",
        "backends": list(kernel_backends(args.interpret)),
        "shapes": {k: v for k, v in config.items() if k != "repeats"},
        "copy": copy_bandwidth(config["copy_mib"], config["repeats"]),
        "matmul": matmul_rate(config["matmul"], config["repeats"]),
    }
    report["decode"] = bench_decode(config, rng, args.interpret, args.with_reference)
    for row in report["decode"]:
        row["fraction_of_copy_bandwidth"] = row["gb_per_s"] / report["copy"]["gb_per_s"]
    report["ragged"] = bench_ragged(config, rng, args.interpret, args.with_reference)
    for row in report["ragged"]:
        row["fraction_of_matmul_rate"] = row["tflop_per_s"] / report["matmul"]["tflop_per_s"]
    report["grouped_matmul"] = bench_grouped(config, rng, args.interpret)
    for row in report["grouped_matmul"]:
        row["fraction_of_copy_bandwidth"] = row["gb_per_s"] / report["copy"]["gb_per_s"]
        row["fraction_of_matmul_rate"] = row["tflop_per_s"] / report["matmul"]["tflop_per_s"]
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=2)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
