"""Roofline benchmark of the paged attention kernels, both families side by side: the Triton
lowering's (paged_decode, ragged_prefill) and Mosaic GPU's (mosaic_decode, mosaic_ragged, where the
installed jax has Mosaic GPU), on the same inputs, each row naming its backend and its largest
difference from the plain-jnp reference's output (pallas_kernels/reference.py: a dense float32 softmax
over the gathered context, an implementation independent of both), relative to the reference's
largest value: check "ok" within TOLERANCE, else "differ".

Decode: achieved HBM bandwidth against the bytes the kernel must move (the K/V pages in use,
q and the output), batch 64 at contexts 1k/4k/8k with Llama-3-8B heads (32 query heads, 8 KV
heads, head_dim 128, bfloat16, page size 16). Ragged: TFLOP/s of causal attention for 8 prefills
of 512 tokens. A device-to-device copy and a bf16 matmul measured in the same run give the
bandwidth and FLOP/s ceilings. Grouped matmul (the routed experts of a mixture-of-experts layer):
the Pallas kernel against XLA's ragged_dot on the gate projection of Qwen3-30B-A3B (128 experts,
2048 -> 768, top-8) at 1, 64 and 512 tokens and of Mixtral-8x7B (8 experts, 4096 -> 14336, top-2) at
8 tokens, each token routed to distinct random experts; bandwidth against the bytes of the experts
a call routes to (their weights, the rows in and out), FLOP/s against 2 * rows * K * N, its output
against ragged_dot's. Multi-LoRA update (last): the XLA path, the Triton kernel (lora_bgmv) and the
Mosaic GPU kernel (mosaic_lora) through pallas_kernels.dispatch.lora_update on a stacked bf16 slab at
a layer index, as the model calls it, at Llama-3-8B's q projection (64 decode rows) and gate
projection (512 prefill rows) with 4 adapters of rank 16 (slot 0 among the rows' slots): seconds,
bandwidth against the bytes the update must move (the rows in and out, the used adapters' A and B),
speedup over the XLA path, each output against the reference. Prompt matmuls on 8-bit weights
(--gpu_prompt_dtype): bfloat16 against int8 and fp8 activations at Llama-3-8B's gate and down
projections (512 and 2048 rows), TFLOP/s, speedup, and each against the float32 product.

Every figure is written to --out as soon as it is measured (bench/gpu_check_report.StepReport), and
each backend of each problem runs in its own guard: a Mosaic exception or the step's time limit
leaves the Triton figures and everything measured before. Exit 1 when a row differs or failed.

  python3 bench/kernel_speed.py --out bench/out/kernels.json            # on a GPU
  python3 bench/kernel_speed.py --interpret --quick --out /tmp/k.json   # anywhere, tiny shapes
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

from bench.gpu_check_report import StepReport, require_gpu  # noqa: E402
from pallas_kernels import compat, dispatch, grouped_matmul, kv_quant, mosaic_lora, reference  # noqa: E402

# Grouped-matmul cases: (name, experts, K, N, top-k, tokens).
QWEN3_30B_A3B, MIXTRAL_8X7B = (128, 2048, 768, 8), (8, 4096, 14336, 2)
FULL = dict(batch=64, contexts=(1024, 4096, 8192), q_heads=32, kv_heads=8, head_dim=128,
            page_size=16, quantized_contexts=(4096,), prefills=8, prefill_len=512, copy_mib=1024, matmul=8192,
            repeats=20,
            grouped=[("qwen3-30b-a3b gate", *QWEN3_30B_A3B, 1), ("qwen3-30b-a3b gate", *QWEN3_30B_A3B, 64),
                     ("qwen3-30b-a3b gate", *QWEN3_30B_A3B, 512), ("mixtral-8x7b gate", *MIXTRAL_8X7B, 8)],
            # Multi-LoRA cases: (name, rows, K, N, rank, adapters): Llama-3-8B's q and gate projections.
            lora=[("llama-3-8b q decode", 64, 4096, 4096, 16, 4), ("llama-3-8b gate prefill", 512, 4096, 14336, 16, 4)],
            # Prompt-chunk matmuls on 8-bit weights (--gpu_prompt_dtype): (name, rows, K, N).
            prompt_matmul=[("llama-3-8b gate prefill", 512, 4096, 14336), ("llama-3-8b down prefill", 512, 14336, 4096),
                           ("llama-3-8b gate 2048", 2048, 4096, 14336)])
# Largest |kernel - reference| / largest |reference| a row may show: bfloat16 outputs of the same
# inputs (tests/test_kernels.py's bfloat16 tolerance).
TOLERANCE = 2e-2
QUICK = dict(batch=2, contexts=(40, 100), q_heads=4, kv_heads=2, head_dim=64,
             page_size=16, quantized_contexts=(100,), prefills=2, prefill_len=24, copy_mib=4, matmul=128,
             repeats=2,
             grouped=[("tiny gate", 8, 64, 128, 2, 1), ("tiny gate", 8, 64, 128, 2, 16)],
             lora=[("tiny", 70, 128, 64, 16, 2)],  # two blocks of 64 rows, the second partial
             prompt_matmul=[("tiny", 80, 128, 256)])


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


def relative_difference(out, expected) -> float:
    """max |out - expected| / max |expected|, in float32."""
    out, expected = np.asarray(out, np.float32), np.asarray(expected, np.float32)
    return float(np.abs(out - expected).max() / max(float(np.abs(expected).max()), 1e-30))


def run_backends(report, label, attention, args, expected, interpret, repeats):
    """Each kernel family on the same args, in its own guard: yields (family, seconds, relative
    difference from `expected`) and records check `label/family` (within TOLERANCE: ok, else
    differ; an exception: failed, and the next family runs)."""
    for family, backend in kernel_backends(interpret).items():
        name = f"{label}/{family}"
        with report.guard(name):
            kernel = jax.jit(lambda *a, _b=backend: attention(_b, *a))
            difference = relative_difference(kernel(*args), expected)
            report.check(name, "ok" if difference <= TOLERANCE else "differ", relative_difference=difference,
                         tolerance=TOLERANCE)
            yield family, time_call(kernel, *args, repeats=repeats), difference


def quantize_pages(pages, kind):
    """bfloat16 pages [num_pages, page_size, kv_heads, d] as a `kind` ("int8", "fp8") cache (kv_quant)."""
    template = kv_quant.zeros((1, 1) + pages.shape[2:], kv_quant.KV_CACHE_DTYPES[kind])
    stored = kv_quant.quantize_rows(pages.reshape(-1, *pages.shape[2:]), template)
    return jax.tree.map(lambda a: a.reshape(pages.shape[:2] + a.shape[1:]), stored)


def cache_bytes(cache) -> int:
    """Bytes of a page array or of a quantized cache (its pages and scales)."""
    return sum(a.nbytes for a in jax.tree.leaves(cache))


def decode_problem(config, rng, context, kv_dtype):
    """Decode inputs of config["batch"] sequences at `context` tokens over `kv_dtype` pages, and
    the bytes a kernel must move for them (pages in use, q and output, table and lengths)."""
    seq_lens = np.full((config["batch"],), context, np.int32)
    shape = (config["page_size"], config["kv_heads"], config["head_dim"])
    k_pages, v_pages, block_table, pages_in_use = paged_cache(rng, seq_lens, shape, jnp.bfloat16)
    if kv_dtype != "bfloat16":
        k_pages, v_pages = quantize_pages(k_pages, kv_dtype), quantize_pages(v_pages, kv_dtype)
    q = jax.random.normal(jax.random.key(1), (config["batch"], config["q_heads"], config["head_dim"]), jnp.bfloat16)
    page_bytes = cache_bytes(k_pages) // kv_quant.values(k_pages).shape[0]  # values and scales of one page
    needed = 2 * pages_in_use * page_bytes + 2 * q.nbytes + block_table.nbytes + 4 * config["batch"]
    return (q, k_pages, v_pages, block_table, jnp.asarray(seq_lens)), needed


def bench_decode(report, config, rng, interpret, with_reference, runs):
    """Decode rows (one per kernel family) for each (context, kv dtype) of `runs`, appended to
    report["decode"] as measured; each compared with the plain-jnp reference's output."""
    for context, kv_dtype in runs:
        label = f"decode/{kv_dtype}/{context}"
        with report.guard(f"{label}/reference"):
            args, needed = decode_problem(config, rng, context, kv_dtype)
            reference_fn = jax.jit(reference.paged_decode_attention)
            expected = np.asarray(reference_fn(*args), np.float32)
            ref_seconds = time_call(reference_fn, *args, repeats=config["repeats"]) if with_reference else None
            for family, seconds, difference in run_backends(report, label, dispatch.decode_attention, args,
                                                            expected, interpret, config["repeats"]):
                row = {"backend": family, "kv_dtype": kv_dtype, "batch": config["batch"], "context": context,
                       "bytes": needed, "seconds": seconds, "gb_per_s": needed / seconds / 1e9,
                       "relative_diff_vs_reference": difference,
                       "fraction_of_copy_bandwidth": fraction(needed / seconds / 1e9, report, "copy", "gb_per_s")}
                if ref_seconds:
                    row.update(reference_seconds=ref_seconds, reference_gb_per_s=needed / ref_seconds / 1e9)
                report.append("decode", row)
            del args, expected


