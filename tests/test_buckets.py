"""Step buckets chosen from measured step times: the rule (jaxserve.core.bucket_choice), the explicit
bucket lists (--decode_buckets / --prefill_buckets: parsed, refused when bad, compiled exactly),
`jaxserve plan --measure_buckets` on the tiny model (its printed flags are what the engine takes),
and the shapes a GPU engine compiles (one table width where the kernels' cost follows the
contexts, decode steps sharing a sampler with their decode + prefill steps)."""
import dataclasses
import itertools
import re

import numpy as np
import pytest
from absl import flags

from jaxserve.commands import cli, engine_flags
from jaxserve.commands import serve as serve_command
from jaxserve.config import EngineConfig
from jaxserve.core import bucket_choice, step
from jaxserve.core.request import SamplingParams
from jaxserve.core.step import Bucket, BucketSet
from jaxserve.executor import step_functions

choose = bucket_choice.choose_buckets


# ---- the rule --------------------------------------------------------------------------------
def test_a_bucket_whose_next_kept_bucket_costs_within_the_tolerance_is_dropped():
    times = {1: 10.0, 2: 10.5, 4: 11.0, 8: 20.0, 16: 21.0, 32: 40.0}
    # 16 -> 32 is +90%: kept; 8 -> 16 is +5%: dropped; 4 -> 16 is +91%: kept; 2 -> 4 +4.8%, 1 -> 4 +10%.
    assert choose(times, 0.10) == (4, 16, 32)  # 1 -> 4 costs exactly +10%: within the tolerance
    assert choose(times, 0.099) == (1, 4, 16, 32)
    assert choose(times, 0.0) == (1, 2, 4, 8, 16, 32)  # strictly increasing times: all kept at 0
    assert choose(times, 10.0) == (32,)  # everything within 4x of the largest


def test_ties_drop_the_smaller_bucket_and_the_largest_is_always_kept():
    assert choose({1: 5.0, 2: 5.0, 4: 5.0}, 0.0) == (4,)
    assert choose({7: 3.0}, 0.0) == (7,)
    # A larger bucket measured faster (noise) than a smaller one: the smaller is dropped.
    assert choose({1: 5.0, 2: 4.0, 4: 9.0}, 0.0) == (2, 4)
    # Unordered input, integer-valued sizes: the answer is ascending.
    assert choose({32: 9.0, 1: 1.0, 8: 2.0}, 0.0) == (1, 8, 32)


def _padded_cost_bound_holds(times, kept, tolerance):
    return all(times[bucket_choice.padded_into(s, kept)] <= (1 + tolerance) * times[s] for s in times)


def test_random_times_keep_the_guarantee_the_minimum_and_monotonicity():
    rng = np.random.default_rng(0)
    tolerances = [0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
    for _ in range(200):
        n = int(rng.integers(1, 8))
        sizes = [2 ** i for i in range(n)]
        increments = rng.choice([0.0, 0.01, 0.05, 0.1, 0.3, 1.0], size=n)
        times = dict(zip(sizes, np.cumsum(1.0 + increments).tolist()))  # non-decreasing in the size
        counts = []
        for tolerance in tolerances:
            kept = choose(times, tolerance)
            assert kept[-1] == sizes[-1] and list(kept) == sorted(set(kept)) and set(kept) <= set(sizes)
            assert _padded_cost_bound_holds(times, kept, tolerance)
            # No smaller subset (with the largest) keeps the bound: the rule keeps the fewest.
            smaller = [c for r in range(1, len(kept)) for c in itertools.combinations(sizes[:-1], r - 1)]
            assert not any(_padded_cost_bound_holds(times, (*c, sizes[-1]), tolerance) for c in smaller)
            counts.append(len(kept))
        assert counts == sorted(counts, reverse=True)  # a larger tolerance never keeps more


@pytest.mark.parametrize("times, tolerance", [({}, 0.1), ({0: 1.0}, 0.1), ({2: 0.0}, 0.1), ({2: float("nan")}, 0.1),
                                              ({2: 1.0}, -0.1), ({2.5: 1.0}, 0.1)])
def test_bad_measurements_are_refused(times, tolerance):
    with pytest.raises(ValueError):
        choose(times, tolerance)


# ---- explicit bucket lists -------------------------------------------------------------------
def _buckets(backend="xla", **lists):
    """The BucketSet of the lists given as flag text (EngineConfig parses and checks them)."""
    config = EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, **lists)
    return BucketSet.create(backend=backend, max_num_seqs=32, max_num_batched_tokens=512, max_num_prefill_seqs=2,
                            max_model_len=1024, page_size=16, decode_buckets=config.decode_buckets,
                            prefill_buckets=config.prefill_buckets)


