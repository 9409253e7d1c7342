"""Serving side by side: `jaxserve bench serve` against jaxserve and llama.cpp's server, with
transformers on the same prompts.

The prompts: `--num_prompts` random token sequences of `--input_len` tokens decoded to text with the
model's tokenizer, each asking for `--output_len` tokens (ignore_eos), as `jaxserve bench serve
--dataset_name=random` draws them: level i of its sweep with seed + i, so no level finds another's
prompts in a prefix cache, and every server gets the same prompts at the same level (the first
level's are written as a JSONL file beside --out). One run per `--concurrency` level (its sweep,
SLO verdict and plot), one server at a time so each has the machine to itself:
  jaxserve     `jaxserve serve --model=M` (with --launch; --url: a server already running);
  llama.cpp    its llama-server on the model's GGUF, when built (`make llama-server`) or given with
               --llama_server (only for a model converted from a GGUF: the default SmolLM2 is);
  transformers with --hf: the first level's prompts one at a time in this process, float32 (TTFT:
               one forward of the prompt; TPOT: one forward per token with the KV cache);
  Engine.step  with --engine: the same prompts one at a time through jaxserve's Engine in this
               process, with the engine flags of the server (--server_args), timed as bench/single_stream.py times it
               (add_request to the step that returns the first token): what the server's TTFT and
               TPOT come to without HTTP, tokenizing, detokenizing and the event loop.
Reported: each server's sweep table, and at the first level (concurrency 1 by default) the median
TTFT and TPOT of each engine with their ratio to transformers'.

  python bench/serving.py --launch --hf --engine --out=bench/out/serving.json
  python bench/serving.py --url=http://127.0.0.1:8000 --concurrency=1,8 --input_len=256
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

LLAMA_SERVER = os.path.join(common.REPO_ROOT, ".peers", "llama.cpp", "build", "bin", "llama-server")


def write_prompts(args, path: str) -> list[dict]:
    """The first level's prompts, as `bench serve` draws them (seed + 0), written as JSONL lines
    {"prompt", "output_tokens"}: what transformers gets."""
    from checkpoints.load import load_tokenizer
    from jaxserve.benchmarks import datasets
    from checkpoints.default_model import resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model))
    if tokenizer is None:
        raise RuntimeError(f"{args.model} has no tokenizer: the side-by-side run needs text prompts")
    samples = datasets.random_requests(args.num_prompts, args.input_len, args.output_len, seed=args.seed,
                                       tokenizer=tokenizer)
    lines = [{"prompt": s.prompt, "output_tokens": s.expected_output_len} for s in samples]
    with open(path, "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    return lines


def bench_serve(args, url: str, out_prefix: str) -> dict:
    """`jaxserve bench serve` at every level (random prompts, drawn per level); its result JSON (a sweep)."""
    result_path, plot_path = out_prefix + ".json", out_prefix + ".png"
    command = [sys.executable, "-m", "jaxserve.commands.cli", "bench", "serve", f"--base_url={url}",
               "--dataset_name=random", f"--random_input_len={args.input_len}",
               f"--random_output_len={args.output_len}", f"--seed={args.seed}", f"--num_prompts={args.num_prompts}",
               f"--sweep_max_concurrency={args.concurrency}", "--ignore_eos", "--num_warmups=1",
               f"--tokenizer={args.model}", "--metric_percentiles=50,99", f"--result_json={result_path}",
               f"--plot={plot_path}", "--disable_tqdm", f"--request_timeout_s={args.timeout_s}"]
    if args.goodput:
        command.append(f"--goodput={args.goodput}")
    run = subprocess.run(command, cwd=common.REPO_ROOT, capture_output=True, text=True)
    sys.stderr.write(run.stderr[-2000:])
    if run.returncode not in (0, 1) or not os.path.isfile(result_path):  # 1: some requests failed
        raise RuntimeError(f"jaxserve bench serve exited {run.returncode}:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    print(run.stdout)
    with open(result_path) as f:
        return json.load(f)


def llama_server_command(args, model_dir: str):
    """llama-server's command line on the GGUF `model_dir` was converted from; None without one."""
    path = args.llama_server or (LLAMA_SERVER if os.path.isfile(LLAMA_SERVER) else None)
    if path is None:
        return None
    with open(os.path.join(model_dir, "jaxserve.json")) as f:
        source = json.load(f)["source"]
    if not source.endswith(".gguf"):
        print(f"llama.cpp skipped: {args.model} was not converted from a GGUF", file=sys.stderr)
        return None
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"--llama_server={path} is not an executable (build it with `make llama-server`)")
    parallel = max(int(level) for level in args.concurrency.split(","))
    context = parallel * (args.input_len + args.output_len + 64)  # llama-server splits -c over its slots
    return lambda port: [path, "-m", source, "--host", "127.0.0.1", "--port", str(port), "-c", str(context),
                         "-np", str(parallel), "-t", str(os.cpu_count() or 1)]


