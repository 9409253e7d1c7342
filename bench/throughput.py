"""Offline throughput: jaxserve `Engine.generate` against Hugging Face `generate`, same prompts.

Two workloads, greedy, ignore_eos, random token prompts (fixed seed):
  fixed: 64 prompts of 128 tokens, 128 output tokens each;
  mixed: 128 requests, prompt and max_tokens drawn from 16..512 (the serving case). Hugging Face
         runs static batches in arrival order (each batch waits for its longest member);
         jaxserve batches continuously.
The jaxserve half is `jaxserve bench throughput`'s timed run (jaxserve.benchmarks.throughput and
offline: all requests submitted at once, warm-up excluded); its vLLM-named fields are in each
workload's "bench_throughput". Use `jaxserve bench throughput` alone for jaxserve's figures on any
dataset; this script adds the transformers side by side.
Also: the f32 matmul FLOP/s jax reaches here for the step shapes, the FLOP/s jaxserve achieves,
and where jaxserve's time goes (prefill, decode, mixed steps, host overhead).

  python bench/throughput.py --hf_budget_s=200 --out=bench/out/throughput.json  # full: ~40 min on 2 cores
  python bench/throughput.py --quick --skip_hf --model=DIR                       # smoke test, seconds
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402
from bench.hf_baseline import greedy_agreement, load_hf_model, run_hf  # noqa: E402

# Engine settings for 2 CPU cores (see bench/RESULTS.md): decode cost per row falls as rows grow,
# so 64 sequences; the CPU attention path pads every prefill sequence of a step to the step's token
# count, so one prefill sequence per step; a 256-token budget already reaches the prefill plateau
# and keeps decode steps short and the number of compiled shapes small.
FULL = dict(fixed=(64, 128, 128), mixed=(128, 16, 512), max_model_len=1024, max_num_seqs=64,
            max_num_batched_tokens=256, max_num_prefill_seqs=1, hf_batch_sizes="8,32")
# QUICK's 32-token budget: one prefill bucket (fewer shapes to warm up); the mixed prompts over 32
# tokens are prefilled in two chunks.
QUICK = dict(fixed=(8, 16, 16), mixed=(12, 4, 48), max_model_len=128, max_num_seqs=8,
             max_num_batched_tokens=32, max_num_prefill_seqs=1, hf_batch_sizes="4")


# ---- workloads ---------------------------------------------------------------------------------
def fixed_workload(num, prompt_len, output_len, vocab_size, seed):
    """[(prompt token ids, max_tokens)] all of one shape."""
    rng = np.random.default_rng(seed)
    low = min(100, vocab_size // 2)  # keep clear of the special tokens at the start of the vocab
    return [(rng.integers(low, vocab_size, prompt_len).tolist(), output_len) for _ in range(num)]


def mixed_workload(num, min_len, max_len, vocab_size, seed):
    """[(prompt token ids, max_tokens)] with both lengths uniform in [min_len, max_len]."""
    rng = np.random.default_rng(seed)
    low = min(100, vocab_size // 2)
    prompt_lens = rng.integers(min_len, max_len + 1, num)
    output_lens = rng.integers(min_len, max_len + 1, num)
    return [(rng.integers(low, vocab_size, int(p)).tolist(), int(o)) for p, o in zip(prompt_lens, output_lens)]


# ---- jaxserve ----------------------------------------------------------------------------------
class StepFlops:
    """Each StepRecord of a run as a dict with the step's useful FLOPs."""

    def __init__(self, engine):
        cfg = engine.model_config
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.matmul_flops_per_token = 2 * cfg.num_layers * (d * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * d
                                                            + 3 * d * f)
        self.lm_head_flops_per_row = 2 * d * cfg.vocab_size
        self.attention_flops_per_pair = cfg.num_layers * 4 * cfg.q_size  # QK^T and PV, per (query, key)

    def step(self, record) -> dict:
        num_rows = record.num_decode_rows + record.num_prefill_rows
        return dict(
            kind=record.kind, num_decode=record.num_decode_rows, num_prefill_tokens=record.num_prefill_tokens,
            padded_tokens=record.num_padded_tokens,
            flops=(self.matmul_flops_per_token * record.num_tokens + self.lm_head_flops_per_row * num_rows
                   + self.attention_flops_per_pair * record.num_attention_pairs),
            device_s=record.device_seconds, host_prep_s=record.pack_seconds, host_step_s=record.host_seconds)


