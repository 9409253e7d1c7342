"""End-to-end engine benchmark on a random-weight model (Llama-3-8B-shaped bf16 on a GPU):
bench/gpu_check.sh's `e2e` step.

Measures, in one process and one engine: the engine's start (random weights and the warm-up's
compiles), planner vs measured device memory, offline throughput, the decode step time against its
roofline (weights + KV bytes read per step / measured copy bandwidth) and in-process serving at
concurrency 1, 8 and 32 (TTFT / TPOT / P99 through AsyncEngine, no HTTP). The engine's KV pool is
`--num_pages` (default: max_num_seqs sequences of max_model_len tokens, 16385 pages, 32 GiB for the
8B shape), not what the planner would give it of the whole device. Every figure is written to
--out as measured (bench/gpu_check_report.StepReport), each measurement in its own guard. Checks:
every request produced its tokens, and the planner's total covers the measured peak. The greedy
agreement of the attention backends is bench/gpu_agreement.py. `--small` (alias `--quick`) shrinks
the sizes only (a tiny bf16 Llama, small loads): the code path is the one a GPU runs, so that the
script can be rehearsed on a CPU (bench/gpu_check.sh --dry-run, with
JAXSERVE_ATTENTION_BACKEND=interpret for the Pallas kernels).

    python3 bench/e2e_gpu.py --out=results.json [--small] [--num_pages=N]
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench.gpu_check_report import StepReport, require_gpu  # noqa: E402
from jaxserve.async_engine import AsyncEngine  # noqa: E402
from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.core.request import SamplingParams  # noqa: E402
from jaxserve.engine import Engine, EngineConfig  # noqa: E402
from jaxserve.models import weights  # noqa: E402
from jaxserve.planning import memory  # noqa: E402

LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                        num_q_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                        max_position_embeddings=8192)
TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_q_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=1024)
PAGE_SIZE = 16


def copy_bandwidth(num_bytes: int) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda a: a + 0.0)
    copy(x).block_until_ready()
    times = []
    for _ in range(10):
        start = time.perf_counter()
        copy(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * x.nbytes / float(np.median(times))


def offline(engine: Engine, num_prompts: int, prompt_len: int, output_len: int, rng) -> dict:
    prompts = [rng.integers(10, engine.model_config.vocab_size, prompt_len).tolist() for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_out = sum(len(r.token_ids) for r in results)
    return {"num_prompts": num_prompts, "prompt_len": prompt_len, "output_len": output_len,
            "output_tokens": num_out, "seconds": elapsed, "output_tokens_per_s": num_out / elapsed,
            "total_tokens_per_s": (num_out + num_prompts * prompt_len) / elapsed}


async def serving_run(engine: AsyncEngine, concurrency: int, num_requests: int, prompt_len: int,
                      output_len: int, rng) -> dict:
    vocab = engine.engine.model_config.vocab_size
    prompts = [rng.integers(10, vocab, prompt_len).tolist() for _ in range(num_requests)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ttfts, tpots, e2es, counts = [], [], [], []
    semaphore = asyncio.Semaphore(concurrency)

    async def one(i, prompt):
        async with semaphore:
            start = time.perf_counter()
            first = None
            count = 0
            async for out in engine.generate(f"c{concurrency}-{i}", prompt, params):
                count += len(out.new_token_ids)
                if first is None and out.new_token_ids:
                    first = time.perf_counter()
            end = time.perf_counter()
            counts.append(count)
            ttfts.append(first - start)
            e2es.append(end - start)
            if count > 1:
                tpots.append((end - first) / (count - 1))

    start = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - start
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1000
    return {"concurrency": concurrency, "num_requests": num_requests, "output_len": output_len,
            "output_tokens": sum(counts), "output_tokens_per_s": sum(counts) / elapsed,
            "ttft_ms_p50": pct(ttfts, 50), "ttft_ms_p99": pct(ttfts, 99),
            "tpot_ms_p50": pct(tpots, 50), "tpot_ms_p99": pct(tpots, 99),
            "e2e_ms_p50": pct(e2es, 50), "e2e_ms_p99": pct(e2es, 99)}


def decode_roofline(engine: Engine, batch: int, context: int, bandwidth: float, rng) -> dict:
    """Times pure decode steps of `batch` sequences at `context` tokens against bytes / bandwidth."""
    cfg = engine.model_config
    prompts = [rng.integers(10, cfg.vocab_size, context).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=engine.limits.max_seq_len - context, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"roof-{i}", p, params)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.scheduler.running) \
            or engine.scheduler.num_waiting:
        engine.step()
    times = []
    for _ in range(20):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    records = list(engine.step_records)[-20:]
    for i in range(batch):
        engine.abort(f"roof-{i}")
    itemsize = jnp.dtype(engine.runner.kv_cache_dtype).itemsize
    weight_bytes = weights.num_params(cfg) * itemsize
    kv_bytes = batch * context * 2 * cfg.num_layers * cfg.kv_size * itemsize
    step = float(np.median(times))
    roofline = (weight_bytes + kv_bytes) / bandwidth
    device = float(np.median([r.device_seconds for r in records]))
    return {"batch": batch, "context": context, "step_ms": step * 1000, "roofline_ms": roofline * 1000,
            "fraction_of_roofline": roofline / step, "weight_bytes": weight_bytes, "kv_bytes": kv_bytes,
            "device_ms": device * 1000, "host_ms": float(np.median([r.host_seconds for r in records])) * 1000,
            "device_fraction_of_roofline": roofline / device}


def memory_figures(engine, cfg: ModelConfig, engine_cfg: EngineConfig, report) -> None:
    """Planner vs measured device memory; check "plan_covers_peak": the planner's total for this
    engine (its fixed pool) at least the device's peak bytes in use (unknown where the device keeps
    no statistics, as the CPU)."""
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    plan = memory.plan_memory(
        cfg, dataclasses.replace(engine_cfg, dtype="bfloat16", max_model_len=engine.max_model_len),
        device_memory_bytes=memory.device_memory_budget_bytes(device))
    planned_total = plan.weights_bytes + plan.kv_cache_bytes + plan.activation_bytes
    peak = stats.get("peak_bytes_in_use")
    report.put("memory", {"planned_weights_bytes": plan.weights_bytes, "planned_kv_cache_bytes": plan.kv_cache_bytes,
                          "planned_activation_bytes": plan.activation_bytes, "planned_num_pages": plan.num_pages,
                          "engine_num_pages": engine.allocator.num_usable_pages + 1,
                          "planned_total_bytes": planned_total,
                          "measured_bytes_in_use": stats.get("bytes_in_use"), "measured_peak_bytes": peak,
                          "bytes_limit": stats.get("bytes_limit")})
    if peak is None:
        report.check("plan_covers_peak", "unknown", reason=f"{device.platform} keeps no memory statistics")
    else:
        report.check("plan_covers_peak", "ok" if peak <= planned_total else "differ",
                     planned_total_bytes=planned_total, measured_peak_bytes=peak)


def complete(report, name: str, produced: int, expected: int) -> None:
    """Check `name`: every request produced the tokens it asked for."""
    report.check(name, "ok" if produced == expected else "differ", tokens=produced, expected=expected)


def engine_config(small: bool, num_pages: int | None) -> EngineConfig:
    """The check's engine: its limits, and a KV pool of `num_pages` (default: what max_num_seqs
    sequences of max_model_len tokens fill), not the whole device."""
    limits = dict(max_num_seqs=8, max_num_batched_tokens=64, max_num_prefill_seqs=2, max_model_len=256) if small \
        else dict(max_num_seqs=64, max_num_batched_tokens=2048, max_num_prefill_seqs=4, max_model_len=4096)
    pages = num_pages or limits["max_num_seqs"] * -(-limits["max_model_len"] // PAGE_SIZE) + 1
    return EngineConfig(page_size=PAGE_SIZE, num_pages=pages, dtype="bfloat16", warmup=True, **limits)


def measure(engine, report, quick: bool, rng) -> None:
    """Offline throughput, the decode roofline and serving, each in its own guard, each written as measured."""
    with report.guard("offline"):
        result = report.put("offline", offline(engine, 16 if quick else 256, 64 if quick else 512,
                                                16 if quick else 256, rng))
        complete(report, "offline", result["output_tokens"], result["num_prompts"] * result["output_len"])
    with report.guard("decode_roofline"):
        report.put("decode_roofline", decode_roofline(engine, 4 if quick else 64, 128 if quick else 1024,
                                                      (report.get("copy_bandwidth_GBps") or 0) * 1e9, rng))

    async def serve_all():
        async_engine = AsyncEngine(engine)
        await async_engine.start()
        try:
            for c in (1, 8, 32):
                with report.guard(f"serving/c{c}"):
                    run = await serving_run(async_engine, c, max(2 * c, 8) if quick else 4 * c,
                                            32 if quick else 512, 8 if quick else 128, rng)
                    report.append("serving", run)
                    complete(report, f"serving/c{c}", run["output_tokens"], run["num_requests"] * run["output_len"])
        finally:
            await async_engine.shutdown()

    with report.guard("serving"):
        asyncio.run(serve_all())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the JSON report (written after every figure)")
    parser.add_argument("--small", "--quick", dest="small", action="store_true",
                        help="tiny bf16 model and loads, same code path (CPU rehearsal)")
    parser.add_argument("--num_pages", type=int, default=None,
                        help="the engine's KV pool (default: max_num_seqs sequences of max_model_len tokens)")
    args = parser.parse_args(argv)
    require_gpu()
    quick = args.small
    cfg = TINY if quick else LLAMA3_8B
    rng = np.random.default_rng(0)
    report = StepReport(args.out, device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                        model="tiny random bf16" if quick else "llama3-8b-shaped random bf16")
    with report.guard("copy"):
        report.put("copy_bandwidth_GBps", copy_bandwidth(1 << (24 if quick else 30)) / 1e9)
    engine_cfg = engine_config(quick, args.num_pages)
    with report.guard("engine"):
        start = time.perf_counter()
        params = weights.random_params(cfg, dtype=jnp.bfloat16)
        jax.block_until_ready(params)
        engine = Engine(cfg, params, None, engine_cfg, model_name=report["model"])
        report.update(attention_backend=engine.runner.backend, num_step_shapes=len(engine.runner.all_buckets()),
                      num_pages=engine_cfg.num_pages)
        report.put("startup_s", time.perf_counter() - start)  # random weights + the warm-up's compiles
    if "startup_s" not in report:
        return 1
    with report.guard("memory"):
        memory_figures(engine, cfg, engine_cfg, report)
    measure(engine, report, quick, rng)
    print_table(report)
    return report.exit_status()


def print_table(report) -> None:
    print(f"{'what':<34}{'value':>14}")
    print(f"{'copy bandwidth GB/s':<34}{report.get('copy_bandwidth_GBps') or 0:>14.1f}")
    print(f"{'offline output tok/s':<34}{report.get('offline', {}).get('output_tokens_per_s') or 0:>14.1f}")
    roof = report.get("decode_roofline", {})
    print(f"{'decode step ms (roofline ms)':<34}{roof.get('step_ms') or 0:>8.2f} ({roof.get('roofline_ms') or 0:.2f})")
    for s in report.get("serving", []):
        print(f"{'serving c=' + str(s['concurrency']) + ' tok/s, TTFT p99 ms':<34}"
              f"{s['output_tokens_per_s']:>8.1f} {s['ttft_ms_p99']:.1f}")
    print("checks: " + ", ".join(f"{k} {c['status']}" for k, c in report["checks"].items()))


if __name__ == "__main__":
    sys.exit(main())
