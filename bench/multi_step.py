"""Host work off the critical path: multi-step decoding (`num_scheduler_steps`), measured.

Between two device calls the device idles while the host schedules, packs the next step's arrays
and turns sampled ids into deltas. On a small model that gap is most of a step. With
`num_scheduler_steps=n` a step of decoding rows runs n decode steps in one device call (the
sampled ids stay on the device as the next step's input), so the host's work is paid once per n
tokens per row.

For each model (the tiny random test model; SmolLM2 unless --skip_smollm2) and each batch size,
every variant (n = 1, 4, 8) runs the same greedy requests (random prompts, ignore_eos), the
variants interleaved over --repeats rounds, after a warm-up; reported per output token (medians
over rounds): wall time, device time (host arrays in -> ids out, i.e. the jitted calls and their
transfers) and host time (the rest of `Engine.step`: the idle gap the device sees), and output
tokens/s. Every variant's tokens are checked against n = 1.

  python bench/multi_step.py --out=bench/out/multi_step.json
  python bench/multi_step.py --skip_smollm2 --repeats=1 --output_len=16   # smoke
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402


def models(args):
    """(name, ModelConfig, params) of the models to measure."""
    from jaxserve.config import ModelConfig
    from jaxserve.models import weights
    tiny = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_q_heads=4,
                       num_kv_heads=2, head_dim=16, max_position_embeddings=1024, eos_token_ids=(2,))
    out = [("tiny", tiny, weights.random_params(tiny, seed=1))]
    if not args.skip_smollm2:
        import jax.numpy as jnp

        from checkpoints import default_model, load
        model_dir = default_model.resolve_model("smollm2")
        out.append(("smollm2", load.load_config(model_dir), load.load_params(model_dir, jnp.float32)))
    return out


def run_batch(engine, prompts, output_len) -> dict:
    """One batch to completion; per-token wall, device and host seconds and the tokens."""
    from jaxserve.core.request import SamplingParams
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    engine.step_records.clear()
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    decode = [r for r in engine.step_records if r.kind == "decode"]
    tokens = sum(r.num_output_tokens for r in decode)
    return {"wall_per_token": wall / sum(len(r.token_ids) for r in results),
            "decode_device_per_token": sum(r.device_seconds for r in decode) / tokens,
            "decode_host_per_token": sum(r.host_seconds for r in decode) / tokens,
            "decode_calls": len(decode), "decode_tokens": tokens,
            "tokens": [r.token_ids for r in results]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="1,4,8", help="num_scheduler_steps variants")
    parser.add_argument("--batch_sizes", default="1,8")
    parser.add_argument("--prompt_len", type=int, default=64)
    parser.add_argument("--output_len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip_smollm2", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from jaxserve.engine import Engine, EngineConfig
    steps = [int(s) for s in args.steps.split(",")]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    info = common.machine_info(with_jax=True)
    print(common.machine_line(info), flush=True)
    report = {"machine": info, "args": vars(args), "results": {}}
    for name, config, params in models(args):
        engines = {}
        for n in steps:
            start = time.perf_counter()
            engines[n] = Engine(config, params, None, EngineConfig(
                max_num_seqs=max(batch_sizes), max_num_batched_tokens=128, enable_prefix_caching=False,
                max_model_len=args.prompt_len + args.output_len + 16, num_scheduler_steps=n, warmup=True))
            print(f"{name} n={n}: warm-up {time.perf_counter() - start:.1f}s", flush=True)
        rng = np.random.default_rng(0)
        for batch in batch_sizes:
            runs = {n: [] for n in steps}
            for repeat in range(args.repeats):
                prompts = [rng.integers(100, config.vocab_size, args.prompt_len).tolist() for _ in range(batch)]
                for n in steps:
                    runs[n].append(run_batch(engines[n], prompts, args.output_len))
                    assert runs[n][-1]["tokens"] == runs[steps[0]][-1]["tokens"], (name, batch, n, repeat)
            rows = {}
            for n in steps:
                med = {key: statistics.median(r[key] for r in runs[n])
                       for key in ("wall_per_token", "decode_device_per_token", "decode_host_per_token")}
                med["tokens_per_s"] = 1.0 / med["wall_per_token"]
                rows[n] = med
            base = rows[steps[0]]["tokens_per_s"]
            for n in steps:
                rows[n]["ratio_tokens_per_s_vs_n1"] = rows[n]["tokens_per_s"] / base
                print(f"{name} batch {batch} n={n}: {rows[n]['tokens_per_s']:.0f} tok/s "
                      f"({rows[n]['ratio_tokens_per_s_vs_n1']:.2f}x), per token: wall "
                      f"{1e3 * rows[n]['wall_per_token']:.3f} ms, device {1e3 * rows[n]['decode_device_per_token']:.3f} ms, "
                      f"host gap {1e3 * rows[n]['decode_host_per_token']:.3f} ms", flush=True)
            report["results"][f"{name}_batch{batch}"] = {str(n): rows[n] for n in steps}
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
