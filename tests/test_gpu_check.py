"""The device check, bench/gpu_check.sh, whose first real run on the lent GPU must not be wasted.

Anywhere (no GPU): a real run on a machine without a GPU stops within two minutes, non-zero, saying
that no GPU was found; the summary's rules (a missing figure, a skipped test, a spill ptxas did not
report are "unknown", never "ok"); the greedy comparison up to the reference's near-ties; each
figure reaching the summary as it is measured; the kernel benchmark comparing every backend with
the plain-jnp reference, each in its own guard; where ptxas is looked for.

In the environment shaped like the lent GPU machine (.venv-gpu-rehearsal: Python 3.12, jax 0.11.2
with the CUDA 13 plugin, not gguf or llguidance, the project installed with --no-deps; `make
install-gpu-rehearsal`), with only `python3` on PATH: the dry run (bench/gpu_check.sh --dry-run,
every step on the CPU at small sizes, caches empty) passes, its summary lists every step with its
status and seconds, what comes back fits the lent machine's limits (at most 8 files, at most two
folders down, 16 MiB each: the `lora_pooling` step's log comes back inside summary.json), and a dry
run killed in the middle of a step has left what finished.
`make test` runs this file there (`make test-gpu-rehearsal`; the dry run takes about 10 minutes on
the 2-core machine).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow  # the dry run and the no-GPU real run are subprocesses of minutes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "bench"))

import gpu_check_machine  # noqa: E402
import gpu_check_summary as summary_lib  # noqa: E402
from gpu_check_report import StepReport, compare_greedy  # noqa: E402

LENT_JAX = "0.11.2"
# The step limits of the real run: the whole check in under 8 minutes, leaving a rerun inside the 15-minute budget.
MAX_TOTAL_LIMIT_S = 460
STEPS = ("machine", "kernel_tests", "kernels", "agreement", "e2e", "kv_offload", "lora_pooling", "executables",
         "gpu_compile")
LOG_IN_SUMMARY = ("lora_pooling",)  # at most 8 files come back: this step's log comes back inside summary.json
# The checks the dry run cannot make, and why: the CPU keeps no device memory statistics; jax 0.11's
# deviceless compile leaves no PTX of the Triton kernels for ptxas to report spills of; without torch
# (the rehearsal environment has none, the lent machine has) there is no transformers reference.
UNKNOWN_IN_THE_DRY_RUN = {"e2e": {"plan_covers_peak"}, "gpu_compile": {"no_spills"}}
if importlib.util.find_spec("torch") is None:
    UNKNOWN_IN_THE_DRY_RUN["agreement"] = {"xla_vs_transformers", "triton_vs_transformers", "mosaic_vs_transformers"}
    UNKNOWN_IN_THE_DRY_RUN["lora_pooling"] = {"embeddings_vs_transformers"}


def rehearsal_environment() -> str | None:
    """Why this environment is not the rehearsal one, or None when it is."""
    import jax

    if sys.version_info[:2] != (3, 12):
        return f"Python {sys.version_info[0]}.{sys.version_info[1]}, not 3.12"
    if jax.__version__ != LENT_JAX:
        return f"jax {jax.__version__}, not {LENT_JAX}"
    present = [m for m in ("gguf", "llguidance") if importlib.util.find_spec(m)]
    if present:
        return f"{', '.join(present)} installed (the lent machine has neither)"
    return None


REASON = rehearsal_environment()
rehearsal = pytest.mark.skipif(REASON is not None, reason=f"not the GPU rehearsal environment ({REASON}): run it "
                               "in .venv-gpu-rehearsal (make install-gpu-rehearsal)")


def python3_only_env(folder) -> dict:
    """The environment of a run with only `python3` (this interpreter) on PATH, no `python`."""
    folder.mkdir(exist_ok=True)
    wrapper = folder / "python3"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    path = f"{folder}:/usr/bin:/bin"
    assert shutil.which("python", path=path) is None and shutil.which("python3", path=path) == str(wrapper)
    drop = ("JAX_PLATFORMS", "JAXSERVE_ATTENTION_BACKEND", "PYTHON", "GPU_CHECK_SUMMARY", "GPU_CHECK_STEP")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "PATH": path}


def read_summary(out) -> dict:
    return json.loads((out / "summary.json").read_text())


# ---- anywhere: the check's own rules ---------------------------------------------------------------

def test_a_real_run_without_a_gpu_stops_within_two_minutes_saying_so(tmp_path):
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA GPU")
    env = {**python3_only_env(tmp_path / "bin"), "OUT": str(tmp_path / "out")}
    start = time.perf_counter()
    result = subprocess.run(["bash", "bench/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=300)
    seconds = time.perf_counter() - start
    print(f"no-GPU real run: {seconds:.1f} s")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-2000:]
    assert seconds < 120
    assert "no GPU found" in result.stdout
    summary = read_summary(tmp_path / "out")
    assert summary["mode"] == "gpu" and summary["result"] == "failed"
    machine, *rest = summary["steps"]
    assert machine["name"] == "machine" and machine["status"] == "failed"
    assert machine["reason"].startswith("no GPU found: ") and machine["report"]["jax_platforms"] == "cuda,cpu"
    assert [(s["name"], s["status"]) for s in rest] == [(name, "not_run") for name in STEPS[1:]]


def test_on_the_gpu_run_every_steps_process_insists_on_the_gpu(monkeypatch):
    """A step whose own process found no GPU (CUDA failing after the first step's gate passed) stops,
    rather than measuring the CPU: the benchmarks' require_gpu, and the kernel tests' gate in their
    pytest process (where the tests would otherwise pass interpreted)."""
    import jax

    if jax.default_backend() == "gpu":
        pytest.skip("this machine has a GPU")
    from gpu_check_report import require_gpu

    require_gpu()  # not the check's GPU run: nothing asked
    monkeypatch.setenv("GPU_CHECK_MODE", "gpu")
    with pytest.raises(SystemExit) as stopped:
        require_gpu()
    assert stopped.value.code == 2
    env = {**os.environ, "GPU_CHECK_MODE": "gpu", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "bench/gpu_kernel_tests.py", "run", "--mode=gpu"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1 and "no GPU found in the kernel tests' process" in result.stderr, result.stderr
    assert "passed" not in result.stdout


def test_a_step_is_ok_only_when_every_comparison_compared_and_agreed():
    ok, unknown, differ = {"status": "ok"}, {"status": "unknown"}, {"status": "differ"}
    assert summary_lib.step_status(0, {"a": ok, "b": ok}, {}) == "ok"
    assert summary_lib.step_status(0, {}, {}) == "unknown"  # nothing compared is not a pass
    assert summary_lib.step_status(0, {"a": ok, "b": unknown}, {}) == "unknown"
    assert summary_lib.step_status(0, {"a": ok, "b": differ}, {}) == "failed"
    assert summary_lib.step_status(1, {"a": ok}, {}) == "failed"
    assert summary_lib.step_status(124, {"a": ok}, {}) == "timed_out"
    assert summary_lib.step_status(0, {}, {"status": "skipped"}) == "skipped"
    steps = [{"status": "ok"}, {"status": "unknown"}]
    assert summary_lib.overall(steps) == "incomplete"
    assert summary_lib.overall(steps + [{"status": "pending"}]) == "running"
    assert summary_lib.overall(steps + [{"status": "timed_out"}]) == "failed"
    assert summary_lib.overall([{"status": "ok"}]) == "ok"


def test_a_pytest_run_is_ok_only_when_it_finished_and_nothing_failed_or_skipped():
    check = lambda log: summary_lib.pytest_check(summary_lib.pytest_counts(log))["status"]  # noqa: E731
    assert check("===== 12 passed in 30.1s =====") == "ok"
    assert check("===== 11 passed, 1 skipped in 30.1s =====") == "unknown"
    assert check("===== 1 failed, 11 passed in 30.1s =====") == "failed"
    assert check("tests/a.py::x PASSED\ntests/a.py::y PASSED\n") == "unknown"  # cut off by the limit
    assert check("===== 3 skipped in 1.0s =====") == "unknown"


def test_spills_that_ptxas_did_not_report_are_unknown():
    kernel = {"name": "k", "spill_store_bytes": 0, "spill_load_bytes": 0}
    run = {"num_shapes": 9, "num_failed": 0, "kernels": [kernel]}
    checks = summary_lib.gpu_compile_checks({"runs": [run]})
    assert checks["shapes_compiled"]["status"] == "ok" and checks["no_spills"]["status"] == "ok"
    unreported = {**run, "kernels": [kernel, {**kernel, "spill_store_bytes": None}]}
    assert summary_lib.gpu_compile_checks({"runs": [unreported]})["no_spills"]["status"] == "unknown"
    spilling = {**run, "kernels": [{**kernel, "spill_load_bytes": 64}]}
    assert summary_lib.gpu_compile_checks({"runs": [spilling]})["no_spills"]["status"] == "differ"
    assert summary_lib.gpu_compile_checks({"runs": [{**run, "num_failed": 1}]})["shapes_compiled"]["status"] == "differ"
    assert summary_lib.gpu_compile_checks({"runs": []})["shapes_compiled"]["status"] == "unknown"


def test_a_lora_pooling_step_that_measured_nothing_is_not_ok():
    """bench/lora_pooling_gpu.py's report with no figure: its every_figure check is unknown, so the
    step is, and the summary's figures and table line still read it."""
    import lora_pooling_gpu

    report = {"checks": {"every_figure": lora_pooling_gpu.every_figure({"checks": {}}, {"triton": "pallas"})}}
    assert report["checks"]["every_figure"]["status"] == "unknown"
    assert summary_lib.step_status(0, report["checks"], report) == "unknown"
    figures = summary_lib.figures("lora_pooling", report, "")
    assert figures["lora_decode"] == [] and figures["lora_load"]["first_token_s"] is None
    assert "lora/base ?" in summary_lib.figures_line("lora_pooling", figures, {})


def test_greedy_tokens_are_compared_up_to_the_references_first_near_tie():
    reference, wide, tie_at_2 = [[5, 6, 7, 8]], [[1.0, 1.0, 1.0, 1.0]], [[1.0, 1.0, 0.01, 1.0]]
    same = compare_greedy([[5, 6, 7, 8]], reference, wide)
    assert same["status"] == "ok" and same["compared_positions"] == 4
    assert compare_greedy([[5, 6, 9, 8]], reference, wide)["status"] == "differ"
    after_tie = compare_greedy([[5, 6, 9, 1]], reference, tie_at_2)  # differs at the near-tie and after it
    assert after_tie["status"] == "ok" and after_tie["sequences"] == [
        {"compared": 2, "first_near_tie": 2, "first_difference": None}]
    assert compare_greedy([[5, 0, 9, 1]], reference, tie_at_2)["status"] == "differ"  # before it
    assert compare_greedy([[5]], reference, wide)["status"] == "differ"  # tokens missing
    assert compare_greedy([[1, 2]], [[3, 4]], [[0.0, 1.0]])["status"] == "unknown"  # a tie first: nothing compared
    assert compare_greedy([[5, 6]], [[5, 6]], [[None, 1.0]])["status"] == "unknown"  # an unknown gap is a tie
    assert compare_greedy([], reference, wide)["status"] == "differ"


def test_each_figure_reaches_the_summary_as_it_is_measured(tmp_path, monkeypatch):
    path = str(tmp_path / "summary.json")
    summary_lib.start(path, "gpu", "machine:20:60,kernels:60:240")
    summary_lib.begin(path, "kernels")
    monkeypatch.setenv("GPU_CHECK_SUMMARY", path)
    monkeypatch.setenv("GPU_CHECK_STEP", "kernels")
    report = StepReport(str(tmp_path / "kernels.json"), mode="compiled")
    report.put("copy", {"gb_per_s": 4300.0})
    with report.guard("decode/mosaic"):
        raise RuntimeError("Mosaic lowering failed")
    report.check("decode/triton", "ok", relative_difference=0.004)
    kernels = summary_lib.find_step(summary_lib.load(path), "kernels")
    assert kernels["status"] == "running" and kernels["figures"]["copy_gb_per_s"] == 4300.0
    assert kernels["checks"]["decode/mosaic"]["status"] == "failed"
    assert "Mosaic lowering failed" in kernels["checks"]["decode/mosaic"]["error"]
    assert kernels["checks"]["decode/triton"]["status"] == "ok" and report.exit_status() == 1
    assert summary_lib.load(path)["result"] == "running"  # machine pending, kernels cut: not a pass


def test_the_kernel_benchmark_compares_every_backend_with_the_reference(tmp_path):
    import jax.numpy as jnp
    import numpy as np

    import kernel_speed

    x = jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32)
    expected = np.asarray(x)
    families = list(kernel_speed.kernel_backends(interpret=True).values())

    def attention(backend, value):  # the first family off by 10%, any second one raises
        if backend == families[0]:
            return value * 1.1
        raise RuntimeError(f"{backend} does not lower")

    report = StepReport(str(tmp_path / "k.json"))
    rows = list(kernel_speed.run_backends(report, "decode/test", attention, (x,), expected, True, repeats=1))
    assert [family for family, _, _ in rows] == ["triton"]  # measured, though it differs
    assert report["checks"]["decode/test/triton"]["status"] == "differ"
    assert abs(report["checks"]["decode/test/triton"]["relative_difference"] - 0.1) < 1e-3
    if len(families) > 1:  # this jax has Mosaic GPU: its exception is its own check, failed
        assert report["checks"]["decode/test/mosaic"]["status"] == "failed"


