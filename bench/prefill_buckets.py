"""Time to first token across prompt lengths, with and without cutting prefill to a smaller bucket.

A step's prefill tokens run in the smallest prefill bucket that holds them (32, 64, ... 512
tokens by default), so a 300-token prompt pays for 512. On the CPU the scheduler cuts a step's
prefill down to the next smaller bucket when the tokens would fill at most 3/4 of their own
(`Scheduler.fit_prefill_to_bucket`): 256 tokens now, the other 44 next step in a 64-token bucket.
This times one prompt (one request, max_tokens 1, TTFT = the whole `generate` call) at each of
`--prompt_lens`, fresh random tokens each repeat, in three ways in turn so that all share the
machine's load: the engine as it runs (cut), the same engine with the cut turned off (its
scheduler's `prefill_cut_sizes` emptied: each prompt in the bucket that holds it), and
transformers (float32, one forward over the prompt). Medians; the cut engine's first token is
checked equal to the uncut one's.

  python bench/prefill_buckets.py --out=bench/out/prefill_buckets.json
  python bench/prefill_buckets.py --prompt_lens=100,300 --repeats=2   # smoke
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--prompt_lens", default="100,150,200,300,360,450,500,700")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip_hf", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.prompt_lens.split(",") if n.strip()]

    import jax.numpy as jnp

    from checkpoints import default_model, load
    from jaxserve.core.request import SamplingParams
    from jaxserve.engine import Engine, EngineConfig

    model_dir = default_model.resolve_model(args.model) if args.model == "smollm2" else args.model
    config = load.load_config(model_dir)
    params = load.load_params(model_dir, jnp.float32)
    engine_config = EngineConfig(dtype=args.dtype, enable_prefix_caching=False, max_model_len=2048)
    cut = Engine(config, params, None, engine_config)
    uncut = Engine(config, params, None, engine_config)
    uncut.scheduler.prefill_cut_sizes = ()
    info = common.machine_info(with_jax=True)
    hf_model = None
    if not args.skip_hf:
        import torch

        from bench.hf_baseline import load_hf_model
        hf_model, _ = load_hf_model(model_dir)
        info["torch"] = torch.__version__
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(args.seed)

    def engine_ttft(engine, prompt):
        begin = time.perf_counter()
        token = engine.generate([prompt], sampling)[0].token_ids
        return time.perf_counter() - begin, token

    def hf_ttft(prompt):
        import torch
        begin = time.perf_counter()
        with torch.inference_mode():
            hf_model(input_ids=torch.tensor([prompt]))
        return time.perf_counter() - begin

    for engine in (cut, uncut):  # every shape the prompts use, compiled before timing
        for length in lengths:
            engine.generate([rng.integers(100, config.vocab_size, length).tolist()], sampling)
    rows = []
    for length in lengths:
        times = {"cut": [], "uncut": [], "hf": []}
        equal = 0
        for _ in range(args.repeats):
            prompt = rng.integers(100, config.vocab_size, length).tolist()
            seconds, token = engine_ttft(cut, prompt)
            times["cut"].append(seconds)
            seconds, uncut_token = engine_ttft(uncut, prompt)
            times["uncut"].append(seconds)
            equal += token == uncut_token
            if hf_model is not None:
                times["hf"].append(hf_ttft(prompt))
        median = {name: float(np.median(values)) if values else None for name, values in times.items()}
        row = dict(prompt_len=length, cut_ms=1e3 * median["cut"], uncut_ms=1e3 * median["uncut"],
                   cut_vs_uncut=median["cut"] / median["uncut"], first_token_equal=f"{equal}/{args.repeats}")
        if median["hf"] is not None:
            row.update(transformers_ms=1e3 * median["hf"], cut_vs_transformers=median["cut"] / median["hf"],
                       uncut_vs_transformers=median["uncut"] / median["hf"])
        rows.append(row)
        print(f"{length} tokens: cut {row['cut_ms']:.0f} ms, uncut {row['uncut_ms']:.0f} ms"
              + (f", transformers {row['transformers_ms']:.0f} ms" if "transformers_ms" in row else ""), flush=True)
    info["load_average_end"] = common.load_average()
    print(common.machine_line(info))
    print(f"{args.model} ({args.dtype}), one prompt at a time, TTFT medians of {args.repeats}")
    columns = [("prompt_len", "tokens", "d"), ("uncut_ms", "uncut ms", ".0f"), ("cut_ms", "cut ms", ".0f"),
               ("cut_vs_uncut", "cut / uncut", ".2f"), ("first_token_equal", "first token equal", "s")]
    if hf_model is not None:
        columns += [("transformers_ms", "transformers ms", ".0f"), ("uncut_vs_transformers", "uncut / tf", ".2f"),
                    ("cut_vs_transformers", "cut / tf", ".2f")]
    print(common.format_table(rows, columns))
    common.write_json(args.out, dict(machine=info, args=vars(args), rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
