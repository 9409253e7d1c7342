"""Where one decode step's time goes, against what the machine allows.

Times the jitted 30-layer forward of a decode step (no prefill) at a given number of rows and
context lengths with each attention implementation, and with attention removed (each layer's
attention output replaced by its queries), next to two machine limits measured in the same run:
the f32 matmul rate jax reaches for the step's [rows, hidden] x [hidden, ffn] shape and the
memory bandwidth of a large copy. From them: the matmul-only time of the step, the time to read
the step's K/V once, and so the best fraction of the matmul rate any attention could leave.
Last, the same decode step run by the engine (`Engine.step` on as many sequences), from its
StepRecords: device time next to the engine's host time per step.

  python bench/step_profile.py --rows=64 --min_context=129 --max_context=256
  python bench/step_profile.py --rows=64 --min_context=16 --max_context=1024 --backends=xla,reference
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402


def decode_batch(rows, min_context, max_context, page_size, num_pages, max_pages, seed=0):
    """A decode-only step: `rows` sequences with contexts uniform in [min_context, max_context]."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(min_context, max_context + 1, rows).astype(np.int32)
    pages = rng.permutation(np.arange(1, num_pages))[: rows * max_pages].reshape(rows, max_pages)
    used = -(-lens // page_size)
    block_table = np.where(np.arange(max_pages)[None] < used[:, None], pages, 0).astype(np.int32)
    positions = lens - 1
    return dict(
        token_ids=rng.integers(100, 20000, rows).astype(np.int32), positions=positions,
        slot_mapping=(block_table[np.arange(rows), positions // page_size] * page_size
                      + positions % page_size).astype(np.int32),
        decode_block_table=block_table, decode_seq_lens=lens,
        prefill_block_table=np.zeros((0, max_pages), np.int32), prefill_seq_lens=np.zeros(0, np.int32),
        prefill_query_start_loc=np.zeros(1, np.int32), logits_indices=np.arange(rows, dtype=np.int32))


def engine_decode_steps(config, params, args, page_size, max_pages) -> list:
    """StepRecords of `args.repeats` engine steps that decode all `args.rows` sequences (contexts
    uniform in [min_context, max_context]); the first such step, which compiles, is left out."""
    from jaxserve.engine import Engine, EngineConfig
    from jaxserve.request import SamplingParams

    engine = Engine(config, params, None, EngineConfig(
        max_num_seqs=args.rows, max_num_batched_tokens=max(256, args.rows), page_size=page_size,
        num_pages=args.rows * max_pages + 1, max_model_len=args.max_model_len, enable_prefix_caching=False,
        warmup=False))
    rng = np.random.default_rng(1)
    sampling = SamplingParams(max_tokens=args.max_model_len - args.max_context, temperature=0.0, ignore_eos=True)
    for i, length in enumerate(rng.integers(args.min_context, args.max_context + 1, args.rows)):
        engine.add_request(f"profile-{i}", rng.integers(100, config.vocab_size, int(length)).tolist(), sampling)
    full_decode = []
    engine.add_step_listener(lambda record: full_decode.append(record) if (
        record.kind == "decode" and record.num_decode_rows == args.rows) else None)
    while engine.has_unfinished() and len(full_decode) <= args.repeats:
        engine.step()
    return full_decode[1:]


def median_seconds(run, repeats):
    run()  # compiled and warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def copy_bandwidth(num_bytes=256 * 2**20, repeats=5):
    """Bytes per second read + written by a large numpy copy."""
    src = np.ones(num_bytes // 4, np.float32)
    dst = np.empty_like(src)
    return 2 * num_bytes / median_seconds(lambda: np.copyto(dst, src), repeats)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a converted model directory")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--min_context", type=int, default=129)
    parser.add_argument("--max_context", type=int, default=256)
    parser.add_argument("--max_model_len", type=int, default=1024, help="block table width in tokens")
    parser.add_argument("--backends", default="xla,reference")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from checkpoints import default_model, load
    from jaxserve.models import llama
    from pallas_kernels import dispatch

    model_dir = default_model.resolve_model(args.model) if args.model == "smollm2" else args.model
    config = load.load_config(model_dir)
    params = load.load_params(model_dir, jnp.float32)
    page_size = 16
    max_pages = -(-args.max_model_len // page_size)
    num_pages = args.rows * max_pages + 1
    batch = decode_batch(args.rows, args.min_context, args.max_context, page_size, num_pages, max_pages)
    cache = {"kv": llama.init_kv_cache(config, llama.KVCacheSpec(num_pages, page_size), jnp.float32)}

    def step_time(backend):
        forward = jax.jit(functools.partial(llama.forward, config=config, backend=backend), donate_argnums=(1,))
        compiled = forward.lower(params, cache["kv"], batch).compile()

        def run():
            logits, cache["kv"] = compiled(params, cache["kv"], batch)
            logits.block_until_ready()
        return median_seconds(run, args.repeats)

    info = common.machine_info(with_jax=True)
    results = {name: step_time(name) for name in args.backends.split(",")}
    real_decode_attention = dispatch.decode_attention
    dispatch.decode_attention = lambda backend, q, *rest, **kwargs: q  # attention removed
    try:
        results["no attention"] = step_time("xla")
    finally:
        dispatch.decode_attention = real_decode_attention

    records = engine_decode_steps(config, params, args, page_size, max_pages)
    engine_step = None if not records else dict(
        num_steps=len(records), bucket_decode_rows=records[0].bucket_decode_rows,
        device_s=float(np.median([r.device_seconds for r in records])),
        host_s=float(np.median([r.host_seconds for r in records])),
        pack_s=float(np.median([r.pack_seconds for r in records])))

    rows, d, f = args.rows, config.hidden_size, config.intermediate_size
    matmul = jax.jit(lambda a, b: a @ b)
    a = jnp.ones((rows, d), jnp.float32)
    b = jnp.ones((d, f), jnp.float32)
    matmul_rate = 2 * rows * d * f / median_seconds(lambda: matmul(a, b).block_until_ready(), 20)
    params_matmul = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(params["layers"]) if v.ndim == 3)
    lm_head = config.vocab_size * d
    step_flops = 2 * rows * (params_matmul + lm_head)
    matmul_s = step_flops / matmul_rate
    kv_bytes = 2 * config.num_layers * int(batch["decode_seq_lens"].sum()) * config.num_kv_heads * config.head_dim * 4
    bandwidth = copy_bandwidth()
    read_kv_s = kv_bytes / (bandwidth / 2)  # the copy's rate counts read and write

    print(common.machine_line(info))
    print(f"decode step: {rows} rows, contexts {args.min_context}-{args.max_context} "
          f"(mean {batch['decode_seq_lens'].mean():.0f}), block table {max_pages} pages")
    for name, seconds in results.items():
        print(f"  {name:>13}: {1e3 * seconds:7.1f} ms  ({step_flops / seconds / 1e9:5.1f} GFLOP/s, "
              f"{matmul_s / seconds:.2f} of the matmul rate)")
    print(f"matmul [{rows}, {d}] x [{d}, {f}]: {matmul_rate / 1e9:.1f} GFLOP/s -> the step's "
          f"{step_flops / 1e9:.1f} GFLOP take {1e3 * matmul_s:.1f} ms at that rate")
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write) -> reading the step's "
          f"{kv_bytes / 2**20:.0f} MiB of K/V once takes {1e3 * read_kv_s:.1f} ms")
    best = matmul_s / (results["no attention"] + read_kv_s)
    print(f"bound: with attention costing one read of K/V on top of the step without attention, "
          f"the step reaches at most {best:.2f} of the matmul rate")
    if engine_step:
        print(f"engine decode step ({engine_step['num_steps']} StepRecords, {rows} rows in a "
              f"{engine_step['bucket_decode_rows']}-row bucket): {1e3 * engine_step['device_s']:.1f} ms device + "
              f"{1e3 * engine_step['host_s']:.1f} ms host ({1e3 * engine_step['pack_s']:.1f} ms packing the arrays)")
    common.write_json(args.out, dict(machine=info, args=vars(args), step_s=results, matmul_flops_per_s=matmul_rate,
                                     step_flops=step_flops, kv_bytes=kv_bytes, copy_bytes_per_s=bandwidth,
                                     matmul_fraction_bound=best, engine_decode_step=engine_step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