def test_the_transformers_reference_tells_a_wrongly_mapped_model_apart():
    """The agreement step's reference can fail: the XLA path agrees with transformers on the same
    weights, and differs once the engine's gate and up projections are swapped (a mapping bug)."""
    pytest.importorskip("torch")
    import gpu_agreement

    size = gpu_agreement.SMALL
    config, rng = size["model"], __import__("numpy").random.default_rng(7)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in size["prompt_lengths"]]
    params = gpu_agreement.model_params(config)
    reference = gpu_agreement.run_transformers(config, params, prompts, size["max_tokens"])
    right = gpu_agreement.compare(gpu_agreement.run_engine(config, params, "xla", prompts, size), reference, "")
    assert right["status"] == "ok" and right["compared_positions"] > 0, right
    layers = params["layers"]
    swapped = {**params, "layers": {**layers, "w_gate": layers["w_up"], "w_up": layers["w_gate"]}}
    wrong = gpu_agreement.compare(gpu_agreement.run_engine(config, swapped, "xla", prompts, size), reference, "")
    assert wrong["status"] == "differ", wrong


def test_ptxas_is_looked_for_in_the_wheels_the_toolkit_and_path(tmp_path, monkeypatch):
    toolkit, elsewhere = tmp_path / "cuda", tmp_path / "elsewhere"
    for folder in (toolkit / "bin", elsewhere):
        folder.mkdir(parents=True)
        (folder / "ptxas").write_text("#!/bin/sh\n")
        (folder / "ptxas").chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(toolkit))
    monkeypatch.setenv("PATH", f"{elsewhere}:/usr/bin:/bin")
    candidates = gpu_check_machine.ptxas_candidates()
    cuda_home, on_path = candidates.index(str(toolkit / "bin")), candidates.index(str(elsewhere))
    assert candidates.index("/usr/local/cuda/bin") < on_path and cuda_home < on_path
    wheels = [c for c in candidates[:cuda_home] if os.path.isfile(os.path.join(c, "ptxas"))]
    assert gpu_check_machine.find_ptxas() == (wheels[0] if wheels else str(toolkit / "bin"))
    monkeypatch.setattr(gpu_check_machine, "ptxas_candidates", lambda: [str(tmp_path / "none")])
    assert gpu_check_machine.find_ptxas() is None