def build_engine(model_dir, engine_kwargs):
    """(engine, timings dict). Timings: load, warm-up (compiles every step shape) and the first
    request after warm-up (`jaxserve bench throughput`'s: a step shape warm-up compiled with the
    fresh KV cache compiles again once the cache is a step's output; the request absorbs that
    before anything is timed)."""
    from checkpoints import load
    from jaxserve.benchmarks import offline
    from jaxserve.engine import Engine, EngineConfig
    from jaxserve.executor import device_setup

    config = EngineConfig(warmup=False, **engine_kwargs)
    start = time.perf_counter()
    model_config = load.load_config(model_dir)
    params = load.load_params(model_dir, device_setup.param_dtype(config.dtype))
    engine = Engine(model_config, params, load.load_tokenizer(model_dir), config, model_name=model_dir)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    num_shapes = engine.runner.warmup()
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    offline.warm_engine(engine)
    return engine, dict(load_s=load_s, warmup_s=warmup_s, num_shapes=num_shapes,
                        first_request_s=time.perf_counter() - start)


def run_jaxserve(engine, flops, workload):
    """The workload through `jaxserve bench throughput`'s timed run (all requests at once, greedy,
    ignore_eos): its result fields (`vllm` names) and this script's, with CPU time and FLOPs."""
    from jaxserve.benchmarks import offline, throughput as throughput_bench

    prompts = [p for p, _ in workload]
    params = [offline.greedy_params(m) for _, m in workload]
    offline.check_requests(engine, prompts, params)
    with common.CpuMeter() as meter:
        run = offline.timed_generate(engine, prompts, params)
    if engine.allocator.num_used_pages:
        raise RuntimeError(f"{engine.allocator.num_used_pages} KV pages still used after generate")
    bench = throughput_bench.throughput_result(run, [len(p) for p in prompts])
    wall, out_tokens = run.elapsed_time, bench["total_output_tokens"]
    return dict(
        wall_s=wall, output_tokens=out_tokens, output_tokens_per_s=out_tokens / wall, cpu_s=meter.cpu_s,
        output_tokens_per_cpu_s=out_tokens / meter.cpu_s, other_processes_cores=meter.other_cores,
        prompt_tokens=bench["total_prompt_tokens"], num_steps=len(run.steps),
        device_s=sum(s.device_seconds for s in run.steps), steps=[flops.step(s) for s in run.steps],
        bench_throughput={k: v for k, v in bench.items() if k != "steps"},
        ttft_s=common.summarize([r.ttft for r in run.results]),
        tpot_s=common.summarize([r.tpot for r in run.results]), outputs=[r.token_ids for r in run.results])


def time_breakdown(run):
    """Where the wall time went: device time per step kind, host prep (the runner packing a step's
    arrays), the rest of the engine's host work per step, and what is left of the loop."""
    kinds = collections.defaultdict(lambda: dict(steps=0, device_s=0.0, tokens=0, flops=0.0))
    for s in run["steps"]:
        k = kinds[s["kind"]]
        k["steps"] += 1
        k["device_s"] += s["device_s"]
        k["tokens"] += s["num_decode"] + s["num_prefill_tokens"]
        k["flops"] += s["flops"]
    device = sum(s["device_s"] for s in run["steps"])
    prep = sum(s["host_prep_s"] for s in run["steps"])
    host_steps = sum(s["host_step_s"] for s in run["steps"])
    num_steps = max(len(run["steps"]), 1)
    useful = sum(s["num_decode"] + s["num_prefill_tokens"] for s in run["steps"])
    padded = sum(s["padded_tokens"] for s in run["steps"])
    return dict(by_kind=dict(kinds), device_s=device, host_prep_s=prep, host_step_s=host_steps,
                host_loop_s=run["wall_s"] - device - prep,
                host_overhead_per_step_ms=1e3 * (run["wall_s"] - device) / num_steps,
                device_per_step_ms=1e3 * device / num_steps, padding_efficiency=useful / max(padded, 1))


# ---- FLOP/s --------------------------------------------------------------------------------------
def matmul_flops_per_s(row_counts, d, f, repeats=5):
    """{T: FLOP/s of a jitted f32 [T, d] @ [d, f]} (median of `repeats` timed calls after compiling)."""
    import jax
    import jax.numpy as jnp

    matmul = jax.jit(lambda a, b: a @ b)
    b = jnp.asarray(np.random.default_rng(0).standard_normal((d, f)), jnp.float32)
    rates = {}
    for t in sorted(set(row_counts)):
        a = jnp.asarray(np.random.default_rng(t).standard_normal((t, d)), jnp.float32)
        jax.block_until_ready(matmul(a, b))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(matmul(a, b))
            times.append(time.perf_counter() - start)
        rates[t] = 2 * t * d * f / float(np.median(times))
    return rates


