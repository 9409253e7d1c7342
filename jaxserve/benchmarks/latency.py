"""The latency of one batch, in process, as `vllm bench latency` measures it.

Each iteration of `jaxserve bench latency` submits `--batch_size` random prompts of
`--input_len` tokens (fresh ones each iteration, so the prefix cache never serves one) for
exactly `--output_len` greedy tokens, and times the whole batch; `--num_iters_warmup`
iterations run untimed first. The result has vLLM's fields (avg_latency, latencies,
percentiles) plus per iteration the batch's TTFT (submission until every request of the batch
has its first token) and TPOT (the rest of the iteration per later token), as percentiles in
milliseconds.
"""
from __future__ import annotations

import sys

import numpy as np
from absl import flags
from tqdm import tqdm

from jaxserve.benchmarks import datasets, offline
from jaxserve.config import ConfigError

PERCENTILES = (10, 25, 50, 75, 90, 99)


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_integer("input_len", 32, "prompt tokens of each request", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("output_len", 128, "output tokens of each request", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("batch_size", 8, "requests in the batch", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("num_iters_warmup", 10, "untimed iterations first", lower_bound=0, flag_values=fv)
    flags.DEFINE_integer("num_iters", 30, "timed iterations", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("seed", 0, "seed of the random prompts", flag_values=fv)
    offline.define_flags(fv)


def batch_prompts(engine, batch_size: int, input_len: int, seed: int) -> list[list[int]]:
    """One iteration's prompts: random token ids, exactly input_len each."""
    samples = datasets.random_requests(batch_size, input_len, 1, seed=seed, vocab_size=engine.model_config.vocab_size)
    return [list(s.prompt) for s in samples]


def iteration(engine, batch_size: int, input_len: int, output_len: int, seed: int) -> dict:
    """One batch: latency (seconds from submission to the last finish), ttft and tpot (seconds)."""
    prompts = batch_prompts(engine, batch_size, input_len, seed)
    params = [offline.greedy_params(output_len)] * batch_size
    offline.check_requests(engine, prompts, params)
    run = offline.timed_generate(engine, prompts, params)
    ttft = max(r.ttft for r in run.results)
    tpot = (run.elapsed_time - ttft) / (output_len - 1) if output_len > 1 else None
    return dict(latency=run.elapsed_time, ttft=ttft, tpot=tpot)


def percentiles(values: list[float], scale: float = 1.0) -> dict[str, float]:
    """{"10": .., "25": .., "50": .., "75": .., "90": .., "99": ..} of `values` x `scale`."""
    points = np.percentile(np.asarray(values, np.float64) * scale, PERCENTILES)  # float64[6]
    return {str(p): float(v) for p, v in zip(PERCENTILES, points)}


def run_latency(engine, *, batch_size: int, input_len: int, output_len: int, num_iters_warmup: int,
                num_iters: int, seed: int = 0, progress: bool = False) -> dict:
    """Warm-up then timed iterations on the (warm) engine; the result dict."""
    for i in tqdm(range(num_iters_warmup), desc="warm-up", disable=not progress, file=sys.stderr):
        iteration(engine, batch_size, input_len, output_len, seed + i)
    timed = [iteration(engine, batch_size, input_len, output_len, seed + num_iters_warmup + i)
             for i in tqdm(range(num_iters), desc="iterations", disable=not progress, file=sys.stderr)]
    latencies = [t["latency"] for t in timed]
    ttfts = [t["ttft"] for t in timed]
    tpots = [t["tpot"] for t in timed if t["tpot"] is not None]
    return dict(
        avg_latency=float(np.mean(latencies)), latencies=latencies, percentiles=percentiles(latencies),
        ttfts=ttfts, mean_ttft_ms=1e3 * float(np.mean(ttfts)), ttft_ms_percentiles=percentiles(ttfts, 1e3),
        tpots=tpots, mean_tpot_ms=1e3 * float(np.mean(tpots)) if tpots else None,
        tpot_ms_percentiles=percentiles(tpots, 1e3) if tpots else None,
        batch_size=batch_size, input_len=input_len, output_len=output_len, num_iters=num_iters,
        num_iters_warmup=num_iters_warmup)


def summary_lines(result: dict) -> list[str]:
    p = result["percentiles"]
    lines = [f"Avg latency: {result['avg_latency']:.4f} seconds ({result['num_iters']} iterations of "
             f"{result['batch_size']} x {result['input_len']} prompt tokens -> {result['output_len']} tokens)"]
    lines += [f"{key}% percentile latency: {p[key]:.4f} seconds" for key in ("10", "50", "90", "99")]
    lines.append(f"TTFT (whole batch): mean {result['mean_ttft_ms']:.1f} ms, p50 "
                 f"{result['ttft_ms_percentiles']['50']:.1f} ms, p99 {result['ttft_ms_percentiles']['99']:.1f} ms")
    if result["tpot_ms_percentiles"] is not None:
        lines.append(f"TPOT: mean {result['mean_tpot_ms']:.2f} ms, p50 {result['tpot_ms_percentiles']['50']:.2f} "
                     f"ms, p99 {result['tpot_ms_percentiles']['99']:.2f} ms")
    return lines


def run(fv: flags.FlagValues) -> int:
    try:
        offline.check_lengths(fv.input_len, fv.output_len, fv.max_model_len)
        engine = offline.load_engine(fv)
        if fv.batch_size > engine.config.max_num_seqs:
            print(f"jaxserve bench latency: --batch_size={fv.batch_size} is over --max_num_seqs="
                  f"{engine.config.max_num_seqs}: the batch runs in parts", file=sys.stderr)
        result = run_latency(engine, batch_size=fv.batch_size, input_len=fv.input_len, output_len=fv.output_len,
                             num_iters_warmup=fv.num_iters_warmup, num_iters=fv.num_iters, seed=fv.seed,
                             progress=not fv.disable_tqdm)
        result = dict(model=fv.model, **result)
        offline.write_json(fv.output_json, result)
    except (offline.BenchmarkError, datasets.DatasetError, ConfigError) as e:
        print(f"jaxserve bench latency: {e}", file=sys.stderr)
        return 2
    print("\n".join(summary_lines(result)))
    return 0
