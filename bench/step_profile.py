"""Where one decode step's time goes, against what the machine allows.

Times the jitted 30-layer forward of a decode step (no prefill) at a given number of rows and
context lengths with each attention implementation, and with attention removed (each layer's
attention output replaced by its queries), next to two machine limits measured in the same run:
the f32 matmul rate jax reaches for the step's [rows, hidden] x [hidden, ffn] shape and the
memory bandwidth of a large copy. From them: the matmul-only time of the step, the time to read
the step's K/V once, and so the best fraction of the matmul rate any attention could leave.
Last, the same decode step run by the engine (`Engine.step` on as many sequences), from its
StepRecords: device time next to the engine's host time per step.

The step reads its weights as the engine's does (`cpu_layout.layer_views`); interleaved with it, the
layer scan over the stacked weights. Options: `--row_sweep` times decode steps of several row
counts (the CPU's decode buckets come from it), `--prefill_tokens` a prefill step with and
without attention, `--baseline_kernels` another version's xla_paged.py (stacked weights, optionally
in a bigger bucket), `--kernel_comparison` the step without each of the CPU kernels (cpu_kernels),
`--quantization` / `--quantize_embedding` quantized weights.

  python bench/step_profile.py --rows=64 --min_context=129 --max_context=256
  python bench/step_profile.py --rows=64 --min_context=16 --max_context=1024 --backends=xla,reference
  python bench/step_profile.py --rows=1 --min_context=480 --max_context=520 --backends=xla \
      --row_sweep=1,2,4,8 --prefill_tokens=500
  git show 8b11f4b:pallas_kernels/xla_paged.py > /tmp/old_xla_paged.py   # before the single-stream work
  python bench/step_profile.py --rows=1 --min_context=480 --max_context=520 --backends=xla \
      --baseline_kernels=/tmp/old_xla_paged.py --baseline_rows=8 --quantization=int8 --quantize_embedding
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
    from jaxserve.core.request import SamplingParams
    from jaxserve.engine import Engine, EngineConfig

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


def timed_in_turns(runs: dict, repeats: int, rounds: int) -> dict:
    """{name: seconds of each call} of step functions already called once, timed in turns (rounds of
    `repeats` calls each), so that load from other processes falls on all of them alike."""
    samples = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            for _ in range(repeats):
                start = time.perf_counter()
                run()
                samples[name].append(time.perf_counter() - start)
    return samples


def interleaved_seconds(runs: dict, repeats: int, rounds: int, reduce=lambda times: float(np.median(times))) -> dict:
    """{name: median seconds} (or `reduce` of the samples) of several step functions, each called
    once first (compiled and warm), then timed in turns (timed_in_turns)."""
    for run in runs.values():
        run()  # compiled and warm
    return {name: reduce(times) for name, times in timed_in_turns(runs, repeats, rounds).items()}


def copy_bandwidth(num_bytes=256 * 2**20, repeats=5):
    """Bytes per second read + written by a large numpy copy."""
    src = np.ones(num_bytes // 4, np.float32)
    dst = np.empty_like(src)
    return 2 * num_bytes / median_seconds(lambda: np.copyto(dst, src), repeats)


def prefill_batch(num_tokens, bucket_tokens, num_prefill_seqs, page_size, max_pages, seed=0):
    """A prefill-only step: one sequence's first `num_tokens` tokens in a `bucket_tokens` bucket
    with `num_prefill_seqs` prefill rows (the others padding), as the engine packs it."""
    rng = np.random.default_rng(seed)
    used = -(-num_tokens // page_size)
    block_table = np.zeros((num_prefill_seqs, max_pages), np.int32)
    block_table[0, :used] = np.arange(1, used + 1)
    positions = np.zeros(bucket_tokens, np.int32)
    positions[:num_tokens] = np.arange(num_tokens)
    slots = np.zeros(bucket_tokens, np.int32)
    slots[:num_tokens] = block_table[0, positions[:num_tokens] // page_size] * page_size + positions[:num_tokens] % page_size
    starts = np.full(num_prefill_seqs + 1, num_tokens, np.int32)
    starts[0] = 0
    lens = np.zeros(num_prefill_seqs, np.int32)
    lens[0] = num_tokens
    logits = np.zeros(num_prefill_seqs, np.int32)
    logits[0] = num_tokens - 1
    return dict(
        token_ids=rng.integers(100, 20000, bucket_tokens).astype(np.int32), positions=positions, slot_mapping=slots,
        decode_block_table=np.zeros((0, max_pages), np.int32), decode_seq_lens=np.zeros(0, np.int32),
        prefill_block_table=block_table, prefill_seq_lens=lens, prefill_query_start_loc=starts,
        logits_indices=logits)


def baseline_comparison(args, step_run, stacked, batch) -> dict:
    """{name: median seconds} of this decode step and of the baseline's (`--baseline_kernels`: its
    decode attention, the stacked weights), optionally padded to `--baseline_rows`, interleaved."""
    import importlib.util

    from pallas_kernels import xla_paged

    spec = importlib.util.spec_from_file_location("baseline_xla_paged", args.baseline_kernels)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    current = xla_paged.paged_decode_attention

    def baseline_run(step_batch):
        xla_paged.paged_decode_attention = old.paged_decode_attention  # dispatch reads it when tracing
        try:
            return step_run("xla", stacked, step_batch)
        finally:
            xla_paged.paged_decode_attention = current

    runs = {"current step": step_run("xla"), "baseline step, same rows": baseline_run(batch)}
    if args.baseline_rows > args.rows:
        padded = dict(batch)
        extra = args.baseline_rows - args.rows
        for name in ("token_ids", "positions", "slot_mapping", "decode_seq_lens", "logits_indices"):
            padded[name] = np.pad(batch[name], (0, extra))  # padding rows: length 0, the null page
        padded["decode_block_table"] = np.pad(batch["decode_block_table"], ((0, extra), (0, 0)))
        runs[f"baseline step, {args.baseline_rows}-row bucket"] = baseline_run(padded)
    return interleaved_seconds(runs, args.repeats, args.rounds)


def kernel_comparison(step_run, stacked, args) -> dict:
    """The decode step as the engine runs it, next to the same step with XLA's decode attention
    instead of the CPU kernel's, with the quantized matmuls in XLA (float activations,
    EngineConfig.cpu_int8_activations=False), and with both, interleaved."""
    import cpu_kernels
    from jaxserve.models import cpu_layout

    xla_matmuls = cpu_layout.layer_views(stacked, int8_activations=False)
    runs = {"cpu kernels": step_run("xla"), "matmuls in XLA": step_run("xla", xla_matmuls)}
    real_takes = cpu_kernels.takes_decode_attention
    cpu_kernels.takes_decode_attention = lambda *operands: False  # traced (and compiled) without the kernel
    try:
        runs["attention in XLA"] = step_run("xla")
        runs["both in XLA"] = step_run("xla", xla_matmuls)
    finally:
        cpu_kernels.takes_decode_attention = real_takes
    return interleaved_seconds(runs, args.repeats, args.rounds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a converted model directory")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--min_context", type=int, default=129)
    parser.add_argument("--max_context", type=int, default=256)
    parser.add_argument("--max_model_len", type=int, default=1024, help="block table width in tokens")
    parser.add_argument("--backends", default="xla,reference")
    parser.add_argument("--quantization", default=None, help="int8, int4, ...: quantized linear weights")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the weights' float dtype (bfloat16: the CPU step's bfloat16 layout)")
    parser.add_argument("--quantize_embedding", action="store_true",
                        help="the embedding and tied lm_head in int8 too (quantization.quantize_embedding)")
    parser.add_argument("--row_sweep", default="",
                        help="comma list of decode row counts: their step times, interleaved (the CPU bucket choice)")
    parser.add_argument("--prefill_tokens", type=int, default=0,
                        help="also profile a prefill step of this many tokens of one sequence")
    parser.add_argument("--prefill_bucket", type=int, default=512, help="the prefill step's token bucket")
    parser.add_argument("--prefill_seqs", type=int, default=2, help="the prefill step's sequence rows")
    parser.add_argument("--baseline_kernels", default=None,
                        help="a copy of another version's pallas_kernels/xla_paged.py: its decode step (stacked "
                             "weights under the layer scan, as before cpu_layout.layer_views) timed next to this one")
    parser.add_argument("--baseline_rows", type=int, default=0,
                        help="with --baseline_kernels: also the baseline step padded to this many rows (its bucket)")
    parser.add_argument("--kernel_comparison", action="store_true",
                        help="the step with each of the CPU kernels (cpu_kernels) replaced by XLA's "
                             "formulation, interleaved")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the comparisons")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from checkpoints import default_model, load
    from jaxserve.models import quantization
    from jaxserve.models import cpu_layout, llama
    from pallas_kernels import dispatch

    model_dir = default_model.resolve_model(args.model) if args.model == "smollm2" else args.model
    config = load.load_config(model_dir)
    stacked = load.load_params(model_dir, args.dtype)
    if args.quantization:
        stacked = quantization.quantize_params(stacked, args.quantization, config)
    baseline_params = stacked
    if args.quantize_embedding:
        stacked = quantization.quantize_embedding(stacked)
    params = cpu_layout.layer_views(stacked)  # the weights as the engine's step reads them
    page_size = 16
    max_pages = -(-args.max_model_len // page_size)
    sweep = sorted({int(r) for r in args.row_sweep.split(",") if r.strip()})
    num_pages = max([args.rows, *sweep]) * max_pages + 1
    batch = decode_batch(args.rows, args.min_context, args.max_context, page_size, num_pages, max_pages)
    cache = {"kv": llama.init_kv_cache(config, llama.KVCacheSpec(num_pages, page_size), jnp.float32)}

    def step_run(backend, step_params=params, step_batch=batch):
        forward = jax.jit(functools.partial(llama.forward, config=config, backend=backend), donate_argnums=(1,))
        compiled = forward.lower(step_params, cache["kv"], step_batch).compile()

        def run():
            logits, cache["kv"] = compiled(step_params, cache["kv"], step_batch)
            logits.block_until_ready()
        return run

    def step_time(backend):
        return median_seconds(step_run(backend), args.repeats)

    info = common.machine_info(with_jax=True)
    results = {name: step_time(name) for name in args.backends.split(",")}
    real_decode_attention = dispatch.decode_attention
    dispatch.decode_attention = lambda backend, q, *rest, **kwargs: q  # attention removed
    try:
        results["no attention"] = step_time("xla")
    finally:
        dispatch.decode_attention = real_decode_attention
    # The layer scan over the weights as stored (what the step ran before cpu_layout.layer_views), next to
    # the engine's (layer_views: per-layer views, or stacked with the CPU kernel's layout), interleaved.
    weights_layout = interleaved_seconds({"weights as the engine reads them": step_run("xla"),
                                          "weights as stored (layer scan)": step_run("xla", stacked)},
                                         args.repeats, args.rounds)
    kernels = kernel_comparison(step_run, stacked, args) if args.kernel_comparison else {}
    baseline = {}
    if args.baseline_kernels:
        baseline = baseline_comparison(args, step_run, baseline_params, batch)
    row_sweep = {}
    if sweep:
        runs = {rows: step_run("xla", params, decode_batch(rows, args.min_context, args.max_context, page_size,
                                                           num_pages, max_pages)) for rows in sweep}
        row_sweep = interleaved_seconds(runs, args.repeats, args.rounds)
    prefill = None
    if args.prefill_tokens:
        prefill_arrays = prefill_batch(args.prefill_tokens, args.prefill_bucket, args.prefill_seqs, page_size, max_pages)
        real_ragged_attention = dispatch.ragged_attention
        runs = {"step": step_run("xla", params, prefill_arrays)}
        dispatch.ragged_attention = lambda backend, q, *rest, **kwargs: q
        try:
            runs["no attention"] = step_run("xla", params, prefill_arrays)
        finally:
            dispatch.ragged_attention = real_ragged_attention
        prefill = interleaved_seconds(runs, max(1, args.repeats // 2), args.rounds)

    records = engine_decode_steps(config, stacked, args, page_size, max_pages)
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
    params_matmul = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(stacked["layers"]) if v.ndim == 3)
    lm_head = config.vocab_size * d
    step_flops = 2 * rows * (params_matmul + lm_head)
    matmul_s = step_flops / matmul_rate
    kv_bytes = 2 * config.num_layers * int(batch["decode_seq_lens"].sum()) * config.num_kv_heads * config.head_dim * 4
    bandwidth = copy_bandwidth()
    read_kv_s = kv_bytes / (bandwidth / 2)  # the copy's rate counts read and write
    weight_bytes = quantization.tree_bytes(stacked["layers"]) + quantization.tree_bytes(
        stacked.get("lm_head", stacked["embed"]))  # (the float embedding's rows read per token are few)
    read_weights_s = weight_bytes / (bandwidth / 2)

    print(common.machine_line(info))
    print(f"decode step: {rows} rows, contexts {args.min_context}-{args.max_context} "
          f"(mean {batch['decode_seq_lens'].mean():.0f}), block table {max_pages} pages, "
          f"weights {args.quantization or 'float32'}")
    for name, seconds in results.items():
        print(f"  {name:>13}: {1e3 * seconds:7.1f} ms  ({step_flops / seconds / 1e9:5.1f} GFLOP/s, "
              f"{matmul_s / seconds:.2f} of the matmul rate)")
    for name, seconds in weights_layout.items():
        print(f"  xla, {name}: {1e3 * seconds:7.1f} ms (interleaved)")
    print(f"matmul [{rows}, {d}] x [{d}, {f}]: {matmul_rate / 1e9:.1f} GFLOP/s -> the step's "
          f"{step_flops / 1e9:.1f} GFLOP take {1e3 * matmul_s:.1f} ms at that rate")
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write) -> reading the step's "
          f"{kv_bytes / 2**20:.0f} MiB of K/V once takes {1e3 * read_kv_s:.1f} ms, its "
          f"{weight_bytes / 2**20:.0f} MiB of weights (layers + lm_head) {1e3 * read_weights_s:.1f} ms")
    best = matmul_s / (results["no attention"] + read_kv_s)
    print(f"bound: with attention costing one read of K/V on top of the step without attention, "
          f"the step reaches at most {best:.2f} of the matmul rate")
    for name, seconds in {**kernels, **baseline}.items():
        print(f"  {name}: {1e3 * seconds:7.1f} ms (interleaved)")
    if row_sweep:
        print("decode step by rows (interleaved): " + ", ".join(
            f"{r} rows {1e3 * t:.1f} ms ({1e3 * t / r:.1f} ms/row)" for r, t in row_sweep.items()))
    if prefill:
        print(f"prefill step, {args.prefill_tokens} tokens in a {args.prefill_bucket}-token bucket "
              f"({args.prefill_seqs} prefill rows): {1e3 * prefill['step']:.0f} ms, attention removed "
              f"{1e3 * prefill['no attention']:.0f} ms ({args.prefill_tokens / prefill['step']:.0f} tokens/s)")
    if engine_step:
        print(f"engine decode step ({engine_step['num_steps']} StepRecords, {rows} rows in a "
              f"{engine_step['bucket_decode_rows']}-row bucket): {1e3 * engine_step['device_s']:.1f} ms device + "
              f"{1e3 * engine_step['host_s']:.1f} ms host ({1e3 * engine_step['pack_s']:.1f} ms packing the arrays)")
    common.write_json(args.out, dict(machine=info, args=vars(args), step_s=results, matmul_flops_per_s=matmul_rate,
                                     step_flops=step_flops, kv_bytes=kv_bytes, copy_bytes_per_s=bandwidth,
                                     weight_bytes=weight_bytes, read_weights_s=read_weights_s,
                                     weights_layout_s=weights_layout, row_sweep_s=row_sweep, prefill_s=prefill,
                                     baseline_s=baseline, kernel_comparison_s=kernels,
                                     matmul_fraction_bound=best, engine_decode_step=engine_step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
