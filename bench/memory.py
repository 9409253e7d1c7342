"""Memory planner vs measured, and KV-cache utilization during a serving-like run.

On CPU the measure is the process RSS (peak, minus the RSS before the weights were loaded); on a
GPU it is the device's bytes in use / peak. The KV utilization is tokens stored / capacity of the
pages in use, sampled every step while requests of mixed lengths stream through the engine.

    python bench/memory.py --out=bench/out/memory.json [--model=smollm2] [--budget_gb=3]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from checkpoints import default_model, load  # noqa: E402
from jaxserve.core.request import SamplingParams  # noqa: E402
from jaxserve.engine import Engine, EngineConfig  # noqa: E402
from jaxserve.planning import memory  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measured_bytes(baseline: int) -> dict:
    device = jax.devices()[0]
    stats = device.memory_stats() if device.platform == "gpu" else None
    if stats:
        return {"kind": "device", "in_use": stats["bytes_in_use"], "peak": stats["peak_bytes_in_use"]}
    return {"kind": "rss", "in_use": rss_bytes() - baseline, "peak": peak_rss_bytes() - baseline}


def kv_utilization_run(engine: Engine, num_requests: int, rng) -> dict:
    """Mixed prompt/output lengths; utilization = tokens in cache / capacity of pages in use."""
    vocab = engine.model_config.vocab_size
    page_size = engine.config.page_size
    samples = []
    for i in range(num_requests):
        prompt = rng.integers(10, vocab, int(rng.integers(16, 400))).tolist()
        engine.add_request(f"m{i}", prompt, SamplingParams(max_tokens=int(rng.integers(16, 200)),
                                                            temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        pages = sum(len(r.page_ids) for r in running)
        if pages:
            samples.append(sum(r.num_computed_tokens for r in running) / (pages * page_size))
    return {"num_requests": num_requests, "num_samples": len(samples),
            "kv_utilization_mean": float(np.mean(samples)), "kv_utilization_min": float(np.min(samples))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budget_gb", type=float, default=3.0, help="memory budget given to the planner")
    parser.add_argument("--num_requests", type=int, default=48)
    args = parser.parse_args(argv)

    model_dir = default_model.resolve_model(args.model)
    config = load.load_config(model_dir)
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    cfg = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=1024, warmup=False)
    plan = memory.plan_memory(config, dataclasses.replace(cfg, dtype=jnp.dtype(dtype).name, memory_utilization=1.0),
                              device_memory_bytes=int(args.budget_gb * memory.GiB))
    jnp.zeros(1).block_until_ready()  # runtime up before the baseline
    baseline = rss_bytes()
    params = load.load_params(model_dir, dtype)
    cfg.num_pages = plan.num_pages
    engine = Engine(config, params, load.load_tokenizer(model_dir), cfg)
    after_load = measured_bytes(baseline)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    utilization = kv_utilization_run(engine, args.num_requests, rng)
    after_run = measured_bytes(baseline)
    # The runtime reserve is the planner's allowance for what the runtime itself holds (compiled
    # executables, allocator slack), so it belongs to what the measurement is compared with.
    planned_static = plan.weights_bytes + plan.kv_cache_bytes + plan.runtime_reserve_bytes
    planned_peak = planned_static + plan.activation_bytes
    report = {
        "machine": f"{os.uname().machine}, {os.cpu_count()} cores, jax {jax.__version__} "
                   f"({jax.devices()[0].device_kind})",
        "model": args.model, "dtype": jnp.dtype(dtype).name, "plan": plan.to_dict(),
        "measured_after_load": after_load, "measured_after_run": after_run,
        "planned_static_bytes": planned_static, "planned_peak_bytes": planned_peak,
        "static_error": after_load["in_use"] / planned_static - 1,
        "peak_error": after_run["peak"] / planned_peak - 1,
        "run_seconds": time.perf_counter() - start, **utilization,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    mib = 1 << 20
    print(f"planned static     {planned_static / mib:9.1f} MiB   measured after load {after_load['in_use'] / mib:9.1f} MiB"
          f"   error {report['static_error']:+.1%}")
    print(f"planned peak       {planned_peak / mib:9.1f} MiB   measured peak       {after_run['peak'] / mib:9.1f} MiB"
          f"   error {report['peak_error']:+.1%}")
    print(f"KV utilization over {utilization['num_samples']} steps: mean {utilization['kv_utilization_mean']:.1%}, "
          f"min {utilization['kv_utilization_min']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