def hf_single_stream(args, model_dir: str, prompts: list[dict]) -> dict:
    """transformers on the same prompts, one at a time: TTFT and TPOT medians in ms."""
    from bench.hf_baseline import load_hf_model
    from bench.single_stream import hf_request
    from checkpoints.load import load_tokenizer

    model, _ = load_hf_model(model_dir)
    return one_at_a_time(lambda ids, n: hf_request(model, ids, n), load_tokenizer(model_dir), prompts)


def one_at_a_time(run, tokenizer, prompts: list[dict]) -> dict:
    """`run(token ids, output tokens) -> (TTFT s, [later tokens' s], tokens)` on each prompt in
    turn: the TTFT and TPOT medians in ms."""
    ttfts, tpots = [], []
    for line in prompts:
        ttft, token_times, _ = run(tokenizer.encode(line["prompt"]), line["output_tokens"])
        ttfts.append(ttft * 1e3)
        tpots.append(statistics.median(token_times) * 1e3)
    return {"median_ttft_ms": statistics.median(ttfts), "median_tpot_ms": statistics.median(tpots),
            "num_prompts": len(prompts)}


def engine_single_stream(args, model_dir: str, prompts: list[dict]) -> dict:
    """jaxserve's Engine in this process on the same prompts, one at a time, with the engine
    settings `jaxserve serve` takes from --server_args (serve's CPU default for the long-prefill
    threshold included): TTFT and TPOT medians in ms."""
    from absl import flags

    from bench.single_stream import jaxserve_request
    from checkpoints.load import load_tokenizer
    from jaxserve.commands import serve
    from jaxserve.config import EngineConfig
    from jaxserve.engine import Engine

    fv = flags.FlagValues()
    serve.define_flags(fv)
    fv(["serve", *shlex.split(args.server_args)])
    engine = Engine.from_model(model_dir, EngineConfig(**serve.serve_engine_kwargs(fv)))
    return one_at_a_time(lambda ids, n: jaxserve_request(engine, ids, n), load_tokenizer(model_dir), prompts)


def single_stream_row(name: str, sweep: dict) -> dict:
    """The engine's first level (the prompts transformers also got): median TTFT and TPOT (ms)."""
    level = sweep["levels"][0]
    return {"engine": name, "max_concurrency": level.get("level"), "median_ttft_ms": level.get("median_ttft_ms"),
            "median_tpot_ms": level.get("median_tpot_ms")}


def comparison(rows: list[dict], hf: dict | None) -> str:
    """The concurrency-1 table, with ratios to transformers when it ran."""
    if hf is not None:
        rows = rows + [{"engine": "transformers", **{k: hf[k] for k in ("median_ttft_ms", "median_tpot_ms")}}]
        for row in rows:
            row["ttft_vs_hf"] = row["median_ttft_ms"] / hf["median_ttft_ms"] if row["median_ttft_ms"] else None
            row["tpot_vs_hf"] = row["median_tpot_ms"] / hf["median_tpot_ms"] if row["median_tpot_ms"] else None
    columns = [("engine", "engine", "s"), ("median_ttft_ms", "TTFT p50 ms", ".0f"),
               ("median_tpot_ms", "TPOT p50 ms", ".1f")]
    if hf is not None:
        columns += [("ttft_vs_hf", "TTFT / hf", ".2f"), ("tpot_vs_hf", "TPOT / hf", ".2f")]
    return common.format_table(rows, columns)