def fraction(value, report, key, field):
    """value / report[key][field] (a ceiling measured earlier), None when that was not measured."""
    ceiling = report.get(key, {}).get(field)
    return value / ceiling if ceiling else None


def causal_attention_flops(query_lens, q_heads, head_dim):
    """2 matmuls x 2 flops per multiply-add over the keys each query may see."""
    visible = sum(n * (n + 1) // 2 for n in query_lens)
    return 4 * visible * q_heads * head_dim


def bench_ragged(report, config, rng, interpret, with_reference):
    """Ragged rows (one per kernel family): causal prefills, each compared with the reference's output."""
    lengths = [config["prefill_len"]] * config["prefills"]
    with report.guard("ragged/reference"):
        seq_lens = np.asarray(lengths, np.int32)
        shape = (config["page_size"], config["kv_heads"], config["head_dim"])
        k_pages, v_pages, block_table, _ = paged_cache(rng, seq_lens, shape, jnp.bfloat16)
        q = jax.random.normal(jax.random.key(2), (sum(lengths), config["q_heads"], config["head_dim"]), jnp.bfloat16)
        query_start_loc = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
        args = (q, k_pages, v_pages, block_table, jnp.asarray(seq_lens), query_start_loc)
        flops = causal_attention_flops(lengths, config["q_heads"], config["head_dim"])
        reference_fn = jax.jit(reference.ragged_paged_attention)
        expected = np.asarray(reference_fn(*args), np.float32)
        ref_seconds = time_call(reference_fn, *args, repeats=config["repeats"]) if with_reference else None
        for family, seconds, difference in run_backends(report, "ragged", dispatch.ragged_attention, args, expected,
                                                        interpret, config["repeats"]):
            row = {"backend": family, "prefills": config["prefills"], "prefill_len": config["prefill_len"],
                   "flops": flops, "seconds": seconds, "tflop_per_s": flops / seconds / 1e12,
                   "relative_diff_vs_reference": difference,
                   "fraction_of_matmul_rate": fraction(flops / seconds / 1e12, report, "matmul", "tflop_per_s")}
            if ref_seconds:
                row.update(reference_seconds=ref_seconds, reference_tflop_per_s=flops / ref_seconds / 1e12)
            report.append("ragged", row)


def routed_rows(rng, num_experts, top_k, tokens):
    """Group sizes [E] of `tokens` tokens each routed to top_k distinct random experts, and how
    many experts got at least one row."""
    chosen = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(tokens)])  # [tokens, k]
    sizes = np.bincount(chosen.reshape(-1), minlength=num_experts).astype(np.int32)
    return jnp.asarray(sizes), int(np.count_nonzero(sizes))