def flops_report(run, rates):
    """Achieved FLOP/s against the matmul rate jax reaches at each step's padded token count."""
    steps = run["steps"]
    flops = sum(s["flops"] for s in steps)
    device = sum(s["device_s"] for s in steps)
    ideal = sum(s["flops"] / rates[s["padded_tokens"]] for s in steps)
    return dict(useful_flops=flops, flops_per_s_device=flops / device, flops_per_s_wall=flops / run["wall_s"],
                matmul_flops_per_s_max=max(rates.values()),
                ratio_to_matmul_max=flops / device / max(rates.values()),
                ratio_to_matmul_at_step_shapes=ideal / device)


# ---- report --------------------------------------------------------------------------------------
def print_workload(name, run, breakdown, flops, hf_runs):
    print(f"\n== {name}: {run['prompt_tokens']} prompt tokens, {run['output_tokens']} output tokens")
    rows = [dict(engine="jaxserve", tps=run["output_tokens_per_s"], wall=run["wall_s"], ratio=1.0,
                 cpu=run["output_tokens_per_cpu_s"], others=run["other_processes_cores"])]
    for hf in hf_runs:
        name = f"transformers b={hf['batch_size']}"
        if hf["partial"]:
            name += f" ({hf['requests_done']} requests)"
        rows.append(dict(engine=name, tps=hf["output_tokens_per_s"], wall=hf["wall_s"], ratio=hf["jaxserve_ratio"],
                         cpu=hf["output_tokens_per_cpu_s"], others=hf["other_processes_cores"]))
    print(common.format_table(rows, [("engine", "engine", "s"), ("tps", "output tok/s", ".1f"),
                                     ("wall", "wall s", ".1f"), ("ratio", "jaxserve / this", ".2f"),
                                     ("cpu", "tok per CPU s", ".1f"),
                                     ("others", "cores used by others", ".2f")]))
    kinds = [dict(kind=k, steps=v["steps"], device=v["device_s"], ms=1e3 * v["device_s"] / v["steps"],
                  tokens=v["tokens"], gflops=v["flops"] / v["device_s"] / 1e9)
             for k, v in sorted(breakdown["by_kind"].items())]
    print(common.format_table(kinds, [("kind", "step kind", "s"), ("steps", "steps", "d"),
                                      ("device", "device s", ".1f"), ("ms", "ms/step", ".1f"),
                                      ("tokens", "tokens", "d"), ("gflops", "GFLOP/s", ".1f")]))
    print(f"host: {breakdown['host_prep_s']:.1f}s building step arrays, {breakdown['host_loop_s']:.1f}s "
          f"scheduler/detokenizer/loop ({breakdown['host_step_s']:.1f}s of host work inside engine steps); "
          f"{breakdown['host_overhead_per_step_ms']:.1f} ms host overhead per step "
          f"vs {breakdown['device_per_step_ms']:.1f} ms device; padding efficiency "
          f"{breakdown['padding_efficiency']:.2f}")
    print(f"FLOP/s: jaxserve {flops['flops_per_s_device'] / 1e9:.1f} GFLOP/s over device time "
          f"({flops['flops_per_s_wall'] / 1e9:.1f} over wall); matmul peak {flops['matmul_flops_per_s_max'] / 1e9:.1f}"
          f" -> {flops['ratio_to_matmul_max']:.2f} of peak, {flops['ratio_to_matmul_at_step_shapes']:.2f} of the "
          f"matmul rate at the same step shapes")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a converted model directory")
    parser.add_argument("--quick", action="store_true", help="a few short prompts (smoke test)")
    parser.add_argument("--skip_hf", action="store_true", help="measure jaxserve only")
    parser.add_argument("--out", default=None, help="JSON report path")
    parser.add_argument("--workloads", default="fixed,mixed", help="comma list of fixed, mixed")
    parser.add_argument("--hf_batch_sizes", default=None, help="comma list (default 8,32; quick: 4)")
    parser.add_argument("--hf_budget_s", type=float, default=0.0,
                        help="stop a transformers run after the batch that crosses this many seconds and "
                             "report the batches done (0: run everything)")
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_num_prefill_seqs", "max_model_len"):
        parser.add_argument(f"--{name}", type=int, default=None, help="EngineConfig field (default: tuned)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    preset = QUICK if args.quick else FULL
    from checkpoints import ConversionError
    from checkpoints.default_model import resolve_model
    from jaxserve.models import weights

    try:
        model_dir = resolve_model(args.model)
    except ConversionError as e:
        print(f"throughput: {e}", file=sys.stderr)
        return 2
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not workloads or set(workloads) - {"fixed", "mixed"}:
        print(f"throughput: --workloads must name fixed and/or mixed, got {args.workloads!r}", file=sys.stderr)
        return 2
    try:
        hf_batch_sizes = [int(b) for b in (args.hf_batch_sizes or preset["hf_batch_sizes"]).split(",")]
    except ValueError:
        print(f"throughput: --hf_batch_sizes must be a comma list of integers, got {args.hf_batch_sizes!r}",
              file=sys.stderr)
        return 2
    if min(hf_batch_sizes) < 1 or args.hf_budget_s < 0:
        print("throughput: --hf_batch_sizes must be >= 1 and --hf_budget_s >= 0", file=sys.stderr)
        return 2
    engine_kwargs = {k: getattr(args, k) or preset[k] for k in
                     ("max_num_seqs", "max_num_batched_tokens", "max_num_prefill_seqs", "max_model_len")}
    engine_kwargs["enable_prefix_caching"] = False  # random prompts; repeated runs must not hit the cache
    info = common.machine_info(with_jax=True)
    engine, timings = build_engine(model_dir, engine_kwargs)
    flops_model = StepFlops(engine)
    cfg = engine.model_config
    print(common.machine_line(info))
    print(f"model {args.model}: {weights.num_params(cfg) / 1e6:.1f}M params, {cfg.num_layers} layers; engine "
          f"{engine_kwargs}; load {timings['load_s']:.1f}s, warm-up {timings['warmup_s']:.1f}s "
          f"({timings['num_shapes']} shapes), first request {timings['first_request_s']:.1f}s")

    hf_model = None
    if not args.skip_hf:
        hf_model, hf_load_s = load_hf_model(model_dir)
        import torch
        info["torch"] = torch.__version__
        print(f"transformers model loaded in {hf_load_s:.1f}s (float32, {torch.get_num_threads()} threads)")

    report = dict(machine=info, machine_line=common.machine_line(info), model=args.model, model_dir=model_dir,
                  num_params=weights.num_params(cfg), engine_config=engine_kwargs, **timings,
                  compilation_cache=os.environ.get("JAXSERVE_COMPILATION_CACHE", "default"),
                  omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"), hf_budget_s=args.hf_budget_s,
                  quick=args.quick, workloads={})
    for name in workloads:
        if name == "fixed":
            workload = fixed_workload(*preset["fixed"], cfg.vocab_size, args.seed)
        else:
            workload = mixed_workload(*preset["mixed"], cfg.vocab_size, args.seed + 1)
        run = run_jaxserve(engine, flops_model, workload)
        rates = matmul_flops_per_s([s["padded_tokens"] for s in run["steps"]], cfg.hidden_size,
                                   cfg.intermediate_size)
        breakdown, flops = time_breakdown(run), flops_report(run, rates)
        hf_runs = []
        for batch_size in hf_batch_sizes if hf_model is not None else []:
            hf_runs.append(run_hf(hf_model, workload, batch_size, args.hf_budget_s, pad_token_id=0))
        for hf in hf_runs:
            hf["jaxserve_ratio"] = run["output_tokens_per_s"] / hf["output_tokens_per_s"]
            if name == "fixed":
                hf["greedy_agreement"] = greedy_agreement(run["outputs"], hf.pop("outputs"))
            hf.pop("outputs", None)
        print_workload(name, run, breakdown, flops, hf_runs)
        for hf in hf_runs:
            if "greedy_agreement" in hf:
                print(f"greedy tokens equal to transformers b={hf['batch_size']}: "
                      f"{hf['greedy_agreement']['first_16_tokens_equal']:.2f} of requests (first 16 tokens)")
        run.pop("outputs")
        steps = run.pop("steps")
        report["workloads"][name] = dict(
            jaxserve=run, breakdown=breakdown, flops=flops, matmul_flops_per_s={str(k): v for k, v in rates.items()},
            transformers=hf_runs, step_kind_counts=dict(collections.Counter(s["kind"] for s in steps)))
        common.write_json(args.out, report)  # after each workload, so that a long run keeps what it did
    return 0


if __name__ == "__main__":
    # On a shared machine, OpenMP threads that spin while waiting make torch's small matmuls ~30x
    # slower (measured); passive waiting keeps the transformers baseline honest. Set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    sys.exit(main())