# ---- the dry run, in the rehearsal environment -------------------------------------------------------

@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check_out")
    env = {**python3_only_env(tmp_path_factory.mktemp("bin")), "OUT": str(out)}
    start = time.perf_counter()
    result = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=3300)  # the dry-run limits add up to 2960 s
    return result, out, time.perf_counter() - start


@rehearsal
def test_dry_run_passes_every_step(dry_run):
    result, out, seconds = dry_run
    print(f"dry run: {seconds:.0f} s")
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    summary = read_summary(out)
    assert [s["name"] for s in summary["steps"]] == list(STEPS) and summary["mode"] == "dry-run"
    for step in summary["steps"]:
        print(f"{step['name']}: {step['status']} in {step['wall_s']} s (limit {step['timeout_s']} s)")
        assert step["rc"] == 0 and not step["timed_out"] and 0 < step["wall_s"] < step["timeout_s"], step
        unknown = {name for name, check in step["checks"].items() if check["status"] != "ok"}
        assert unknown == UNKNOWN_IN_THE_DRY_RUN.get(step["name"], set()), (step["name"], step["checks"])
        assert all(step["checks"][name]["status"] == "unknown" for name in unknown)
        assert step["status"] == ("unknown" if unknown else "ok"), step
    assert summary["result"] == "incomplete"  # the CPU cannot measure everything: never "ok"
    assert sum(s["gpu_limit_s"] for s in summary["steps"]) <= MAX_TOTAL_LIMIT_S
    tail = result.stdout.strip().splitlines()[-len(STEPS) - 2:]  # the table comes last: a row per step, a total
    assert tail[0].split()[:2] == ["step", "status"] and [line.split()[0] for line in tail[1:]] == [*STEPS, "total"]
    assert "incomplete" in tail[-1] and "(dry-run)" in tail[-1]
    kv_offload_row = tail[1 + STEPS.index("kv_offload")]
    assert all(f in kv_offload_row for f in ("link h2d", "restore 4p:", "save 4p:", " 16p:")), kv_offload_row
    lora_pooling_row = tail[1 + STEPS.index("lora_pooling")]
    assert all(f in lora_pooling_row for f in ("lora/base triton ", " mosaic ", "tok/s", "of roofline",
                                               "load to 1st token")), lora_pooling_row


