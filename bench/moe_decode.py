"""Decode step time of a mixture-of-experts model against dense models of its active and of its
total parameter bytes: does a decode step cost what it routes to?

Three random-weight float32 models share everything but the MLP (hidden 1024, 4 layers, 8 query
heads and 2 KV heads of 128, vocabulary 2048):
  moe            16 experts of intermediate size 512, top-2 (renormalised), a router;
  dense-active   one MLP of intermediate size 2 * 512: the MoE's active parameter bytes per token;
  dense-total    one MLP of intermediate size 16 * 512: the MoE's total parameter bytes.
Each decode step is the jitted model forward with its paged KV cache (llama.forward on the
weights as the engine's step reads them, cpu_layout.layer_views, as bench/step_profile.py does)
at 1, 8 and 64 rows with contexts of 64-128 tokens; the models' steps of one row count are timed
in turns (medians of `--repeats` steps in each of `--rounds` rounds). The MoE runs twice: with
the grouped-matmul backend jaxserve uses on the CPU ("xla": the loop over routed experts,
pallas_kernels.xla_grouped) and with jax.lax.ragged_dot ("ragged_dot": jax's CPU lowering, which
reads every expert and does 16x the FLOPs).

With --quantization (int8, int4, ...) every model's linear layers and experts are quantized
first (the MoE's experts multiplied at their stored size by the CPU loop), and "param_bytes"
is the stored bytes; the MLP byte columns stay the float32 ones.

  python bench/moe_decode.py --out bench/out/moe_decode.json
  python bench/moe_decode.py --quantization=int8 --out bench/out/moe_decode_int8.json
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.step_profile import decode_batch, interleaved_seconds  # noqa: E402

EXPERTS, TOP_K, EXPERT_FFN = 16, 2, 512


def model_configs():
    """{name: ModelConfig} of the three models (see the module docstring)."""
    from jaxserve.config import ModelConfig

    base = ModelConfig(vocab_size=2048, hidden_size=1024, intermediate_size=TOP_K * EXPERT_FFN, num_layers=4,
                       num_q_heads=8, num_kv_heads=2, head_dim=128, max_position_embeddings=1024)
    moe = dataclasses.replace(base, architecture="Qwen3MoeForCausalLM", num_experts=EXPERTS,
                              num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_FFN, norm_topk_prob=True)
    return {"moe": moe, "dense-active": base,
            "dense-total": dataclasses.replace(base, intermediate_size=EXPERTS * EXPERT_FFN)}


def mlp_bytes(config, per_token: bool) -> int:
    """Float32 bytes of the MLP weights of all layers: all of them, or those one token reads."""
    d = config.hidden_size
    if not config.is_moe:
        return 4 * config.num_layers * 3 * d * config.intermediate_size
    experts = config.num_experts_per_tok if per_token else config.num_experts
    return 4 * config.num_layers * (3 * d * config.moe_intermediate_size * experts + d * config.num_experts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,64", help="comma list of decode row counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantization", default=None,
                        help="quantize every model's linear layers and experts (e.g. int8, int4) before timing")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jaxserve.models import cpu_layout, llama, quantization, weights
    from jaxserve import environment

    info = common.machine_info(with_jax=True)
    configs = model_configs()
    stacked = {name: weights.random_params(config, jnp.float32, seed=i) for i, (name, config) in enumerate(configs.items())}
    if args.quantization:
        stacked = {name: quantization.quantize_params(tree, args.quantization, configs[name])
                   for name, tree in stacked.items()}
    params = {name: cpu_layout.layer_views(tree) for name, tree in stacked.items()}  # as the engine's step reads them
    page_size, max_pages = 16, 8
    row_counts = [int(r) for r in args.rows.split(",")]
    num_pages = max(row_counts) * max_pages + 1
    caches = {name: llama.init_kv_cache(config, llama.KVCacheSpec(num_pages, page_size), jnp.float32)
              for name, config in configs.items()}

    def step_run(name, config, batch, grouped_backend=None):
        """A warm, compiled decode step of model `name` (traced with the given grouped-matmul backend)."""
        saved = os.environ.get(environment.GROUPED_MATMUL_BACKEND)
        if grouped_backend:
            os.environ[environment.GROUPED_MATMUL_BACKEND] = grouped_backend
        try:
            forward = jax.jit(functools.partial(llama.forward, config=config, backend="xla"), donate_argnums=(1,))
            compiled = forward.lower(params[name], caches[name], batch).compile()
        finally:
            if saved is None:
                os.environ.pop(environment.GROUPED_MATMUL_BACKEND, None)
            else:
                os.environ[environment.GROUPED_MATMUL_BACKEND] = saved

        def run():
            logits, caches[name] = compiled(params[name], caches[name], batch)
            logits.block_until_ready()
        return run

    results = []
    for rows in row_counts:
        batch = decode_batch(rows, 64, 128, page_size, num_pages, max_pages, seed=rows)
        runs = {"moe (xla: loop over routed experts)": step_run("moe", configs["moe"], batch, "xla"),
                "moe (ragged_dot)": step_run("moe", configs["moe"], batch, "ragged_dot"),
                "dense-active": step_run("dense-active", configs["dense-active"], batch),
                "dense-total": step_run("dense-total", configs["dense-total"], batch)}
        seconds = interleaved_seconds(runs, args.repeats, args.rounds)
        expected_experts = EXPERTS * (1 - (1 - TOP_K / EXPERTS) ** rows)  # distinct experts, uniform routing
        results.append({"rows": rows, "step_ms": {k: 1e3 * v for k, v in seconds.items()},
                        "expected_experts_routed_per_layer": expected_experts})
        print(f"{rows:>3} rows: " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in seconds.items())
              + f"; ~{expected_experts:.1f} of {EXPERTS} experts routed per layer", flush=True)

    models = {name: {"param_bytes": quantization.tree_bytes(stacked[name]),
                     "mlp_bytes": mlp_bytes(config, per_token=False),
                     "mlp_bytes_per_token": mlp_bytes(config, per_token=True)}
              for name, config in configs.items()}
    print(common.machine_line(info))
    for name, m in models.items():
        print(f"{name}: weights {m['param_bytes'] / 2**20:.0f} MiB, MLP {m['mlp_bytes'] / 2**20:.0f} MiB, MLP read per "
              f"token {m['mlp_bytes_per_token'] / 2**20:.0f} MiB")
    common.write_json(args.out, {"machine": info, "quantization": args.quantization, "models": models, "results": results,
                                 "experts": EXPERTS, "top_k": TOP_K, "expert_intermediate_size": EXPERT_FFN})
    return 0


if __name__ == "__main__":
    sys.exit(main())
