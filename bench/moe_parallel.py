"""Expert parallelism against tensor parallelism for a mixture-of-experts decode step, on fake CPU devices.

    .venv/bin/python bench/moe_parallel.py [--devices=4] [--steps=15] [--out=bench/out/moe_parallel.json]

A random Qwen3-MoE-shaped model (4 layers, 256 wide, 8 query / 4 KV heads of 32, 16 experts of
intermediate size 512, top-2, vocabulary 2048; float32) runs decode steps of 1, 8 and 64 rows
(each row at position 63 of its own pages) through `llama.forward` on one device, with its experts
split on their intermediate size over N devices (TP, the default) and with whole experts spread
over them (EP, --enable_expert_parallel); attention is split on heads in both. Also timed: one
layer's mixture-of-experts block alone (`moe.sparse_mlp` on [rows, 256]). Each figure is the median
of --steps calls after two warm-up calls (compile excluded); the collectives columns count the
collective ops in each compiled program (XLA's optimized HLO; the step's layers run under a scan,
so its loop body appears once).

The N devices are XLA's fake CPU devices (--xla_force_host_platform_device_count) sharing this
machine's cores: the collectives are memory copies and the devices compete for the same cores,
so the figures compare the two layouts' computation and communication structure, not what a GPU
would measure.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS = (1, 8, 64)
CONTEXT, PAGE_SIZE = 64, 16
MODEL = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=2048, hidden_size=256, intermediate_size=512,
             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
             max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=512,
             norm_topk_prob=True)


def decode_batch(rows: int, vocab: int, rng):
    """`rows` decode rows at position CONTEXT - 1, row i on pages 1 + i * pages_per_row ... -> (batch, pages)."""
    import numpy as np
    per_row = CONTEXT // PAGE_SIZE
    table = (1 + np.arange(rows * per_row, dtype=np.int32)).reshape(rows, per_row)
    pos = CONTEXT - 1
    batch = dict(
        token_ids=rng.integers(3, vocab, rows).astype(np.int32),
        positions=np.full(rows, pos, np.int32),
        slot_mapping=(table[:, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE).astype(np.int32),
        decode_block_table=table, decode_seq_lens=np.full(rows, CONTEXT, np.int32),
        prefill_block_table=np.zeros((0, per_row), np.int32), prefill_seq_lens=np.zeros(0, np.int32),
        prefill_query_start_loc=np.zeros(1, np.int32), logits_indices=np.arange(rows, dtype=np.int32))
    return batch, 1 + rows * per_row


def median_ms(fn, steps: int) -> float:
    import jax
    for _ in range(2):
        jax.block_until_ready(fn())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def collectives(fn, *args) -> str:
    """The collectives in `fn`'s compiled program for `args` (XLA's optimized HLO), e.g. "2 all-reduce"."""
    import re
    text = fn.lower(*args).compile().as_text()
    names = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
    counts = {name: len(re.findall(rf" {name}(?:-start)?\(", text)) for name in names}
    return ", ".join(f"{n} {name}" for name, n in counts.items() if n) or "none"


def measure(devices: int, steps: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxserve.config import ModelConfig
    from jaxserve.models import llama, moe, weights
    from jaxserve.parallel import sharding

    config = ModelConfig.from_hf_dict(MODEL)
    params = weights.random_params(config, seed=3)
    layouts = {"1 device": None, f"TP {devices}": False, f"EP {devices}": True}
    results = []
    for layout, expert_parallel in layouts.items():
        mesh = shardings = None
        if expert_parallel is not None:
            mesh = sharding.replica_meshes(sharding.make_mesh(config, devices, expert_parallel=expert_parallel))[0]
            shardings = sharding.ModelShardings.create(config, mesh, expert_parallel=expert_parallel)
        run = shardings.model_config if shardings else config
        placed = shardings.place(params) if shardings else params
        layer0 = {name: w[0] for name, w in placed["layers"].items()}  # one layer's weights, in their layout
        if shardings:
            layer0 = {name: jax.device_put(w, NamedSharding(mesh, P(*shardings.params["layers"][name].spec[1:])))
                      for name, w in layer0.items()}
        step = jax.jit(lambda p, k, b: llama.forward(p, k, b, config=run, mesh=mesh)[0])
        block = jax.jit(lambda lp, h: moe.sparse_mlp(lp, h, run, mesh))
        for rows in ROWS:
            batch, num_pages = decode_batch(rows, config.vocab_size, np.random.default_rng(rows))
            batch = {k: jnp.asarray(v) for k, v in batch.items()}
            kv = llama.init_kv_cache(run, llama.KVCacheSpec(num_pages=num_pages, page_size=PAGE_SIZE), jnp.float32,
                                     shardings.kv_cache if shardings else None)
            h = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, config.hidden_size)), jnp.float32)
            step_ms = median_ms(lambda: step(placed, kv, batch), steps)
            block_ms = median_ms(lambda: block(layer0, h), steps)
            results.append({"layout": layout, "rows": rows, "step_ms": step_ms, "moe_block_ms": block_ms,
                            "step_collectives": collectives(step, placed, kv, batch),
                            "block_collectives": collectives(block, layer0, h)})
            print(f"{layout:>9}  rows {rows:3d}  step {step_ms:8.2f} ms  moe block {block_ms:7.2f} ms",
                  file=sys.stderr, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    # Fake CPU devices: must be set before jax is imported.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, REPO)
    from bench.common import format_table, machine_info, machine_line, write_json
    results = measure(args.devices, args.steps)
    info = machine_info(with_jax=True)
    info["jax_devices"] = len(info["jax_devices"])
    print(machine_line(info))
    print(format_table(results, [("layout", "layout", "s"), ("rows", "rows", "d"), ("step_ms", "decode step ms", ".2f"),
                                 ("moe_block_ms", "one MoE block ms", ".2f"),
                                 ("step_collectives", "step collectives", "s"),
                                 ("block_collectives", "block collectives", "s")]))
    write_json(args.out, {"machine": info, "model": MODEL, "steps": args.steps, "results": results})


if __name__ == "__main__":
    main()
