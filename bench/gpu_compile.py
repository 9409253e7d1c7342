"""The GPU build compiled for every bucket of big models, on a machine without a GPU.

For each (model, target, tensor parallel size): the memory plan at 0.9 of the GPU's memory, every
step bucket and sampler shape compiled (XLA temp / argument bytes next to the planner's estimate,
compile seconds, Pallas kernel calls), and ptxas's report of both kernels at their shipped block
sizes. Needs the gpu-compile extra (`make install-gpu-compile`, then .venv-gpu-compile/bin/python).

    python bench/gpu_compile.py --out=bench/out/gpu_compile.json            # the full sweep
    python bench/gpu_compile.py --quick --out=bench/out/gpu_compile.json    # corner buckets only
    python bench/gpu_compile.py --quick --small --runs=llama-3-8b:h200:1 --out=/tmp/c.json  # CPU rehearsal

`--small` keeps the models, targets and code path and shrinks only the engine's limits (8 sequences,
64 batched tokens, 2 prefills, 256-token context): with `--quick`, 9 shapes instead of 14, for the dry
run of bench/gpu_check.sh on a 2-core CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxserve import platforms  # noqa: E402

platforms.default_to_cpu_without_gpu()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxserve.config import EngineConfig, ModelConfig  # noqa: E402
from jaxserve.planning import gpu_compile  # noqa: E402
from pallas_kernels import compat, mosaic_decode, mosaic_ragged  # noqa: E402
from pallas_kernels.paged_decode import paged_decode_attention  # noqa: E402
from pallas_kernels.ragged_prefill import ragged_paged_attention  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
MODELS = {
    "llama-3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                              num_q_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
                              rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    "llama-3-70b": ModelConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                               num_q_heads=64, num_kv_heads=8, head_dim=128, max_position_embeddings=8192,
                               rope_theta=500000.0, rope_scaling=LLAMA3_ROPE),
    "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                num_q_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=2048,
                                tie_word_embeddings=True),
}
# The engine limits of each run (the defaults a GPU serves with), and --small's.
LIMITS = dict(max_num_seqs=256, max_num_batched_tokens=2048, max_num_prefill_seqs=4, max_model_len=8192)
SMALL_LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_num_prefill_seqs=2, max_model_len=256)
RUNS = [("llama-3-8b", "h100", 1), ("llama-3-8b", "h200", 1), ("llama-3-70b", "h100", 8), ("smollm2-135m", "h100", 1)]


def kernel_report(config: ModelConfig, target: str) -> list[dict]:
    """ptxas on both attention kernels at the model's head shapes and the default block sizes
    (bf16): the Triton lowering's, and beside them Mosaic GPU's where this jax has it."""
    mesh = gpu_compile.gpu_mesh(target, 1)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
    pages = spec((4096, 16, config.num_kv_heads, config.head_dim), jnp.bfloat16)
    decode = (spec((256, config.num_q_heads, config.head_dim), jnp.bfloat16), pages, pages,
              spec((256, 512), jnp.int32), spec((256,), jnp.int32))
    ragged = (spec((2048, config.num_q_heads, config.head_dim), jnp.bfloat16), pages, pages,
              spec((4, 512), jnp.int32), spec((4,), jnp.int32), spec((5,), jnp.int32))
    kernels = [(paged_decode_attention, decode), (ragged_paged_attention, ragged)]
    if compat.has_mosaic_gpu():
        kernels += [(mosaic_decode.paged_decode_attention, decode), (mosaic_ragged.ragged_paged_attention, ragged)]
    return [vars(r) for function, args in kernels for r in gpu_compile.kernel_reports(jax.jit(function), args, mesh, target)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="the smallest and largest bucket of each kind only")
    parser.add_argument("--small", action="store_true",
                        help="small engine limits, fewer buckets, same models and code path (CPU rehearsal)")
    parser.add_argument("--workers", type=int, default=None,
                        help="shapes compiled at once (compile_for_gpu's workers; default: the cores, 1: one at a time)")
    parser.add_argument("--runs", default=",".join(f"{m}:{t}:{tp}" for m, t, tp in RUNS),
                        help="model:target:tensor_parallel_size, comma-separated")
    parser.add_argument("--attention_backend", default="pallas", choices=("pallas", "triton", "mosaic"),
                        help="the engine's kernels: pallas (= triton) or mosaic (jax >= 0.11)")
    args = parser.parse_args()
    gpu_compile.check_available()
    results = {"machine": f"{platform.processor() or platform.machine()} x{os.cpu_count()}, "
                          f"Python {platform.python_version()}, jax {jax.__version__}", "runs": []}
    for run in args.runs.split(","):
        name, target, tp = run.split(":")
        config = MODELS[name]
        start = time.perf_counter()
        limits = SMALL_LIMITS if args.small else LIMITS
        engine_config = EngineConfig(attention_backend=args.attention_backend, tensor_parallel_size=int(tp), **{
            **limits, "max_model_len": min(config.max_position_embeddings, limits["max_model_len"])})
        report = gpu_compile.compile_for_gpu(config, engine_config, target=target,
                                             which_buckets="ends" if args.quick else "all", workers=args.workers)
        shapes = report["compile"]["buckets"] + report["compile"]["sampler"]
        largest_temp = max(s["temp_bytes"] for s in shapes)
        summary = {"model": name, "target": target, "tensor_parallel_size": int(tp), "small": args.small,
                   "num_shapes": len(shapes), "num_failed": sum(not s["ok"] for s in shapes),
                   "seconds": round(time.perf_counter() - start, 1), "workers": report["compile"]["workers"],
                   "compile_wall_seconds": report["compile"]["wall_seconds"], "num_pages": report["plan"]["num_pages"],
                   "planned_activation_bytes": report["plan"]["activation_bytes"],
                   "largest_xla_temp_bytes": largest_temp,
                   "planned_over_largest_temp": round(report["plan"]["activation_bytes"] / largest_temp, 3),
                   "kernels": kernel_report(config, target)}
        print(json.dumps({k: v for k, v in summary.items() if k != "kernels"}), flush=True)
        results["runs"].append({**summary, "report": report})
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:  # after each run: a long sweep keeps what it finished
            json.dump(results, f, indent=1)
    return 1 if any(r["num_failed"] for r in results["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