def bench_grouped(report, config, rng, interpret):
    """The Pallas grouped matmul against jax.lax.ragged_dot (bf16, XLA's own lowering: the
    independent result) on each case of config["grouped"], each case in its own guard."""
    for name, num_experts, k, n, top_k, tokens in config["grouped"]:
        label = f"grouped_matmul/{name}/{tokens}"
        with report.guard(label):
            rows = tokens * top_k
            group_sizes, experts_used = routed_rows(rng, num_experts, top_k, tokens)
            key_lhs, key_rhs = jax.random.split(jax.random.key(int(rng.integers(2**31))))
            lhs = jax.random.normal(key_lhs, (rows, k), jnp.bfloat16)
            rhs = (jax.random.normal(key_rhs, (num_experts, k, n), jnp.float32) / math.sqrt(k)).astype(jnp.bfloat16)
            kernel = jax.jit(lambda *a: grouped_matmul.grouped_matmul(*a, interpret=interpret))
            xla = jax.jit(jax.lax.ragged_dot)
            difference = relative_difference(kernel(lhs, rhs, group_sizes), xla(lhs, rhs, group_sizes))
            report.check(label, "ok" if difference <= TOLERANCE else "differ", relative_difference=difference,
                         tolerance=TOLERANCE)
            seconds = time_call(kernel, lhs, rhs, group_sizes, repeats=config["repeats"])
            xla_seconds = time_call(xla, lhs, rhs, group_sizes, repeats=config["repeats"])
            needed = (experts_used * k * n + rows * (k + n)) * 2  # routed experts' weights, rows in and out (bf16)
            flops = 2 * rows * k * n
            report.append("grouped_matmul", {
                "case": name, "experts": num_experts, "k": k, "n": n, "top_k": top_k, "tokens": tokens, "rows": rows,
                "experts_routed": experts_used, "bytes": needed, "flops": flops, "relative_diff_vs_xla": difference,
                "seconds": seconds, "gb_per_s": needed / seconds / 1e9, "tflop_per_s": flops / seconds / 1e12,
                "xla_seconds": xla_seconds, "xla_gb_per_s": needed / xla_seconds / 1e9,
                "kernel_speedup_over_xla": xla_seconds / seconds,
                "fraction_of_copy_bandwidth": fraction(needed / seconds / 1e9, report, "copy", "gb_per_s"),
                "fraction_of_matmul_rate": fraction(flops / seconds / 1e12, report, "matmul", "tflop_per_s")})
            del lhs, rhs


