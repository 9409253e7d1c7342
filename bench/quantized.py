"""Quantized weights and KV pages, side by side: tokens/s and bytes of SmolLM2 on this machine.

One decode-heavy workload (default 32 random-token prompts x 64 tokens in, 128 greedy tokens out,
ignore_eos) through `Engine.generate` for each variant: float weights, int8 weights (per output
channel; int8_g32_zp: groups of 32 with a zero point), int4 weights (groups of 32 with a zero
point), and an int8 KV cache (per-token scales).
A warm pass of the same prompts (3 output tokens) compiles the step shapes first; the best of
`--repeats` timed passes gives output tokens/s and decode-step time (other processes on a shared
machine only ever slow a pass down); the bytes of the weights and of the KV cache come along.

  python bench/quantized.py --out bench/out/quantized.json
  python bench/quantized.py --num_prompts=4 --output_len=8 --variants=float,int4   # smoke test
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

VARIANTS = {  # name -> EngineConfig overrides
    "float": {},
    "int8": {"quantization": "int8"},
    "int8_g32_zp": {"quantization": "int8_g32_zp"},
    "int4": {"quantization": "int4"},
    "kv_int8": {"kv_cache_dtype": "int8"},
    "int4+kv_int8": {"quantization": "int4", "kv_cache_dtype": "int8"},
    "kv_fp8": {"kv_cache_dtype": "fp8"},
}


def workload(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab_size, input_len).tolist() for _ in range(num_prompts)]


def record_steps(engine) -> list[tuple[int, int, float]]:
    """A list that gets (decode rows, prefill tokens, device seconds) of every step (the engine's StepRecords)."""
    steps: list[tuple[int, int, float]] = []
    engine.add_step_listener(lambda record: steps.append(
        (record.num_decode_rows, record.num_prefill_tokens, record.device_seconds)))
    return steps


def run_variant(name: str, model_config, params, args) -> dict:
    import jax

    from jaxserve.core.request import SamplingParams
    from jaxserve.engine import Engine, EngineConfig
    from jaxserve.models import quantization
    from jaxserve.models import weights
    from jaxserve.planning import memory

    max_model_len = args.input_len + args.output_len + 16
    cfg = EngineConfig(max_num_seqs=args.num_prompts, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_num_prefill_seqs=1, max_model_len=max_model_len, warmup=False,
                       enable_prefix_caching=False, **VARIANTS[name])
    start = time.perf_counter()
    engine = Engine(model_config, params, None, cfg)
    setup_s = time.perf_counter() - start
    prompts = workload(args.num_prompts, args.input_len, model_config.vocab_size, args.seed)
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    warm_s = time.perf_counter() - start
    steps = record_steps(engine)
    passes = []
    for _ in range(args.repeats):
        steps.clear()
        start = time.perf_counter()
        results = engine.generate(prompts, SamplingParams(max_tokens=args.output_len, temperature=0.0,
                                                          ignore_eos=True))
        passes.append((time.perf_counter() - start, list(steps)))
    elapsed, steps = min(passes, key=lambda p: p[0])
    output_tokens = sum(len(r.token_ids) for r in results)
    decode = [(rows, seconds) for rows, prefill, seconds in steps if prefill == 0]
    decode_s = sum(s for _, s in decode)
    stats = engine.stats()
    kv_dtype = cfg.kv_cache_dtype if cfg.kv_cache_dtype != "auto" else jax.numpy.dtype(params["embed"].dtype).name
    layers = engine.runner.params["layers"]
    linear_bytes = quantization.tree_bytes({k: layers[k] for k in weights.linear_leaves(model_config)})
    row = {
        "variant": name, "formats": sorted(set(quantization.params_formats(engine.runner.params).values())),
        "weights_bytes": stats.weights_bytes, "linear_bytes": linear_bytes,
        "kv_cache_dtype": kv_dtype, "kv_bytes_per_token": memory.kv_bytes_per_token(model_config, kv_dtype),
        "kv_cache_bytes": stats.kv_cache_bytes, "setup_s": setup_s, "warm_pass_s": warm_s,
        "elapsed_s": elapsed, "output_tokens": output_tokens, "output_tok_s": output_tokens / elapsed,
        "num_decode_steps": len(decode), "decode_step_ms": 1000 * decode_s / max(len(decode), 1),
        "decode_tok_s": sum(r for r, _ in decode) / decode_s if decode_s else float("nan"),
        "first_answer": results[0].token_ids[:8],
    }
    print(f"{name}: {row['output_tok_s']:.1f} output tok/s, decode step {row['decode_step_ms']:.0f} ms, "
          f"weights {row['weights_bytes'] / 2**20:.1f} MiB", file=sys.stderr, flush=True)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a converted model directory")
    parser.add_argument("--variants", default="float,int8,int4,kv_int8",
                        help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--num_prompts", type=int, default=32)
    parser.add_argument("--input_len", type=int, default=64)
    parser.add_argument("--output_len", type=int, default=128)
    parser.add_argument("--max_num_batched_tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per variant (best kept)")
    parser.add_argument("--out", default=None, help="JSON report path")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        print(f"quantized.py: unknown variants {unknown}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
        return 2

    import jax.numpy as jnp

    from checkpoints import default_model, load

    model_dir = default_model.resolve_model(args.model)
    model_config = load.load_config(model_dir)
    params = load.load_params(model_dir, jnp.float32)
    info = common.machine_info(with_jax=True)
    rows = [run_variant(name, model_config, params, args) for name in variants]
    float_row = next((r for r in rows if r["variant"] == "float"), rows[0])
    for row in rows:
        row["speedup_vs_float"] = row["output_tok_s"] / float_row["output_tok_s"]
        row["weights_mib"] = row["weights_bytes"] / 2**20
        row["linear_mib"] = row["linear_bytes"] / 2**20
    print(common.machine_line(info))
    print(f"workload: {args.num_prompts} prompts x {args.input_len} tokens in, {args.output_len} out (greedy, ignore_eos)")
    print(common.format_table(rows, [
        ("variant", "variant", "s"), ("weights_mib", "weights MiB", ".1f"), ("linear_mib", "linear MiB", ".1f"),
        ("kv_bytes_per_token", "KV B/token", "d"), ("output_tok_s", "out tok/s", ".1f"),
        ("decode_step_ms", "decode step ms", ".0f"), ("decode_tok_s", "decode tok/s", ".1f"),
        ("speedup_vs_float", "vs float", ".2f")]))
    common.write_json(args.out, {"machine": info, "args": vars(args), "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
