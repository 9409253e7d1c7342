"""End-to-end engine benchmark on a random-weight model (Llama-3-8B-shaped bf16 on a GPU).

Measures, in one process: offline throughput, in-process serving at several concurrencies
(TTFT / TPOT / P99 through AsyncEngine, no HTTP), the decode step time against its roofline
(weights + KV bytes read per step / measured copy bandwidth), and planner vs measured device
memory; then greedy agreement of the attention backends: the same prompts and random weights (a
2-layer model with the 8B's heads) through engines on the Triton kernels, the Mosaic GPU kernels
(where jax has them) and the XLA path, their greedy tokens compared. `--small` (alias `--quick`) shrinks the sizes only (a tiny bf16 Llama, small loads), the code
path is the one a GPU runs, so that the script can be rehearsed on a CPU (bench/gpu_check.sh --dry-run,
with JAXSERVE_ATTENTION_BACKEND=interpret for the Pallas kernels).

    python bench/e2e_gpu.py --out=results.json [--small]
"""
from __future__ import annotations

import argparse
import dataclasses
import asyncio
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxserve.async_engine import AsyncEngine  # noqa: E402
from jaxserve.config import ModelConfig  # noqa: E402
from jaxserve.core.request import SamplingParams  # noqa: E402
from jaxserve.engine import Engine, EngineConfig  # noqa: E402
from jaxserve.models import weights  # noqa: E402
from jaxserve.planning import memory  # noqa: E402
from pallas_kernels import compat  # noqa: E402

LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                        num_q_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                        max_position_embeddings=8192)
TINY = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2,
                   num_q_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=1024)


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
            "seconds": elapsed, "output_tokens_per_s": num_out / elapsed,
            "total_tokens_per_s": (num_out + num_prompts * prompt_len) / elapsed}


async def serving_run(engine: AsyncEngine, concurrency: int, num_requests: int, prompt_len: int,
                      output_len: int, rng) -> dict:
    vocab = engine.engine.model_config.vocab_size
    prompts = [rng.integers(10, vocab, prompt_len).tolist() for _ in range(num_requests)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ttfts, tpots, e2es = [], [], []
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
            ttfts.append(first - start)
            e2es.append(end - start)
            if count > 1:
                tpots.append((end - first) / (count - 1))

    start = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    elapsed = time.perf_counter() - start
    pct = lambda xs, q: float(np.percentile(xs, q)) * 1000
    return {"concurrency": concurrency, "num_requests": num_requests,
            "output_tokens_per_s": num_requests * output_len / elapsed,
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


def greedy_agreement(quick: bool, rng) -> dict:
    """Greedy tokens of one small random model through each attention backend, and which agree
    with the XLA path's (on a GPU: pallas = Triton and mosaic compiled; on a CPU: interpreted)."""
    on_gpu = jax.default_backend() == "gpu"
    backends = {"triton": "pallas" if on_gpu else "interpret", "xla": "xla"}
    if compat.has_mosaic_gpu():
        backends["mosaic"] = "mosaic" if on_gpu else "mosaic_interpret"
    config = dataclasses.replace(TINY, head_dim=64) if quick else dataclasses.replace(LLAMA3_8B, num_layers=2)
    params = weights.random_params(config, dtype=jnp.bfloat16, seed=1)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in ((5, 40) if quick else (7, 300, 1500))]
    tokens = {}
    for family, backend in backends.items():
        engine = Engine(config, params, None, EngineConfig(
            attention_backend=backend, dtype="bfloat16", max_num_seqs=4, max_num_batched_tokens=64 if quick else 512,
            max_model_len=128 if quick else 2048, warmup=False), model_name="agreement")
        results = engine.generate(prompts, SamplingParams(max_tokens=4 if quick else 16, temperature=0.0,
                                                          ignore_eos=True))
        tokens[family] = [r.token_ids for r in results]
    return {"backends": backends, "tokens": tokens,
            "agree_with_xla": {family: tokens[family] == tokens["xla"] for family in backends}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--small", "--quick", dest="small", action="store_true",
                        help="tiny bf16 model and loads, same code path (CPU rehearsal)")
    args = parser.parse_args(argv)
    quick = args.small
    cfg = TINY if quick else LLAMA3_8B
    dtype = jnp.bfloat16
    rng = np.random.default_rng(0)
    report = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
              "model": "tiny random bf16" if quick else "llama3-8b-shaped random bf16"}
    report["copy_bandwidth_GBps"] = copy_bandwidth(1 << (24 if quick else 30)) / 1e9

    start = time.perf_counter()
    params = weights.random_params(cfg, dtype=dtype)
    jax.block_until_ready(params)
    engine_cfg = EngineConfig(max_num_seqs=8 if quick else 64, max_num_batched_tokens=64 if quick else 2048,
                              max_num_prefill_seqs=2 if quick else 4, max_model_len=256 if quick else 4096,
                              warmup=True)
    engine = Engine(cfg, params, None, engine_cfg, model_name=report["model"])
    report["startup_s"] = time.perf_counter() - start  # random weights + the warm-up's compiles
    report["attention_backend"] = engine.runner.backend
    report["num_step_shapes"] = len(engine.runner.all_buckets())
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    plan = memory.plan_memory(cfg, dataclasses.replace(engine_cfg, dtype=jnp.dtype(dtype).name,
                                                       max_model_len=engine.max_model_len),
                              device_memory_bytes=memory.device_memory_budget_bytes(device))
    report["memory"] = {"planned_weights_bytes": plan.weights_bytes, "planned_num_pages": plan.num_pages,
                        "engine_num_pages": engine.allocator.num_usable_pages + 1,
                        "planned_total_bytes": plan.weights_bytes + plan.kv_cache_bytes + plan.activation_bytes,
                        "measured_bytes_in_use": stats.get("bytes_in_use"),
                        "measured_peak_bytes": stats.get("peak_bytes_in_use")}
    report["offline"] = offline(engine, 16 if quick else 256, 64 if quick else 512, 16 if quick else 256, rng)
    report["decode_roofline"] = decode_roofline(engine, 4 if quick else 64, 128 if quick else 1024,
                                                report["copy_bandwidth_GBps"] * 1e9, rng)

    async def serve_all():
        async_engine = AsyncEngine(engine)
        await async_engine.start()
        try:
            return [await serving_run(async_engine, c, max(2 * c, 8) if quick else 4 * c,
                                      32 if quick else 512, 8 if quick else 128, rng)
                    for c in (1, 8, 32)]
        finally:
            await async_engine.shutdown()

    report["serving"] = asyncio.run(serve_all())
    with open(args.out, "w") as f:  # kept if the agreement runs past the step's limit
        json.dump(report, f, indent=2)
    report["greedy_agreement"] = greedy_agreement(quick, np.random.default_rng(0))  # its own prompts
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"{'what':<34}{'value':>14}")
    print(f"{'copy bandwidth GB/s':<34}{report['copy_bandwidth_GBps']:>14.1f}")
    print(f"{'offline output tok/s':<34}{report['offline']['output_tokens_per_s']:>14.1f}")
    roof = report["decode_roofline"]
    print(f"{'decode step ms (roofline ms)':<34}{roof['step_ms']:>8.2f} ({roof['roofline_ms']:.2f})")
    for s in report["serving"]:
        print(f"{'serving c=' + str(s['concurrency']) + ' tok/s, TTFT p99 ms':<34}"
              f"{s['output_tokens_per_s']:>8.1f} {s['ttft_ms_p99']:.1f}")
    print(f"{'greedy tokens equal XLA':<34}{str(report['greedy_agreement']['agree_with_xla']):>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
