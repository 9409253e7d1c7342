"""What the in-process benchmarks (`bench throughput`, `bench latency`) share: the engine the
engine flags describe, warmed up before anything is timed; prompts as token ids; a run of
requests through `generate` with its steps recorded; where the steps' time went; the JSON file.

Problems a user can fix (flags, a model that does not load, a request over the context) are
`BenchmarkError`s, which the commands print as one line with exit code 2.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import random
import time
from typing import Callable, Sequence

from absl import flags

from jaxserve.benchmarks.datasets import RANDOM_TOKEN_LOW, SampleRequest
from jaxserve.commands import engine_flags
from jaxserve.core.outputs import StepRecord
from jaxserve.core.request import SamplingParams
from jaxserve.engine import Engine, FinishedRequest
from serve.prompts import encode_text

WARMUP_PROMPT_LEN = 8  # tokens of the request that runs after the engine's warm-up, untimed


class BenchmarkError(ValueError):
    """A benchmark that cannot run as asked: the message says why."""


def define_flags(fv: flags.FlagValues) -> None:
    """The engine flags (as `jaxserve generate` has them), --warmup, --output_json, --disable_tqdm."""
    engine_flags.define_engine_flags(fv)
    flags.DEFINE_boolean("warmup", True, "compile every step shape before anything is timed (false: shapes "
                         "compile when first used, inside the timed run)", flag_values=fv)
    flags.DEFINE_string("output_json", None, "write the result to this JSON file", flag_values=fv)
    flags.DEFINE_boolean("disable_tqdm", False, "no progress bar", flag_values=fv)


def check_lengths(input_len: int, output_len: int, max_model_len: int | None, range_ratio: float = 0.0) -> None:
    """Before the model loads: prompt + output (at their longest under --random_range_ratio)
    must fit max_model_len (when given; the engine checks each request against its own after)."""
    longest = math.floor(input_len * (1 + range_ratio)) + math.floor(output_len * (1 + range_ratio))
    if max_model_len is not None and longest > max_model_len:
        raise BenchmarkError(f"--input_len + --output_len (at most {longest} tokens) is over "
                             f"--max_model_len={max_model_len}")


def replicas(engine) -> list[Engine]:
    """The Engines behind `engine` (a DataParallelEngine's replicas, else the engine itself)."""
    return list(getattr(engine, "replicas", [engine]))


def warm_engine(engine, seed: int = 0) -> None:
    """One short greedy request per replica, untimed: the first step after the engine's warm-up
    compiles again (its KV cache is then a step's output), and shapes a run without warm-up
    needs first for any request compile here."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    low = min(RANDOM_TOKEN_LOW, vocab // 2)
    prompts = [[rng.randrange(low, vocab) for _ in range(WARMUP_PROMPT_LEN)] for _ in replicas(engine)]
    engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))


def load_engine(fv: flags.FlagValues):
    """The engine of the engine flags (generate's defaults: --max_num_seqs 64 on the CPU; --warmup:
    every step shape compiled), warmed by one request."""
    try:
        engine = Engine.from_model(fv.model, engine_flags.engine_config(fv, warmup=fv.warmup,
                                                                        **engine_flags.batch_defaults(fv)))
    except (ValueError, OSError) as e:
        raise BenchmarkError(f"cannot load {fv.model!r}: {e}") from None
    warm_engine(engine)
    return engine


def prompt_ids(engine, sample: SampleRequest) -> list[int]:
    """The sample's prompt as token ids: as given, or its text encoded (special tokens included)."""
    if isinstance(sample.prompt, list):
        return list(sample.prompt)
    if engine.tokenizer is None:
        raise BenchmarkError("text prompts need a model with a tokenizer")
    return encode_text(engine.tokenizer, sample.prompt)


def greedy_params(output_len: int) -> SamplingParams:
    """Exactly `output_len` tokens (ignore_eos), greedy: every run does the same work."""
    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)


def check_requests(engine, prompts: Sequence[list[int]], params: Sequence[SamplingParams]) -> None:
    """Every request admissible (context length, vocabulary), else a BenchmarkError naming the first."""
    for i, (ids, sp) in enumerate(zip(prompts, params)):
        try:
            engine.check_request(ids, sp)
        except ValueError as e:
            raise BenchmarkError(f"request {i} ({len(ids)} prompt tokens, {sp.max_tokens} output tokens): "
                                 f"{e}") from None


@dataclasses.dataclass
class Run:
    """One timed `generate` call: its results (in order), wall seconds and the steps it ran."""
    results: list[FinishedRequest]
    elapsed_time: float
    steps: list[StepRecord]


def timed_generate(engine, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
                   on_finish: Callable[[FinishedRequest], None] | None = None) -> Run:
    """Submits every request at once and steps the engine to completion: the seconds from the
    first submission to the last finish, and every step's StepRecord (a listener on each replica,
    so none is lost from the engine's bounded `step_records`)."""
    steps: list[StepRecord] = []
    engines = replicas(engine)
    for e in engines:
        e.add_step_listener(steps.append)
    try:
        start = time.perf_counter()
        results = engine.generate(list(prompts), list(params), on_finish=on_finish)
        elapsed = time.perf_counter() - start
    finally:
        for e in engines:
            e.remove_step_listener(steps.append)
    return Run(results, elapsed, steps)


def step_breakdown(steps: Sequence[StepRecord]) -> dict:
    """Where the steps' time went: per step kind (decode, prefill, mixed, verify) the steps, the
    tokens computed, device seconds (forward + sampler) and host seconds (scheduling, packing,
    detokenizing); overall, the padding efficiency (tokens computed / the buckets' token rows)."""
    by_kind: dict[str, dict] = collections.defaultdict(
        lambda: dict(num_steps=0, num_tokens=0, device_seconds=0.0, host_seconds=0.0))
    for s in steps:
        kind = by_kind[s.kind]
        kind["num_steps"] += 1
        kind["num_tokens"] += s.num_tokens
        kind["device_seconds"] += s.device_seconds
        kind["host_seconds"] += s.host_seconds
    padded = sum(s.num_padded_tokens for s in steps)
    return dict(
        num_steps=len(steps), device_seconds=sum(s.device_seconds for s in steps),
        host_seconds=sum(s.host_seconds for s in steps),
        padding_efficiency=sum(s.num_tokens for s in steps) / padded if padded else None,
        by_kind={kind: by_kind[kind] for kind in sorted(by_kind)})


def breakdown_lines(breakdown: dict, elapsed_time: float) -> list[str]:
    """The step breakdown as a few lines of text."""
    lines = [f"{breakdown['num_steps']} steps: {breakdown['device_seconds']:.2f}s on the device, "
             f"{breakdown['host_seconds']:.2f}s host work in steps, "
             f"{max(0.0, elapsed_time - breakdown['device_seconds'] - breakdown['host_seconds']):.2f}s "
             f"outside steps"]
    for kind, k in breakdown["by_kind"].items():
        lines.append(f"  {kind:<8} {k['num_steps']:>6} steps {k['num_tokens']:>8} tokens  device "
                     f"{k['device_seconds']:8.2f}s  host {k['host_seconds']:7.2f}s")
    return lines


def write_json(path: str | None, result: dict) -> None:
    if path is None:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise BenchmarkError(f"cannot write {path}: {e.strerror or e}") from None
