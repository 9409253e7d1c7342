"""bench/lora_pooling_gpu.py (bench/gpu_check.sh's `lora_pooling` step) in its --small mode on the
CPU: every figure measured and positive, the adapters' rows moved and the base rows not, the
embeddings agreeing with transformers'; and a step whose slab is never read, or whose embeddings
are not the model's, failing its check, a figure not measured leaving the step unknown."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # a subprocess, and tiny engines and steps compiled in the tests

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import lora_pooling_gpu  # noqa: E402
from gpu_check_report import StepReport  # noqa: E402

SMALL = lora_pooling_gpu.SMALL
HAS_TORCH = importlib.util.find_spec("torch") is not None
CHECK_ENV = ("GPU_CHECK_SUMMARY", "GPU_CHECK_STEP", "GPU_CHECK_MODE")


def positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


@pytest.fixture
def no_check_env(monkeypatch):
    for name in CHECK_ENV:
        monkeypatch.delenv(name, raising=False)


def test_the_small_run_measures_every_figure(tmp_path):
    out = tmp_path / "lora_pooling.json"
    env = {k: v for k, v in os.environ.items() if k not in CHECK_ENV}
    result = subprocess.run([sys.executable, "bench/lora_pooling_gpu.py", "--small", "--out", str(out)], cwd=REPO,
                            env={**env, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    families = lora_pooling_gpu.kernel_families(on_gpu=False)
    assert report["small"] and report["targets"] == lora_pooling_gpu.TARGETS
    # 1. the decode step: each kernel family's base, lora and lora-base steps, the adapters' rows moved
    assert [r["family"] for r in report["lora_decode"]] == list(families)
    for row in report["lora_decode"]:
        assert row["backend"] == families[row["family"]] and row["repeats"] == SMALL["repeats"] * SMALL["rounds"]
        assert all(positive(row[k]) for k in ("base_ms", "lora_ms", "lora_over_base", "lora_base_rows_over_base"))
        assert abs(row["lora_over_base"] - row["lora_ms"] / row["base_ms"]) < 1e-9 * row["lora_over_base"]
        applied = report["checks"][f"adapters_applied/{row['family']}"]
        rows_on_adapters = sum(1 for i in range(SMALL["rows"]) if i % (lora_pooling_gpu.MAX_LORAS + 1))
        assert applied["status"] == "ok" and applied["adapter_rows"] == rows_on_adapters, applied
        assert applied["smallest_adapter_row_difference"] > applied["margin"] * applied["largest_slot0_row_difference"]
    setup = report["lora_decode_setup"]
    assert (setup["rows"], setup["max_loras"], setup["rank"], setup["slab_dtype"]) == (SMALL["rows"], 4, 16, "bfloat16")
    assert all(all(takes.values()) for takes in setup["kernel_takes"].values()), setup["kernel_takes"]
    # 2. embeddings: jaxserve's, against transformers' where torch is
    embed = report["embeddings"]
    assert (embed["inputs"], embed["input_tokens"]) == (SMALL["inputs"], SMALL["input_tokens"])
    assert all(positive(embed[k]) for k in ("jaxserve_s", "tokens_per_s", "roofline_s", "fraction_of_roofline",
                                            "flops"))
    assert abs(embed["tokens_per_s"] * embed["jaxserve_s"] - SMALL["inputs"] * SMALL["input_tokens"]) < 1e-6
    assert [len(v) for v in embed["seconds"].values()] == [SMALL["embed_rounds"]] * (2 if HAS_TORCH else 1)
    assert embed["largest_norm_error"] < 1e-3 and positive(report["matmul_tflop_per_s"])
    vs = report["checks"]["embeddings_vs_transformers"]
    if HAS_TORCH:
        assert vs["status"] == "ok" and vs["lowest_cosine"] >= lora_pooling_gpu.MIN_COSINE, vs
        assert positive(embed["transformers_s"]) and positive(embed["over_transformers"])
    else:
        assert vs["status"] == "unknown" and "no torch" in vs["reason"]
    # 3. an adapter loaded at run time: every repeat's load call and first token, the first kept apart
    loads = report["lora_load"]
    assert [r["repeat"] for r in loads] == list(range(SMALL["load_repeats"] + 1))
    assert all(positive(r[k]) for r in loads for k in ("load_s", "first_token_s", "base_first_token_s"))
    assert all(r["first_token_s"] >= r["load_s"] for r in loads)  # both from the load call
    summary = report["lora_load_summary"]
    assert summary["first_token_s"]["max"] == max(r["first_token_s"] for r in loads[1:])
    assert summary["first_repeat"]["first_token_s"] == loads[0]["first_token_s"]
    assert report["checks"]["lora_load"] == {"status": "ok", "tokens": 2 * len(loads), "expected": 2 * len(loads)}
    assert report["lora_load_setup"]["adapter_bytes"] > 0 and positive(report["lora_load_setup"]["warm_request_s"])
    assert report["checks"]["every_figure"]["status"] == "ok"
    assert set(report["phase_s"]) >= {"lora_weights", "lora_decode", "embeddings", "lora_load"}
    assert "lora decode triton" in result.stdout and "lora load:" in result.stdout  # the table


def test_a_step_that_never_reads_the_slab_fails_its_check(tmp_path, no_check_env, monkeypatch):
    """Adapters whose updates never reach the rows (the slab passed, never read): the lora step's
    logits are the base step's, and the check says so."""
    import jax.numpy as jnp

    from jaxserve.models import lora, weights

    monkeypatch.setattr(lora.LayerLoRA, "update",
                        lambda self, x, name: jnp.zeros((x.shape[0], self.slab[name]["b"].shape[-1]), x.dtype))
    config = lora_pooling_gpu.TINY
    params = weights.random_params(config, dtype=lora_pooling_gpu.DTYPE)
    report = StepReport(str(tmp_path / "r.json"), lora_model="tiny")
    lora_pooling_gpu.lora_decode(report, SMALL, config, params, {"triton": "interpret"})
    check = report["checks"]["adapters_applied/triton"]
    assert check["status"] == "differ" and check["smallest_adapter_row_difference"] == 0, check
    assert report.exit_status() == 1