def test_explicit_lists_replace_the_geometric_sizes():
    default = _buckets()
    assert default.decode_sizes == (1, 2, 4, 8, 16, 32) and default.prefill_sizes == (32, 64, 128, 256, 512)
    # The default's own sizes spelled out give the same buckets.
    assert _buckets(decode_buckets="1,2,4,8,16,32", prefill_buckets="32,64,128,256,512") == default
    chosen = _buckets(decode_buckets="1,4,16,32", prefill_buckets="128,512")
    assert chosen.decode_only == (1, 4) and chosen.decode == (0, 16, 32) and chosen.prefill == (0, 128, 512)
    assert chosen.fit(3, 0, 10) == Bucket(4, 0, 64) and chosen.fit(3, 100, 10) == Bucket(16, 128, 64)
    assert chosen.fit(0, 129, 1) == Bucket(0, 512, 64)
    # Off the CPU no decode-only buckets: every size combines with prefill.
    gpu = _buckets("pallas", decode_buckets="1,4,32")
    assert gpu.decode_only == () and gpu.decode == (0, 1, 4, 32)


@pytest.mark.parametrize("value, message", [
    ("", "comma-separated positive integers"), ("1,x,32", "comma-separated positive integers"),
    ("1,,32", "comma-separated positive integers"), ("0,32", "at least 1"), ("-4,32", "at least 1"),
    ("8,4,32", "strictly ascending"), ("4,4,32", "strictly ascending"), ("1,16", "must be --max_num_seqs=32"),
    ("1,64", "must be --max_num_seqs=32")])
def test_bad_decode_lists_are_refused_naming_the_flag(value, message):
    with pytest.raises(step.BucketListError, match=re.escape(message)) as raised:
        _buckets(decode_buckets=value)
    assert "--decode_buckets" in str(raised.value)


@pytest.mark.parametrize("argv, message", [
    (["--decode_buckets=1,8,16"], "the largest size must be --max_num_seqs=32"),
    (["--max_num_seqs=16", "--decode_buckets=1,8,32"], "the largest size must be --max_num_seqs=16"),
    (["--prefill_buckets=64,x"], "--prefill_buckets='64,x': expected comma-separated positive integers"),
    (["--max_num_batched_tokens=256", "--prefill_buckets=64,512"], "must be --max_num_batched_tokens=256")])
