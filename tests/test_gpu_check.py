"""The device check's dry run (bench/gpu_check.sh --dry-run) in an environment shaped like the lent GPU
machine: Python 3.12, jax 0.11.2 with the CUDA 13 plugin, its package set and not gguf, llguidance or
torch, the project installed with --no-deps. Every step runs on the CPU at small sizes, so that the
first real run cannot die of an import, a flag or a missing package; the summary it writes must fit
what comes back from the lent machine (at most 8 files, at most two folders down, 16 MiB each).

`make install-gpu-rehearsal` builds that environment (.venv-gpu-rehearsal); `make test` runs this
file in it (`make test-gpu-rehearsal`: about 3 minutes on the 2-core machine, caches empty, as on
the lent machine). In any other environment it skips.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENT_JAX = "0.11.2"
# The step limits of the real run must leave room in one 10-minute call (shared/GPU.md: under 8 minutes).
MAX_TOTAL_LIMIT_S = 480


def rehearsal_environment() -> str | None:
    """Why this environment is not the rehearsal one, or None when it is."""
    import jax

    if sys.version_info[:2] != (3, 12):
        return f"Python {sys.version_info[0]}.{sys.version_info[1]}, not 3.12"
    if jax.__version__ != LENT_JAX:
        return f"jax {jax.__version__}, not {LENT_JAX}"
    present = [m for m in ("gguf", "llguidance", "torch") if importlib.util.find_spec(m)]
    if present:
        return f"{', '.join(present)} installed (the lent machine has no gguf, llguidance; torch kept out)"
    return None


REASON = rehearsal_environment()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"not the GPU rehearsal environment ({REASON}): "
                                "run it in .venv-gpu-rehearsal (make install-gpu-rehearsal)")
pytestmark = [pytestmark, pytest.mark.slow]  # the dry run in a subprocess: out of `make test-quick`

STEPS = ("machine", "kernel_tests", "kernels", "e2e", "executables", "gpu_compile")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check_out")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAXSERVE_ATTENTION_BACKEND")}
    env.update(OUT=str(out), PYTHON=sys.executable)
    start = time.perf_counter()
    result = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=2100)  # the step limits (475 s) x 4 for the dry run: 1900 s
    return result, out, time.perf_counter() - start


def test_dry_run_passes_every_step(dry_run):
    result, out, seconds = dry_run
    print(f"dry run: {seconds:.0f} s")
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in summary["steps"]] == list(STEPS)
    assert summary["mode"] == "dry-run" and summary["ok"] is True
    for step in summary["steps"]:
        assert step["rc"] == 0 and not step["timed_out"] and "error" not in step, step
        assert 0 < step["wall_s"] < step["timeout_s"], step
    assert sum(s["gpu_limit_s"] for s in summary["steps"]) < MAX_TOTAL_LIMIT_S
    # The table comes last, one row per step and a total.
    tail = result.stdout.strip().splitlines()[-len(STEPS) - 2:]
    assert tail[0].split()[:2] == ["step", "rc"] and [line.split()[0] for line in tail[1:]] == [*STEPS, "total"]
    assert "all ok (dry-run)" in tail[-1]


def test_what_comes_back_fits_the_lent_machine(dry_run):
    _, out, _ = dry_run
    files = [os.path.join(root, name) for root, _, names in os.walk(out) for name in names]
    assert len(files) <= 8, files
    for path in files:
        assert os.path.relpath(path, out).count(os.sep) <= 2, path
        assert os.path.getsize(path) <= 16 << 20, path
    assert sorted(os.path.basename(p) for p in files) == sorted(
        ["summary.json"] + [f"{s}.log" for s in STEPS if s != "machine"])


def test_the_summary_holds_each_steps_figures(dry_run):
    _, out, _ = dry_run
    steps = {s["name"]: s for s in json.loads((out / "summary.json").read_text())["steps"]}
    machine = steps["machine"]["figures"]
    assert machine["jax"] == LENT_JAX and machine["jax_backend"] == "cpu" and machine["num_devices"] >= 1
    packages = steps["machine"]["report"]["packages"]
    assert packages["jax-cuda13-plugin"] == LENT_JAX and packages["gguf"] is None and packages["llguidance"] is None
    tests = steps["kernel_tests"]["figures"]
    assert tests["finished"] and tests["passed"] == 4 and not tests.get("failed") and not tests.get("errors")
    kernels = steps["kernels"]["figures"]
    assert kernels["mode"] == "interpret" and kernels["copy_gb_per_s"] > 0 and kernels["matmul_tflop_per_s"] > 0
    assert kernels["backends"] == ["triton", "mosaic"]  # both kernel families, side by side
    assert [r["backend"] for r in kernels["decode"]] == ["triton", "mosaic"] * 4
    assert [r["kv_dtype"] for r in kernels["decode"]] == ["bfloat16"] * 4 + ["int8"] * 2 + ["fp8"] * 2
    assert all(0 < r["fraction_of_copy_bandwidth"] for r in kernels["decode"])
    assert [r["backend"] for r in kernels["ragged"]] == ["triton", "mosaic"]
    assert all(r["tflop_per_s"] > 0 and r["fraction_of_matmul_rate"] > 0 for r in kernels["ragged"])
    assert all(r["max_abs_diff_vs_triton"] < 0.1 for r in kernels["decode"] + kernels["ragged"])
    e2e = steps["e2e"]["figures"]
    assert e2e["attention_backend"] == "interpret" and "bf16" in e2e["model"]  # the GPU's path, small sizes
    assert e2e["num_step_shapes"] > 0 and e2e["startup_s"] > 0 and e2e["offline_output_tokens_per_s"] > 0
    assert e2e["decode_step_ms"] > 0 and e2e["roofline_ms"] > 0
    assert e2e["greedy_agree_with_xla"] == {"triton": True, "xla": True, "mosaic": True}
    assert [s["concurrency"] for s in e2e["serving"]] == [1, 8, 32]
    assert all(s["output_tokens_per_s"] > 0 and s["ttft_ms_p99"] > 0 for s in e2e["serving"])
    assert e2e["memory"]["planned_num_pages"] > 0 and e2e["memory"]["engine_num_pages"] > 0
    saved = steps["executables"]["figures"]  # saved for an H200 here, refused by the engine on the CPU
    assert saved["status"] == "refused" and "platform: saved gpu, here cpu" in saved["reason"], saved
    assert "devices: saved 1 x NVIDIA H200" in saved["reason"]
    (run,) = steps["gpu_compile"]["figures"]["runs"]
    assert (run["model"], run["target"]) == ("llama-3-8b", "h200")  # the real run's, under small engine limits
    assert run["num_shapes"] > 0 and run["num_failed"] == 0
    assert {k["name"] for k in run["kernels"]} >= {"paged_decode_attention", "ragged_paged_attention"}
    assert all(k["spill_store_bytes"] in (0, None) for k in run["kernels"])
