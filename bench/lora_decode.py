"""The decode step with LoRA adapters against the base model's step (issue 50's target: 4 adapters
of rank 16 among 32 decode rows cost at most 1.3x a base-only step on the CPU).

A SmolLM2-135M-shaped model with random weights (hidden 576, intermediate 1536, 30 layers, 9 query
and 3 KV heads of 64, vocabulary 49152, tied embeddings), its weights as the engine's step reads
them (cpu_layout.layer_views), 32 decode rows with contexts of 64-128 tokens. Three steps, timed
in turns (`--repeats` steps in each of `--rounds` rounds; medians, and minima, which other
processes' load disturbs least):
  base        llama.forward without a slab (the engine's step today);
  lora        with a slab of 4 adapters of rank 16 on all seven projections (max_loras 4,
              max_lora_rank 16), the rows' slots 0-4 in turn (a fifth of the rows base);
  lora-base   the same slab, every row on slot 0 (what a slab costs a step of base requests);
  lora-xla    lora with the update in xla_lora's one-hot form (the C++ kernel turned off while it
              is traced): the CPU path before the kernel, when the kernels are built.
With --quantization (int8, int4) the linear layers are quantized first (the LoRA arrays stay float32).

--forms also times the XLA forms of the update that pallas_kernels/xla_lora.py chose between, on
the 30 layers' seven projections alone (float32 matmuls of 32 rows, no attention, no lm_head):
the base matmuls, a per-row gather of A and B (the reference's form), two dense dots over every
slot under a one-hot mask (xla_lora's form), jax.lax.ragged_dot over rows sorted by slot, and the
C++ kernel (cpu_kernels.lora_update, rows grouped by slot, each through its own adapter only;
here on the scan's slices of the slab, where the step reads the stacked slab in place).

  python bench/lora_decode.py --forms --out bench/out/lora_decode.json
  python bench/lora_decode.py --quantization=int8 --out bench/out/lora_decode_int8.json
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.step_profile import decode_batch, interleaved_seconds  # noqa: E402

ROWS, MAX_LORAS, RANK = 32, 4, 16


def smollm2_config():
    from jaxserve.config import ModelConfig
    return ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_q_heads=9,
                       num_kv_heads=3, head_dim=64, tie_word_embeddings=True, max_position_embeddings=2048)


def random_slab(config, seed=0):
    """A slab with MAX_LORAS random adapters of rank RANK on every projection."""
    import jax.numpy as jnp

    from jaxserve.models import lora
    rng = np.random.default_rng(seed)
    slab = lora.init_slab(config, MAX_LORAS, RANK)
    for slot in range(1, MAX_LORAS + 1):
        arrays = {name: {side: (0.01 * rng.standard_normal(shape[:1] + shape[2:])).astype(np.float32)
                         for side, shape in pair.items()} for name, pair in lora.slab_shapes(config, MAX_LORAS, RANK).items()}
        slab = lora.write_slot(slab, slot, arrays)
    assert all(leaf.dtype == jnp.float32 for pair in slab.values() for leaf in pair.values())
    return slab


def step_runs(config, params, slab, batch, caches):
    """{name: run} of warm, compiled decode steps (see the module docstring)."""
    import contextlib
    from unittest import mock

    import jax

    import cpu_kernels
    from jaxserve.models import llama
    slots = {"lora": np.arange(ROWS, dtype=np.int32) % (MAX_LORAS + 1), "lora-base": np.zeros(ROWS, np.int32)}
    slots["lora-xla"] = slots["lora"]
    names = ("base", "lora", "lora-base") + (("lora-xla",) if cpu_kernels.available() else ())

    def run_of(name):
        forward = functools.partial(llama.forward, config=config, backend="xla")
        if name == "base":
            compiled = jax.jit(lambda p, c, b: forward(p, c, b), donate_argnums=(1,)).lower(params, caches[name],
                                                                                            batch).compile()
            call = lambda: compiled(params, caches[name], batch)  # noqa: E731
        else:
            lora_batch = {**batch, "lora_slots": slots[name]}
            without_kernel = mock.patch.object(cpu_kernels, "takes_lora_update", lambda *args: False)
            with without_kernel if name == "lora-xla" else contextlib.nullcontext():
                compiled = jax.jit(lambda p, c, b, s: forward(p, c, b, lora=s), donate_argnums=(1,)).lower(
                    params, caches[name], lora_batch, slab).compile()
            call = lambda: compiled(params, caches[name], lora_batch, slab)  # noqa: E731

        def run():
            logits, caches[name] = call()
            logits.block_until_ready()
        return run

    return {name: run_of(name) for name in names}


def form_runs(config, seed=0):
    """{form: run} of the 30 layers' seven projections of 32 rows with each XLA form of the update."""
    import jax
    import jax.numpy as jnp

    import cpu_kernels
    from jaxserve.models import lora
    from pallas_kernels import reference, xla_lora
    rng = np.random.default_rng(seed)
    shapes = lora.projection_shapes(config)
    L, S = config.num_layers, MAX_LORAS + 1
    w = {n: jnp.asarray(rng.standard_normal((L, i, o)) / np.sqrt(i), jnp.float32) for n, (i, o) in shapes.items()}
    slab = {n: {"a": jnp.asarray(0.01 * rng.standard_normal((L, S, i, RANK)), jnp.float32).at[:, 0].set(0),
                "b": jnp.asarray(0.01 * rng.standard_normal((L, S, RANK, o)), jnp.float32).at[:, 0].set(0)}
            for n, (i, o) in shapes.items()}
    x0 = jnp.asarray(rng.standard_normal((ROWS, config.hidden_size)), jnp.float32)
    slots = jnp.asarray(np.arange(ROWS) % S, jnp.int32)

    def ragged(x, a, b, s):
        order = jnp.argsort(s)
        sizes = jnp.bincount(s, length=S).astype(jnp.int32)
        y = jax.lax.ragged_dot(jax.lax.ragged_dot(x[order], a, sizes), b, sizes)
        return jnp.zeros_like(y).at[order].set(y)

    forms = {"base matmuls": None, "gather (per-row A, B)": reference.lora_update,
             "one-hot dense dots (xla_lora)": xla_lora.lora_update, "ragged_dot (rows sorted)": ragged}
    if cpu_kernels.available():
        forms["C++ kernel (cpu_kernels, rows by slot)"] = cpu_kernels.lora_update

    def make(update):
        def layer(x, scanned):
            lw, ls = scanned
            x = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5)

            def proj(h, n):
                y = h @ lw[n]
                return y if update is None else y + update(h, ls[n]["a"], ls[n]["b"], slots)
            q, k, v = proj(x, "wq"), proj(x, "wk"), proj(x, "wv")
            x = x + proj(q, "wo") + 0 * (k.sum() + v.sum())
            return x + proj(jax.nn.silu(proj(x, "w_gate")) * proj(x, "w_up"), "w_down"), None
        compiled = jax.jit(lambda x, w, s: jax.lax.scan(layer, x, (w, s))[0]).lower(x0, w, slab).compile()
        return lambda: compiled(x0, w, slab).block_until_ready()

    return {name: make(update) for name, update in forms.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantization", default=None, help="quantize the linear layers first (int8, int4, ...)")
    parser.add_argument("--forms", action="store_true", help="also time the XLA forms of the update")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import jax.numpy as jnp

    from jaxserve.models import cpu_layout, llama, quantization, weights

    info = common.machine_info(with_jax=True)
    config = smollm2_config()
    stacked = weights.random_params(config, jnp.float32, seed=0)
    if args.quantization:
        stacked = quantization.quantize_params(stacked, args.quantization, config)
    params = cpu_layout.layer_views(stacked)  # as the engine's step reads them
    page_size, max_pages = 16, 8
    num_pages = ROWS * max_pages + 1
    caches = {name: llama.init_kv_cache(config, llama.KVCacheSpec(num_pages, page_size), jnp.float32)
              for name in ("base", "lora", "lora-base", "lora-xla")}
    batch = decode_batch(ROWS, 64, 128, page_size, num_pages, max_pages, seed=ROWS)
    samples = interleaved_seconds(step_runs(config, params, random_slab(config), batch, caches),
                                  args.repeats, args.rounds, reduce=list)
    result = {}
    for statistic, reduce in (("median", np.median), ("min", np.min)):  # min: the least disturbed by load
        seconds = {name: float(reduce(times)) for name, times in samples.items()}
        ratios = {f"{name} / base": value / seconds["base"] for name, value in seconds.items() if name != "base"}
        result[statistic] = {"step_ms": {k: 1e3 * v for k, v in seconds.items()},
                             "lora_over_base": seconds["lora"] / seconds["base"],
                             "lora_base_rows_over_base": seconds["lora-base"] / seconds["base"],
                             "over_base": ratios}
        print(f"{statistic}: " + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in seconds.items())
              + "; " + ", ".join(f"{k} {v:.2f}" for k, v in ratios.items()), flush=True)
    if args.forms:
        form_seconds = interleaved_seconds(form_runs(config), args.repeats, args.rounds)
        base = form_seconds["base matmuls"]
        result["forms_ms"] = {k: 1e3 * v for k, v in form_seconds.items()}
        for name, value in form_seconds.items():
            print(f"  {name}: {1e3 * value:.2f} ms ({value / base:.2f}x the base matmuls)")
    print(common.machine_line(info))
    common.write_json(args.out, {"machine": info, "quantization": args.quantization, "rows": ROWS,
                                 "max_loras": MAX_LORAS, "rank": RANK, **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