# Largest |8-bit path - float32 product on its own weights| / largest |product| (the activations'
# rounding alone: int8's 1/254 of a row's range, e4m3's 3 significant bits), as tests/test_gpu_prompt_activations.py.
ACTIVATION_TOLERANCE = {"bfloat16": TOLERANCE, "int8": 0.02, "fp8": 0.08}


def bench_prompt_activations(report, config, rng):
    """A prompt chunk's matmul on 8-bit weights in each --gpu_prompt_dtype, as the step runs it
    (quantization.linear): bfloat16 (the int8 weight dequantized, x in bfloat16), int8 (rows
    quantized to int8 per row times the per-channel int8 codes, int32 sums) and fp8 (rows in e4m3
    times e4m3 weights, float32 sums), on each case of config["prompt_matmul"]: seconds, TFLOP/s,
    the speedup over bfloat16, and each output against the float32 product of the same rows with
    that path's own (dequantized) weights, which isolates what its activations cost."""
    from jaxserve.models import prompt_matmul, quantization
    for name, rows, k, n in config["prompt_matmul"]:
        label = f"prompt_matmul/{name}"
        with report.guard(label):
            keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), 2)
            x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
            w = jax.random.normal(keys[1], (k, n), jnp.float32) / math.sqrt(k)
            int8 = quantization.quantize(w, quantization.QuantFormat(8, None))
            fp8_scale = jnp.max(jnp.abs(w), axis=0, keepdims=True) / prompt_matmul.FP8_MAX
            fp8 = quantization.QuantArray((w / fp8_scale).astype(jnp.float8_e4m3fn), fp8_scale)
            paths = {"bfloat16": (int8, jax.jit(lambda x, q, s: x @ quantization.dequantize(
                                     quantization.QuantArray(q, s), x.dtype))),
                     "int8": (int8, jax.jit(lambda x, q, s: prompt_matmul.quantized_activations_linear(x, q, s, "int8"))),
                     "fp8": (fp8, jax.jit(lambda x, q, s: prompt_matmul.quantized_activations_linear(x, q, s, "fp8")))}
            flops = 2 * rows * k * n
            row = report.append("prompt_matmul", {"case": name, "rows": rows, "k": k, "n": n, "flops": flops})
            for dtype, (weight, matmul) in paths.items():
                with report.guard(f"{label}/{dtype}"):
                    exact = jnp.dot(x.astype(jnp.float32), quantization.dequantize(weight),
                                    precision=jax.lax.Precision.HIGHEST)
                    difference = relative_difference(matmul(x, weight.q, weight.scale), np.asarray(exact))
                    report.check(f"{label}/{dtype}", "ok" if difference <= ACTIVATION_TOLERANCE[dtype] else "differ",
                                 relative_difference=difference, tolerance=ACTIVATION_TOLERANCE[dtype])
                    seconds = time_call(matmul, x, weight.q, weight.scale, repeats=config["repeats"])
                    row[f"{dtype}_seconds"], row[f"{dtype}_relative_diff"] = seconds, difference
                    row[f"{dtype}_tflop_per_s"] = flops / seconds / 1e12
                    if dtype != "bfloat16" and row.get("bfloat16_seconds"):
                        row[f"{dtype}_speedup_over_bfloat16"] = row["bfloat16_seconds"] / seconds
                    report.write()
            del x, w, int8, fp8


def lora_backends(interpret):
    """The dispatch names of the multi-LoRA update's paths: XLA's, the Triton kernel's and, where
    this jax has Mosaic GPU, the Mosaic kernel's."""
    return {"xla": "xla", **kernel_backends(interpret)}