@pytest.mark.parametrize("command", ["serve", "generate", "plan"])
def test_bad_bucket_flags_exit_2_before_anything_loads(command, argv, message, capsys):
    assert cli.main(["jaxserve", command, "--model=/nonexistent", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "/nonexistent" not in err


def test_a_bad_list_given_to_the_engine_directly_is_refused_before_loading():
    from jaxserve.engine import Engine
    with pytest.raises(step.BucketListError, match="--prefill_buckets"):
        Engine.from_model("/nonexistent", EngineConfig(prefill_buckets="32,64"))


def _serve_engine_config(argv) -> EngineConfig:
    fv = flags.FlagValues()
    serve_command.define_flags(fv)
    fv(["jaxserve serve", *argv])
    return engine_flags.engine_config(fv)


def test_the_engine_compiles_exactly_the_explicit_buckets(tiny_chat_model_dir):
    from jaxserve.engine import Engine
    cfg = _serve_engine_config(["--max_num_seqs=8", "--max_num_batched_tokens=64", "--page_size=8",
                                "--max_model_len=128", "--num_pages=64", "--decode_buckets=2,8",
                                "--prefill_buckets=16,64"])
    engine = Engine.from_model(tiny_chat_model_dir, cfg)
    pages = 128 // 8
    expected = {Bucket(2, 0, pages)} | {Bucket(d, p, pages) for d in (0, 8) for p in (0, 16, 64) if d or p}
    assert set(engine.runner.executables.keys("forward")) == expected
    # A step of one decoding sequence runs in the 2-row bucket, a 20-token prompt in the 64-token one.
    outputs = engine.generate([list(range(5, 25))], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(outputs[0].token_ids) == 3
    shapes = {(r.bucket_decode_rows, r.bucket_prefill_tokens) for r in engine.step_records}
    assert shapes == {(0, 64), (2, 0)}
    assert set(engine.runner.executables.keys("forward")) == expected  # nothing compiled beside them


# ---- plan --measure_buckets ------------------------------------------------------------------
MEASURE_ENGINE = ["--max_num_seqs=4", "--max_num_batched_tokens=64", "--max_model_len=128", "--page_size=8"]


def test_measure_buckets_prints_flags_the_engine_takes(tiny_chat_model_dir, capsys):
    argv = [f"--model={tiny_chat_model_dir}", *MEASURE_ENGINE]
    assert cli.main(["jaxserve", "plan", *argv, "--measure_buckets", "--measure_context_len=32",
                     "--measure_repeats=3", "--format=table"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out.strip().splitlines()
    table = [line.split() for line in out if line.startswith(("decode ", "prefill "))]
    # Every candidate of the default rule timed: decode rows 1, 2, 4 and prefill tokens 32, 64.
    assert [(row[0], int(row[1])) for row in table] == [("decode", 1), ("decode", 2), ("decode", 4),
                                                        ("prefill", 32), ("prefill", 64)]
    assert all(float(row[2]) > 0 for row in table)
    line = out[-1]
    match = re.fullmatch(r"--decode_buckets=([\d,]+) --prefill_buckets=([\d,]+)", line)
    assert match, line
    decode, prefill = (tuple(int(s) for s in group.split(",")) for group in match.groups())
    assert decode[-1] == 4 and prefill[-1] == 64  # the largest always kept
    assert {int(row[1]) for row in table if row[-1] == "yes"} == set(decode) | set(prefill)
    from jaxserve.engine import Engine  # the engine serve builds from those flags has those buckets
    cfg = _serve_engine_config([f"--model={tiny_chat_model_dir}", *MEASURE_ENGINE, *line.split()])
    engine = Engine.from_model(tiny_chat_model_dir, dataclasses.replace(cfg, warmup=False, num_pages=64))
    assert engine.runner.buckets.decode_sizes == decode and engine.runner.buckets.prefill_sizes == prefill


def test_measure_buckets_refuses_flags_it_cannot_measure(tiny_chat_model_dir, capsys):
    assert cli.main(["jaxserve", "plan", "--measure_buckets", "--target=h100"]) == 2
    assert "--measure_buckets times steps on this machine" in capsys.readouterr().err
    assert cli.main(["jaxserve", "plan", f"--model={tiny_chat_model_dir}", *MEASURE_ENGINE, "--num_pages=4",
                     "--measure_buckets"]) == 2
    assert "needs --num_pages >= " in capsys.readouterr().err
    assert cli.main(["jaxserve", "plan", f"--model={tiny_chat_model_dir}", "--max_model_len=32",
                     "--max_num_batched_tokens=64", "--max_num_seqs=4", "--measure_buckets"]) == 2
    assert "more than max_model_len 32" in capsys.readouterr().err


# ---- table widths and sampler rows off the CPU path -------------------------------------------
def _engine_buckets(backend, kv_cache_dtype="auto"):
    config = EngineConfig(max_num_seqs=256, max_num_batched_tokens=2048, max_num_prefill_seqs=4,
                          kv_cache_dtype=kv_cache_dtype)
    return step_functions.bucket_set(config, backend, max_model_len=8192)


@pytest.mark.parametrize("backend, kv_cache_dtype, widths", [
    ("xla", "auto", (512,)), ("pallas", "auto", (512,)), ("triton", "int8", (512,)), ("interpret", "fp8", (512,)),
    ("mosaic", "auto", (512,)), ("mosaic", "fp8", (512,)),
    # The Mosaic kernels over int8 pages gather the whole table's scales; the reference reads every page.
    ("mosaic", "int8", (16, 64, 256, 512)), ("mosaic_interpret", "int8", (16, 64, 256, 512)),
    ("reference", "auto", (16, 64, 256, 512))])
def test_table_widths_are_bucketed_only_where_a_wider_table_costs_more(backend, kv_cache_dtype, widths):
    buckets = _engine_buckets(backend, kv_cache_dtype)
    assert buckets.pages == widths
    assert {bucket.pages_per_seq for bucket in buckets.all()} == set(widths)
    assert buckets.fit(3, 20, 1) == Bucket(8, 32, widths[0])


def _sampler_rows(buckets):
    return {bucket: len(buckets.empty_batch(bucket)["logits_indices"]) for bucket in buckets.all()}


def test_off_the_cpu_a_decode_step_shares_the_sampler_of_its_decode_and_prefill_step():
    """Llama-3-8B's GPU engine at the default limits: 55 step shapes (one width) and 7 sampler row
    counts, where every table width and row count of its own (220 and 13) compiled before."""
    buckets = _engine_buckets("pallas")
    rows = _sampler_rows(buckets)
    assert len(rows) == 55
    assert sorted(set(rows.values())) == [4, 12, 20, 36, 68, 132, 260]
    for bucket, count in rows.items():
        assert count == (bucket.num_decode + 4 if bucket.num_decode else 4), bucket
    # The padding rows point at token 0: the step reads the decode rows first, then the prefill chunks.
    decode_only = buckets.empty_batch(Bucket(8, 0, 512))
    assert decode_only["logits_indices"].shape == (12,) and decode_only["prefill_seq_lens"].shape == (0,)
    # The CPU path keeps a decode step's rows its own (the LM head and sampler cost per row there).
    cpu = _sampler_rows(_engine_buckets("xla"))
    assert sorted(set(cpu.values())) == [1, 2, 4, 8, 12, 16, 20, 32, 36, 64, 68, 128, 132, 256, 260]