@pytest.mark.skipif(not HAS_TORCH, reason="transformers' side needs torch")
def test_embeddings_that_are_not_the_models_fail_the_comparison(tmp_path, no_check_env, monkeypatch):
    """jaxserve's embeddings paired with the wrong inputs (rows rotated by one) differ from transformers'."""
    measured = lora_pooling_gpu.engine_embeddings

    def rotated(engine, inputs):
        vectors, seconds = measured(engine, inputs)
        return np.roll(vectors, 1, axis=0), seconds

    monkeypatch.setattr(lora_pooling_gpu, "engine_embeddings", rotated)
    report = StepReport(str(tmp_path / "r.json"), embed_model="tiny")
    lora_pooling_gpu.embeddings(report, SMALL)
    check = report["checks"]["embeddings_vs_transformers"]
    assert check["status"] == "differ" and check["lowest_cosine"] < lora_pooling_gpu.MIN_COSINE, check
    assert report.exit_status() == 1


def test_a_figure_not_measured_leaves_the_step_unknown():
    families = {"triton": "interpret"}
    assert lora_pooling_gpu.every_figure({"checks": {}}, families)["status"] == "unknown"
    row = {"family": "triton", "base_ms": 1.0, "lora_ms": 1.2, "lora_over_base": 1.2, "lora_base_rows_over_base": 1.0}
    embed = {"jaxserve_s": 0.1, "tokens_per_s": 10.0, "roofline_s": 0.01, "fraction_of_roofline": 0.1,
             "transformers_s": 0.2, "over_transformers": 0.5}
    load = {k: {"median": 0.1, "max": 0.2} for k in ("load_s", "first_token_s", "base_first_token_s")}
    whole = {"checks": {}, "lora_decode": [row], "embeddings": embed, "lora_load_summary": load}
    assert lora_pooling_gpu.every_figure(whole, families)["status"] == "ok"
    for broken in ({**whole, "lora_decode": [{**row, "lora_ms": 0.0}]},  # a step that took no time
                   {**whole, "lora_load_summary": {}},  # the load never measured
                   {**whole, "embeddings": {**embed, "tokens_per_s": float("nan")}}):
        check = lora_pooling_gpu.every_figure(broken, families)
        assert check["status"] == "unknown" and "not measured" in check["reason"], check