@rehearsal
def test_what_comes_back_fits_the_lent_machine(dry_run):
    _, out, _ = dry_run
    files = [os.path.join(root, name) for root, _, names in os.walk(out) for name in names]
    assert len(files) <= 8, files
    for path in files:
        assert os.path.relpath(path, out).count(os.sep) <= 2, path
        assert os.path.getsize(path) <= 16 << 20, path
    assert sorted(os.path.basename(p) for p in files) == sorted(
        ["summary.json"] + [f"{s}.log" for s in STEPS if s != "machine" and s not in LOG_IN_SUMMARY])
    steps = {s["name"]: s for s in read_summary(out)["steps"]}
    for name in LOG_IN_SUMMARY:  # its log inside the summary instead
        assert steps[name]["log"] is None and "every_figure: ok" in steps[name]["log_text"], steps[name]


@rehearsal
def test_the_summary_holds_each_steps_figures(dry_run):
    _, out, _ = dry_run
    steps = {s["name"]: s for s in read_summary(out)["steps"]}
    machine = steps["machine"]["figures"]
    assert machine["jax"] == LENT_JAX and machine["jax_backend"] == "cpu" and machine["num_devices"] >= 1
    assert machine["ptxas"] and machine["default_attention_backend"] == "xla"
    packages = steps["machine"]["report"]["packages"]
    assert packages["jax-cuda13-plugin"] == LENT_JAX and packages["gguf"] is None and packages["llguidance"] is None
    tests = steps["kernel_tests"]["figures"]
    assert tests["finished"] and tests["passed"] == 4 and not tests.get("failed") and not tests.get("skipped")
    kernels = steps["kernels"]["figures"]
    assert kernels["mode"] == "interpret" and kernels["copy_gb_per_s"] > 0 and kernels["matmul_tflop_per_s"] > 0
    assert kernels["backends"] == ["triton", "mosaic"]  # both kernel families, side by side
    assert [(r["backend"], r["kv_dtype"]) for r in kernels["decode"]] == [
        (family, kv) for kv in ("bfloat16", "bfloat16", "int8", "fp8") for family in ("triton", "mosaic")]
    assert [r["backend"] for r in kernels["ragged"]] == ["triton", "mosaic"]
    for row in kernels["decode"] + kernels["ragged"]:  # each against the plain-jnp reference, not each other
        assert 0 < row["relative_diff_vs_reference"] < 0.02 and (row.get("fraction_of_copy_bandwidth") or
                                                                 row.get("fraction_of_matmul_rate")) > 0
    grouped = kernels["grouped_matmul"]
    assert len(grouped) == 2 and all(r["relative_diff_vs_xla"] < 0.02 for r in grouped)
    agreement = steps["agreement"]["report"]["checks"]
    for name in ("triton_vs_xla", "mosaic_vs_xla") + (() if "agreement" in UNKNOWN_IN_THE_DRY_RUN else (
            "xla_vs_transformers", "triton_vs_transformers", "mosaic_vs_transformers")):
        assert agreement[name]["status"] == "ok" and agreement[name]["compared_positions"] > 0, agreement[name]
    e2e = steps["e2e"]["figures"]
    assert e2e["attention_backend"] == "interpret" and e2e["num_pages"] == 8 * 16 + 1
    assert e2e["num_step_shapes"] > 0 and e2e["startup_s"] > 0 and e2e["offline_output_tokens_per_s"] > 0
    assert e2e["decode_step_ms"] > 0 and e2e["roofline_ms"] > 0
    assert [s["concurrency"] for s in e2e["serving"]] == [1, 8, 32]
    kv = steps["kv_offload"]["figures"]  # restores and saves through HostKVStore against the host link
    assert kv["machine"] == f"cpu, jax {LENT_JAX} (cpu)" and kv["page_bytes"] == 2 * 2 * 4 * 2 * 16 * 2
    assert kv["host_to_device_gb_per_s"] > 0 and kv["device_to_host_gb_per_s"] > 0
    for kind in ("restore", "save"):
        assert [r["pages"] for r in kv[kind]] == [4, 16]
        assert all(r["gb_per_s"] > 0 and r["ratio_to_host_link"] > 0 for r in kv[kind]), kv[kind]
    trip = steps["kv_offload"]["checks"]["round_trip"]
    assert trip["status"] == "ok" and trip["saved_pages_equal"] == trip["restored_pages_equal"] == 16
    assert steps["kv_offload"]["wall_s"] < 30  # CI runs the dry run: the step stays a few seconds
    lp = steps["lora_pooling"]["figures"]  # multi-LoRA's decode step and load, embeddings (issues 50 and 51)
    assert lp["machine"] == f"cpu, jax {LENT_JAX} (cpu)"
    assert [(r["family"], r["backend"]) for r in lp["lora_decode"]] == [("triton", "interpret"),
                                                                         ("mosaic", "mosaic_interpret")]
    for row in lp["lora_decode"]:
        assert row["base_ms"] > 0 and row["lora_ms"] > 0 and row["lora_over_base"] > 0, row
    lp_checks = steps["lora_pooling"]["checks"]
    assert all(lp_checks[f"adapters_applied/{f}"]["status"] == "ok" for f in ("triton", "mosaic")), lp_checks
    embed = lp["embeddings"]
    assert embed["jaxserve_s"] > 0 and embed["tokens_per_s"] > 0 and embed["fraction_of_roofline"] > 0
    assert lp["lora_load"]["repeats"] == 3 and lp["lora_load"]["first_token_s"] > 0 and lp["lora_load"]["load_s"] > 0
    assert lp_checks["lora_load"]["status"] == lp_checks["every_figure"]["status"] == "ok"
    assert steps["lora_pooling"]["wall_s"] < 90  # CI runs the dry run: about 20 s here
    saved = steps["executables"]["report"]
    assert saved["status"] == "loaded" and saved["shapes_loaded"] > 0
    assert saved["checks"]["greedy_vs_compiled"]["compared_positions"] > 0
    assert "platform: saved gpu, here cpu" in saved["checks"]["refused_elsewhere"]["reason"]
    (run,) = steps["gpu_compile"]["figures"]["runs"]
    assert (run["model"], run["target"]) == ("llama-3-8b", "h200") and run["num_shapes"] > 0
    assert {k["name"] for k in run["kernels"]} >= {"paged_decode_attention", "ragged_paged_attention"}


