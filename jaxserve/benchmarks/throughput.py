"""Offline throughput of an in-process engine, as `vllm bench throughput` measures it.

`jaxserve bench throughput` submits every request of the dataset at once (greedy, ignore_eos:
each gives exactly its output length) and steps the engine to completion; the time runs from
the first submission to the last finish, after the engine's warm-up. The result has vLLM's
fields (elapsed_time, num_requests, total_num_tokens, requests_per_second, tokens_per_second)
plus the output tokens and where the steps' time went (decode, prefill and mixed steps; device
and host seconds).
"""
from __future__ import annotations

import os
import sys

from absl import flags
from tqdm import tqdm

from jaxserve.benchmarks import datasets, offline
from jaxserve.config import ConfigError

DATASETS = ("random", "sharegpt", "jsonl")
DEFAULT_OUTPUT_LEN = 128  # random and jsonl, when --output_len is not given


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_enum("dataset_name", "random", list(DATASETS), "the prompts: random token ids, ShareGPT "
                      "conversations (--dataset_path), or a JSONL file of {\"prompt\", \"output_tokens\"}",
                      flag_values=fv)
    flags.DEFINE_string("dataset_path", None, "the ShareGPT or JSONL file", flag_values=fv)
    flags.DEFINE_integer("input_len", 256, "random: prompt tokens", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("output_len", None, "output tokens per request (default: random and jsonl "
                         f"{DEFAULT_OUTPUT_LEN}, sharegpt the reply's length; jsonl lines may set their own)",
                         lower_bound=1, flag_values=fv)
    flags.DEFINE_float("random_range_ratio", 0.0, "random: lengths uniform in [len * (1 - r), len * (1 + r)]",
                       lower_bound=0.0, upper_bound=0.999, flag_values=fv)
    flags.DEFINE_integer("num_prompts", 100, "requests", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("seed", 0, "seed of the random prompts and of the ShareGPT sample", flag_values=fv)
    offline.define_flags(fv)


def check_flags(fv: flags.FlagValues) -> None:
    """What can be refused before the model loads."""
    if fv.dataset_name != "random":
        if not fv.dataset_path:
            raise offline.BenchmarkError(f"--dataset_name={fv.dataset_name} needs --dataset_path")
        if not os.path.isfile(fv.dataset_path):
            raise offline.BenchmarkError(f"{fv.dataset_path}: no such file")
    else:
        offline.check_lengths(fv.input_len, fv.output_len or DEFAULT_OUTPUT_LEN, fv.max_model_len,
                              fv.random_range_ratio)


def sample_requests(fv: flags.FlagValues, engine) -> list[datasets.SampleRequest]:
    """The dataset's requests: random ones as token ids of exactly their length, the others as
    text (lengths counted with the model's tokenizer)."""
    if fv.dataset_name == "random":
        return datasets.random_requests(fv.num_prompts, fv.input_len, fv.output_len or DEFAULT_OUTPUT_LEN,
                                        range_ratio=fv.random_range_ratio, seed=fv.seed,
                                        vocab_size=engine.model_config.vocab_size)
    if fv.dataset_name == "sharegpt":
        return datasets.sharegpt_requests(fv.dataset_path, fv.num_prompts, tokenizer=engine.tokenizer,
                                          output_len=fv.output_len, seed=fv.seed,
                                          max_prompt_len=engine.max_model_len - 1)
    return datasets.jsonl_requests(fv.dataset_path, fv.num_prompts, tokenizer=engine.tokenizer,
                                   output_len=fv.output_len or DEFAULT_OUTPUT_LEN)


def run_throughput(engine, requests: list[datasets.SampleRequest], *, progress: bool = False) -> dict:
    """Runs `requests` through the (warm) engine at once; the result dict (vLLM's fields and
    the step breakdown). Raises BenchmarkError for a request the engine cannot take, or one that
    did not give exactly its output length."""
    prompts = [offline.prompt_ids(engine, r) for r in requests]
    params = [offline.greedy_params(r.expected_output_len) for r in requests]
    offline.check_requests(engine, prompts, params)
    bar = tqdm(total=len(requests), unit="req", disable=not progress, file=sys.stderr)
    run = offline.timed_generate(engine, prompts, params, on_finish=lambda _: bar.update(1))
    bar.close()
    short = [i for i, (res, sp) in enumerate(zip(run.results, params)) if len(res.token_ids) != sp.max_tokens]
    if short:
        first = run.results[short[0]]
        raise offline.BenchmarkError(f"{len(short)} requests did not give their output length (request "
                                     f"{short[0]}: {len(first.token_ids)} tokens, {first.finish_reason})")
    return throughput_result(run, [len(p) for p in prompts])


def throughput_result(run: offline.Run, prompt_lens: list[int]) -> dict:
    """vLLM's throughput fields, the output tokens, and the step breakdown of `run`."""
    output = sum(len(r.token_ids) for r in run.results)
    total = sum(prompt_lens) + output
    elapsed = run.elapsed_time
    return dict(elapsed_time=elapsed, num_requests=len(run.results), total_num_tokens=total,
                total_prompt_tokens=sum(prompt_lens), total_output_tokens=output,
                requests_per_second=len(run.results) / elapsed, tokens_per_second=total / elapsed,
                output_tokens_per_second=output / elapsed, steps=offline.step_breakdown(run.steps))


def summary_lines(result: dict) -> list[str]:
    return [f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} "
            f"total tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s",
            f"{result['num_requests']} requests, {result['total_prompt_tokens']} prompt + "
            f"{result['total_output_tokens']} output tokens in {result['elapsed_time']:.2f}s",
            *offline.breakdown_lines(result["steps"], result["elapsed_time"])]


def run(fv: flags.FlagValues) -> int:
    try:
        check_flags(fv)
        engine = offline.load_engine(fv)
        result = run_throughput(engine, sample_requests(fv, engine), progress=not fv.disable_tqdm)
        result = dict(model=fv.model, dataset_name=fv.dataset_name, **result)
        offline.write_json(fv.output_json, result)
    except (offline.BenchmarkError, datasets.DatasetError, ConfigError) as e:
        print(f"jaxserve bench throughput: {e}", file=sys.stderr)
        return 2
    print("\n".join(summary_lines(result)))
    return 0