def bench_lora(report, config, rng, interpret):
    """Each multi-LoRA path (lora_backends) on each case of config["lora"]: bf16 rows, a stacked slab
    of 2 layers read at layer 1, every row's slot drawn from [0, adapters] (0: a base row); each
    output against the reference on that layer's matrices, each path in its own guard."""
    for name, rows, k, n, rank, adapters in config["lora"]:
        label = f"lora/{name}"
        with report.guard(f"{label}/reference"):
            slots_in_use = adapters + 1
            keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), 3)
            x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
            a = (jax.random.normal(keys[1], (2, slots_in_use, k, rank)) / math.sqrt(k)).astype(jnp.bfloat16)
            b = (jax.random.normal(keys[2], (2, slots_in_use, rank, n)) / math.sqrt(rank)).astype(jnp.bfloat16)
            a, b = a.at[:, 0].set(0), b.at[:, 0].set(0)  # slot 0: the zero adapter
            slots = jnp.asarray(rng.integers(0, slots_in_use, rows), jnp.int32)
            layer = jnp.int32(1)
            expected = np.asarray(reference.lora_update(*(t.astype(jnp.float32) for t in (x, a[1], b[1])), slots))
            used = len(set(np.asarray(slots).tolist()) - {0})
            needed = (rows * (k + n) + used * rank * (k + n)) * 2 + rows * 4  # rows in and out, used A and B, slots
            row = report.append("lora", {"case": name, "rows": rows, "k": k, "n": n, "rank": rank,
                                         "adapters": adapters, "adapters_used": used, "bytes": needed,
                                         "mosaic_takes": mosaic_lora.supports(x, a[1], b[1])})
            for family, backend in lora_backends(interpret).items():
                with report.guard(f"{label}/{family}"):
                    update = jax.jit(lambda *args, _b=backend: dispatch.lora_update(_b, *args))
                    difference = relative_difference(update(x, a, b, slots, layer), expected)
                    report.check(f"{label}/{family}", "ok" if difference <= TOLERANCE else "differ",
                                 relative_difference=difference, tolerance=TOLERANCE)
                    seconds = time_call(update, x, a, b, slots, layer, repeats=config["repeats"])
                    row[f"{family}_seconds"], row[f"{family}_relative_diff_vs_reference"] = seconds, difference
                    row[f"{family}_gb_per_s"] = needed / seconds / 1e9
                    if family != "xla" and row.get("xla_seconds"):
                        row[f"{family}_speedup_over_xla"] = row["xla_seconds"] / seconds
                    report.write()  # the row as it grows
            del x, a, b


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="path of the JSON report (written after every figure)")
    parser.add_argument("--interpret", action="store_true", help="Pallas interpret mode (no GPU)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--with-reference", action="store_true", help="also time the plain-jnp reference")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    require_gpu()
    if not args.interpret and jax.default_backend() != "gpu":
        print("error: the compiled kernels need a GPU; pass --interpret elsewhere", file=sys.stderr)
        return 2
    config = QUICK if args.quick else FULL
    rng = np.random.default_rng(0)
    report = StepReport(args.out, device=getattr(jax.devices()[0], "device_kind", str(jax.devices()[0])),
                        jax_version=jax.__version__, mode="interpret" if args.interpret else "compiled",
                        backends=list(kernel_backends(args.interpret)), tolerance=TOLERANCE,
                        shapes={k: v for k, v in config.items() if k != "repeats"})
    with report.guard("copy"):
        report.put("copy", copy_bandwidth(config["copy_mib"], config["repeats"]))
    with report.guard("matmul"):
        report.put("matmul", matmul_rate(config["matmul"], config["repeats"]))
    # Most valuable first: 16-bit decode at every context, the ragged prefill, the MoE grouped matmul,
    # the prompt matmuls with 8-bit activations, then decode over quantized pages, then the multi-LoRA update.
    bench_decode(report, config, rng, args.interpret, args.with_reference,
                 [(context, "bfloat16") for context in config["contexts"]])
    bench_ragged(report, config, rng, args.interpret, args.with_reference)
    bench_grouped(report, config, rng, args.interpret)
    bench_prompt_activations(report, config, rng)
    bench_decode(report, config, rng, args.interpret, args.with_reference,
                 [(context, kind) for context in config["quantized_contexts"] for kind in ("int8", "fp8")])
    bench_lora(report, config, rng, args.interpret)
    print(json.dumps(report, indent=2, default=str))
    return report.exit_status()


if __name__ == "__main__":
    sys.exit(main())