@rehearsal
def test_a_dry_run_killed_in_the_middle_of_a_step_leaves_what_finished(tmp_path):
    """Killed (SIGKILL, the whole process group) once the kernel benchmark has written its first
    figures: the summary on disk is whole, the machine step finished, the kernel step running with
    those figures, the rest pending."""
    out = tmp_path / "out"
    env = {**python3_only_env(tmp_path / "bin"), "OUT": str(out)}
    check = subprocess.Popen(["bash", "bench/gpu_check.sh", "--dry-run", "--only=kernels"], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    try:
        while time.time() < deadline and check.poll() is None:
            time.sleep(0.5)
            try:
                kernels = summary_lib.find_step(read_summary(out), "kernels")
            except (OSError, ValueError):
                continue
            if kernels.get("figures", {}).get("copy_gb_per_s"):
                break
    finally:
        os.killpg(check.pid, signal.SIGKILL)
        check.wait()
    summary = read_summary(out)
    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == list(STEPS) and summary["result"] == "running"
    assert steps["machine"]["status"] == "ok" and steps["machine"]["wall_s"] > 0
    assert steps["kernel_tests"]["status"] == "not_run"  # not asked for
    assert steps["kernels"]["status"] == "running" and steps["kernels"]["figures"]["copy_gb_per_s"] > 0
    assert all(steps[name]["status"] == "pending" for name in STEPS[3:])
