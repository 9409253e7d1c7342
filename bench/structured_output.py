"""What structured output costs per decode step: the grammar's token mask (built on the host by
llguidance, applied in the jitted sampler) at 1, 8 and 32 rows, against the same step without it.

Two engines over the same weights each keep `rows` sequences decoding at temperature 1, one of
them under a JSON-schema constraint whose string field keeps the grammar open for the whole
measurement (the dearest case for the mask: inside a JSON string nearly every token is allowed).
The machine is shared and noisy, so the engines step alternately (A B B A ...): both see the
same load, and the report gives the median step of each, the median of the paired differences,
the host time filling the masks (which overlaps the device's forward: the step is dispatched
first) and the sampler alone on the step's rows with no grammar row (the mask stage skipped)
and with every row constrained, timed alternately too.

  python bench/structured_output.py --model=smollm2 --rows=1,8,32 --steps=60 --output=bench/out/structured_output.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402

# The grammar stays inside the string for at least 2000 characters: every measured step is masked.
SCHEMA = {"type": "object", "properties": {"notes": {"type": "string", "minLength": 2000}}, "required": ["notes"]}
PROMPT = "Write a JSON object with long notes about the history of the city of Paris."


def timed_fill_bitmasks():
    """Wraps structured_output.fill_bitmasks (what the runner calls) to record its seconds per call."""
    from jaxserve.core import structured_output
    original = structured_output.fill_bitmasks
    seconds: list[float] = []

    def fill(states, bitmask):
        start = time.perf_counter()
        original(states, bitmask)
        if states:
            seconds.append(time.perf_counter() - start)
    structured_output.fill_bitmasks = fill
    return seconds


def start_decoding(engine, rows: int, steps: int, grammar: bool, seed: int) -> list[str]:
    """Adds `rows` sequences and steps until every one decodes; returns their ids."""
    from jaxserve.core.request import SamplingParams
    from jaxserve.core.structured_output import StructuredOutputParams
    prompt = engine.tokenizer.encode(PROMPT)
    constraint = StructuredOutputParams("json_schema", SCHEMA, "guided_json") if grammar else None
    ids = [f"{'g' if grammar else 'p'}{seed}-{i}" for i in range(rows)]
    for i, request_id in enumerate(ids):
        engine.add_request(request_id, prompt, SamplingParams(
            max_tokens=steps + rows + 16, temperature=1.0, seed=seed * 1000 + i, ignore_eos=True,
            structured_output=constraint))
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    return ids


def paired_decode_steps(engines, rows: int, steps: int, seed: int, fills: list[float]) -> dict:
    """`steps` decode steps of each engine (False: plain, True: grammar), alternating A B B A."""
    ids = {grammar: start_decoding(engine, rows, steps, grammar, seed) for grammar, engine in engines.items()}
    del fills[:]
    times = {False: [], True: []}
    for i in range(steps):
        for grammar in ((False, True) if i % 2 == 0 else (True, False)):
            engine = engines[grammar]
            start = time.perf_counter()
            engine.step()
            times[grammar].append(time.perf_counter() - start)
            record = engine.step_records[-1]
            assert record.kind == "decode" and record.num_decode_rows == rows, record
    fill = list(fills)
    for grammar, engine in engines.items():
        for request_id in ids[grammar]:
            engine.abort(request_id)
        assert engine.allocator.num_used_pages == 0
    return {"plain": statistics.median(times[False]), "grammar": statistics.median(times[True]),
            "difference": statistics.median(b - a for a, b in zip(times[False], times[True])),
            "fill": statistics.median(fill) if fill else 0.0}


def sampler_seconds(engine, rows: int, constrained: bool, repeats: int = 20) -> float:
    """The compiled sampler alone on a decode step's rows: every bit set (the mask stage skipped)
    or every row constrained by a mask llguidance computed inside a JSON string."""
    import jax
    from jaxserve.core import structured_output
    from jaxserve.core.request import SamplingParams
    from jaxserve.core.step import RowParams
    from jaxserve.executor import sampler
    from jaxserve.executor.sampler import ALWAYS_BIAS
    runner = engine.runner
    num_rows = len(runner.empty_batch(runner.bucket_for(rows, 0, 1))["logits_indices"])
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=1.0)
    inputs = sampler.build_sampling_inputs([RowParams(params, seed=i) for i in range(rows)], num_rows,
                                           runner.max_model_len, False, ALWAYS_BIAS, runner.eos_token_ids, vocab_size=vocab)
    if constrained:
        state = engine.grammar_compiler.new_state(structured_output.StructuredOutputParams("json_schema", SCHEMA))
        for token in engine.tokenizer.encode('{"notes": "The city', add_special_tokens=False):
            assert state.accept(token)
        structured_output.fill_bitmasks([(i, state) for i in range(rows)], inputs["token_bitmask"])
    logits = jax.device_put(np.random.default_rng(0).standard_normal((num_rows, vocab)).astype(np.float32))
    key = (num_rows, False, ALWAYS_BIAS)
    sample = runner.executables.get("sample", key) or runner.lower_sampler(key).compile()  # compiled if not warmed up
    jax.block_until_ready(sample(logits, inputs))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(sample(logits, inputs))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--steps", type=int, default=60, help="decode steps timed per engine and row count")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    from jaxserve import platforms
    platforms.default_to_cpu_without_gpu()
    from jaxserve.engine import Engine, EngineConfig

    row_counts = [int(r) for r in args.rows.split(",")]
    config = EngineConfig(max_num_seqs=max(row_counts), max_num_batched_tokens=max(64, max(row_counts)),
                          max_num_prefill_seqs=2, max_model_len=512, enable_prefix_caching=False, warmup=False)
    plain = Engine.from_model(args.model, config)
    engines = {False: plain, True: Engine(plain.model_config, plain.runner.params, plain.tokenizer, config,
                                          model_name=plain.model_name)}
    fills = timed_fill_bitmasks()
    for rows in row_counts:  # compile every shape first (warmup=False: only the shapes used)
        paired_decode_steps(engines, rows, 2, seed=999, fills=fills)
    table = []
    for rows in row_counts:
        run = paired_decode_steps(engines, rows, args.steps, 0, fills)
        samplers = {False: [], True: []}
        for i in range(6):
            for constrained in ((False, True) if i % 2 == 0 else (True, False)):
                samplers[constrained].append(sampler_seconds(engines[True], rows, constrained))
        table.append({
            "rows": rows, "step_ms": run["plain"] * 1e3, "step_grammar_ms": run["grammar"] * 1e3,
            "overhead_ms": run["difference"] * 1e3, "overhead_pct": 100 * run["difference"] / run["plain"],
            "fill_ms": run["fill"] * 1e3, "sampler_ms": statistics.median(samplers[False]) * 1e3,
            "sampler_masked_ms": statistics.median(samplers[True]) * 1e3})
    info = common.machine_info(with_jax=True)
    print(common.machine_line(info))
    print(f"model {args.model}, {args.steps} decode steps per engine, the two engines alternating; medians "
          "(+ms: median of the paired differences)")
    print(common.format_table(table, [
        ("rows", "rows", "d"), ("step_ms", "step ms", ".1f"), ("step_grammar_ms", "with grammar", ".1f"),
        ("overhead_ms", "+ms", ".2f"), ("overhead_pct", "+%", ".1f"), ("fill_ms", "mask fill ms", ".2f"),
        ("sampler_ms", "sampler ms", ".2f"), ("sampler_masked_ms", "sampler masked ms", ".2f")]))
    common.write_json(args.output, {"machine": info, "model": args.model, "steps": args.steps, "schema": SCHEMA,
                                    "results": table})


if __name__ == "__main__":
    main()
