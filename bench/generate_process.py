"""`jaxserve generate` judged as a user runs it: the whole process, next to transformers.

The fixed workload of bench/throughput.py as a batch job: 64 prompts of about 128 tokens (random
vocabulary tokens written out as text, so the prompts are new to every cache), 128 greedy output
tokens each (ignore_eos). jaxserve: `jaxserve generate` with its default engine flags, timed from
starting the process to its exit (Python start, loading and converting nothing, the step shapes
it uses compiled when first used, generation, writing the output), twice: with an empty
persistent compilation cache and executable store (a fresh `JAXSERVE_COMPILATION_CACHE` folder,
the store beside it) and again with what the first run filled. transformers: the
same token ids, `generate` in static batches, its generation alone (loading the model not
counted), at each `--hf_batch_sizes`. The warm jaxserve process and transformers run in turns,
`--rounds` times (the machine's speed drifts within minutes): medians, and each round's ratio.
Output tokens per second of wall time, and the ratios.

  python bench/generate_process.py --out=bench/out/generate_process.json
  python bench/generate_process.py --num_prompts=4 --prompt_len=16 --output_len=8 --skip_hf   # smoke
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def text_prompts(tokenizer, num, length, seed) -> list[str]:
    """`num` texts of about `length` tokens each: random vocabulary tokens decoded."""
    rng = np.random.default_rng(seed)
    low = 100  # clear of the special tokens at the start of the vocabulary
    return [tokenizer.decode(rng.integers(low, len(tokenizer) - 1, length).tolist()) for _ in range(num)]


def run_generate(model, input_path, output_len, cache_dir, extra_flags) -> dict:
    """Wall seconds of one `jaxserve generate` process and the tokens it wrote."""
    output = tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False).name
    os.unlink(output)
    env = {**os.environ, "JAXSERVE_COMPILATION_CACHE": cache_dir}
    command = [os.path.join(os.path.dirname(sys.executable), "jaxserve"), "generate", f"--model={model}", f"--input={input_path}",
               f"--output={output}", f"--max_tokens={output_len}", "--ignore_eos", "--noprogress", *extra_flags]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall_s = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"jaxserve generate failed ({done.returncode}): {done.stderr[-3000:]}")
    with open(output) as f:
        lines = [json.loads(line) for line in f]
    os.unlink(output)
    tokens = sum(line["num_output_tokens"] for line in lines)
    summary = [line for line in done.stderr.splitlines() if "output tokens/s" in line]
    return dict(wall_s=wall_s, output_tokens=tokens, output_tokens_per_s=tokens / wall_s,
                its_own_summary=summary[-1] if summary else None,
                outputs={line["id"]: line["token_ids"] for line in lines})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="what `jaxserve generate --model` takes")
    parser.add_argument("--num_prompts", type=int, default=64)
    parser.add_argument("--prompt_len", type=int, default=128, help="random tokens per prompt before decoding")
    parser.add_argument("--output_len", type=int, default=128)
    parser.add_argument("--hf_batch_sizes", default="32,64")
    parser.add_argument("--skip_hf", action="store_true")
    parser.add_argument("--generate_flags", default="", help="extra flags for jaxserve generate (space separated)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="warm jaxserve processes, each followed by transformers (medians reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    from checkpoints import default_model, load
    from serve.prompts import encode_text

    model_dir = default_model.resolve_model(args.model) if args.model == "smollm2" else args.model
    tokenizer = load.load_tokenizer(model_dir)
    texts = text_prompts(tokenizer, args.num_prompts, args.prompt_len, args.seed)
    token_ids = [encode_text(tokenizer, t) for t in texts]  # what generate feeds the engine
    info = common.machine_info()
    report = dict(machine=info, args=vars(args), prompt_tokens=[len(t) for t in token_ids])
    with tempfile.TemporaryDirectory() as scratch:
        input_path = os.path.join(scratch, "prompts.jsonl")
        with open(input_path, "w") as f:
            for i, text in enumerate(texts):
                f.write(json.dumps({"id": i, "prompt": text}) + "\n")
        cache = os.path.join(scratch, "xla-cache")
        flags = args.generate_flags.split()
        report["jaxserve_cold"] = run_generate(args.model, input_path, args.output_len, cache, flags)
        print(f"jaxserve generate, empty caches: {report['jaxserve_cold']['wall_s']:.1f} s", flush=True)
        hf_model = None
        if not args.skip_hf:
            from bench.hf_baseline import greedy_agreement, load_hf_model, run_hf
            hf_model, report["transformers_load_s"] = load_hf_model(model_dir)
        workload = [(ids, args.output_len) for ids in token_ids]
        sizes = [] if args.skip_hf else [int(b) for b in args.hf_batch_sizes.split(",") if b.strip()]
        # In turns, so that the machine's speed, which drifts here by tens of percent within minutes,
        # falls on both alike: each round a warm jaxserve process, then transformers at each size.
        warm_runs, hf_runs, rounds = [], {size: [] for size in sizes}, []
        for index in range(args.rounds):
            warm = run_generate(args.model, input_path, args.output_len, cache, flags)
            warm_runs.append(warm)
            this_round = {"jaxserve_warm_s": warm["wall_s"]}
            print(f"round {index + 1}: jaxserve generate, filled caches: {warm['wall_s']:.1f} s", flush=True)
            for size in sizes:
                result = run_hf(hf_model, workload, size, 0.0)
                result["agreement_first_16"] = greedy_agreement(
                    [warm["outputs"][i] for i in range(len(token_ids))], result.pop("outputs"))
                hf_runs[size].append(result)
                this_round[f"transformers_b{size}_s"] = result["wall_s"]
                this_round[f"jaxserve_vs_transformers_b{size}"] = result["wall_s"] / warm["wall_s"]
                print(f"round {index + 1}: transformers b={size}: {result['wall_s']:.1f} s of generation", flush=True)
            rounds.append(this_round)
    median_run = lambda runs: sorted(runs, key=lambda r: r["wall_s"])[(len(runs) - 1) // 2]  # noqa: E731
    report["jaxserve_warm"] = median_run(warm_runs)
    report["jaxserve_warm_s_all"] = [r["wall_s"] for r in warm_runs]
    report["rounds"] = rounds
    hf = {size: {**median_run(runs), "wall_s_all": [r["wall_s"] for r in runs]} for size, runs in hf_runs.items()}
    if hf:
        report["transformers"] = hf
    for run in warm_runs + [report["jaxserve_cold"]]:
        run.pop("outputs", None)

    rows = [dict(engine="jaxserve generate, whole process, empty caches", **report["jaxserve_cold"]),
            dict(engine="jaxserve generate, whole process, filled caches", **report["jaxserve_warm"])]
    rows += [dict(engine=f"transformers b={size}, generation alone", **result) for size, result in hf.items()]
    best_hf = max((r["output_tokens_per_s"] for r in hf.values()), default=None)
    for row in rows:
        row["vs_best_transformers"] = row["output_tokens_per_s"] / best_hf if best_hf else float("nan")
    print(common.machine_line(info))
    print(f"{args.num_prompts} prompts of ~{args.prompt_len} tokens (mean {np.mean(report['prompt_tokens']):.0f}), "
          f"{args.output_len} greedy output tokens each")
    print(common.format_table(rows, [("engine", "engine", "s"), ("wall_s", "wall s", ".1f"),
                                     ("output_tokens_per_s", "output tok/s", ".1f"),
                                     ("vs_best_transformers", "/ best transformers", ".2f")]))
    for size, result in hf.items():
        ratios = [r[f"jaxserve_vs_transformers_b{size}"] for r in rounds]
        print(f"transformers b={size} / jaxserve warm, round by round: {', '.join(f'{x:.2f}' for x in ratios)} "
              f"(median {np.median(ratios):.2f})")
        print(f"transformers b={size}: first 16 greedy tokens agree with jaxserve's on {result['agreement_first_16']}")
    common.write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