def run_servers(args, out_dir: str) -> dict:
    """Every server's sweep, by engine name."""
    from checkpoints.default_model import resolve_model

    sweeps = {}
    if args.url:
        sweeps["jaxserve"] = bench_serve(args, args.url.rstrip("/"), os.path.join(out_dir, "serving"))
        return sweeps
    with common.ServerProcess(args.model, shlex.split(args.server_args)) as server:
        print(f"jaxserve up on {server.url} after {server.start_seconds:.1f}s", file=sys.stderr, flush=True)
        sweeps["jaxserve"] = bench_serve(args, server.url, os.path.join(out_dir, "serving"))
    command = llama_server_command(args, resolve_model(args.model))
    if command is not None:
        with common.ServerProcess(args.model, command=command) as server:
            print(f"llama.cpp up on {server.url} after {server.start_seconds:.1f}s", file=sys.stderr, flush=True)
            sweeps["llama.cpp"] = bench_serve(args, server.url, os.path.join(out_dir, "serving_llama_cpp"))
    return sweeps


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running jaxserve server, e.g. http://127.0.0.1:8000")
    target.add_argument("--launch", action="store_true", help="start each server on a free loopback port")
    parser.add_argument("--model", default="smollm2", help="the model (served with --launch; its tokenizer, GGUF)")
    parser.add_argument("--server_args", default="", help="with --launch: extra `jaxserve serve` flags")
    parser.add_argument("--llama_server", default=None, help=f"llama-server binary (default: {LLAMA_SERVER} if built)")
    parser.add_argument("--hf", action="store_true", help="transformers on the same prompts, one at a time")
    parser.add_argument("--engine", action="store_true",
                        help="jaxserve's Engine.step in process on the same prompts, one at a time")
    parser.add_argument("--concurrency", default="1,4,8", help="comma list of max_concurrency levels")
    parser.add_argument("--num_prompts", type=int, default=16, help="prompts (the same set at every level)")
    parser.add_argument("--input_len", type=int, default=500, help="tokens per random prompt")
    parser.add_argument("--output_len", type=int, default=64, help="output tokens (ignore_eos: all of them)")
    parser.add_argument("--goodput", default=None, help="SLOs for bench serve, e.g. ttft:800,tpot:80")
    parser.add_argument("--timeout_s", type=float, default=600.0, help="per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/out/serving.json", help="JSON report (results beside it)")
    args = parser.parse_args(argv)
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--concurrency must be a comma list of integers, got {args.concurrency!r}")
    if not levels or min(levels) < 1:
        parser.error("--concurrency levels must be >= 1")
    if min(args.input_len, args.output_len, args.num_prompts) < 1 or args.output_len < 2:
        parser.error("--input_len, --num_prompts >= 1 and --output_len >= 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    report = dict(machine=common.machine_info(), input_len=args.input_len, output_len=args.output_len,
                  num_prompts=args.num_prompts, concurrency=args.concurrency)
    prompts_path = os.path.join(out_dir, "serving_prompts.jsonl")
    try:
        prompts = write_prompts(args, prompts_path)
        report["servers"] = run_servers(args, out_dir)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"serving: {e}", file=sys.stderr)
        return 2
    if args.hf:
        from checkpoints.default_model import resolve_model
        report["transformers"] = hf_single_stream(args, resolve_model(args.model), prompts)
    rows = [single_stream_row(name, sweep) for name, sweep in report["servers"].items()]
    if args.engine:
        from checkpoints.default_model import resolve_model
        report["engine_step"] = engine_single_stream(args, resolve_model(args.model), prompts)
        rows.append({"engine": "jaxserve (Engine.step, in process)", "max_concurrency": 1,
                     **{k: report["engine_step"][k] for k in ("median_ttft_ms", "median_tpot_ms")}})
    report["machine_line"] = common.machine_line(report["machine"])
    print(report["machine_line"])
    print(f"the first level (max_concurrency {args.concurrency.split(',')[0]}; {args.input_len}-token prompts, "
          f"{args.output_len} tokens):")
    print(comparison(rows, report.get("transformers")))
    report["single_stream"] = rows
    common.write_json(args.out, report)
    failed = any(level.get("failed") for sweep in report["servers"].values() for level in sweep["levels"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
