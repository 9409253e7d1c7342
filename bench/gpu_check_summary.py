"""The one JSON summary of bench/gpu_check.sh, written again after every step, and its table.

    python bench/gpu_check_summary.py machine OUT.json          # what the machine has (no jax start-up needed)
    python bench/gpu_check_summary.py add SUMMARY --name=NAME --rc=RC --start=T --end=T --timeout=S --gpu-limit=S --log=LOG [--report=J]
    python bench/gpu_check_summary.py table SUMMARY             # the short table printed last

The summary: {"check": ..., "steps": [{"name", "rc", "wall_s", "timeout_s", "timed_out", "log",
"figures": {key figures parsed from the step's JSON or log}, "report": the step's whole JSON}]}.
Only the standard library here: it must run even where a step died of a missing package.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from importlib import metadata

# The lent machine's packages (../shared/GPU.md); gguf and llguidance are not there.
PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "flax", "orbax-checkpoint",
            "transformers", "tokenizers", "safetensors", "sentencepiece", "jinja2", "aiohttp", "absl-py",
            "prometheus-client", "tqdm", "numpy", "psutil", "pytest", "torch", "triton", "gguf", "llguidance",
            "nvidia-cuda-nvcc", "nvidia-cuda-nvcc-cu12")
MAX_LOG_BYTES = 4 << 20  # a log longer than this keeps its head and tail (16 MiB come back per file)


def machine(out: str) -> int:
    info = {"python": platform.python_version(), "cpus": os.cpu_count(), "packages": {}}
    for name in PACKAGES:
        try:
            info["packages"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info["packages"][name] = None
    info["ptxas"] = shutil.which("ptxas")
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = (smi.stdout or smi.stderr).strip()
    probe = ("import json, jax; from pallas_kernels import dispatch; d = jax.devices(); print(json.dumps("
             "{'jax_backend': jax.default_backend(), 'devices': [str(x) for x in d], 'device_kind': d[0].device_kind, "
             "'default_attention_backend': dispatch.attention_backend()}))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    sys.stderr.write(result.stderr[-4000:])
    if result.returncode == 0:
        info.update(json.loads(result.stdout.strip().splitlines()[-1]))
    with open(out, "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps(info, indent=1))
    return result.returncode


def pytest_counts(log_text: str) -> dict:
    """passed / failed / skipped / errors from pytest's closing line, else from its -v lines (killed run)."""
    counts = {}
    closing = [line for line in log_text.splitlines() if re.match(r"^=* ?\d+ (passed|failed|skipped|error)", line)
               or re.search(r"=+ .*\d+ (passed|failed|error).* in [\d.]+s", line)]
    if closing:
        for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", closing[-1]):
            counts["errors" if word.startswith("error") else word] = int(number)
        counts["finished"] = True
    else:
        for word in ("PASSED", "FAILED", "SKIPPED", "ERROR"):
            key = {"ERROR": "errors"}.get(word, word.lower())
            counts[key] = len(re.findall(rf"::\S+ {word}\b", log_text))
        counts["finished"] = False
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", log_text, re.M)
    if failed:
        counts["failed_tests"] = failed[:20]
    return counts


def figures(name: str, report: dict | None, log_text: str) -> dict:
    """The few numbers of a step worth a line of the table."""
    if name == "kernel_tests":
        return pytest_counts(log_text)
    if report is None:
        return {}
    if name == "machine":
        return {k: report.get(k) for k in ("device_kind", "jax_backend", "default_attention_backend", "python")} | {
            "jax": report["packages"].get("jax"), "num_devices": len(report.get("devices", []))}
    if name == "kernels":
        out = {"mode": report["mode"], "backends": report["backends"], "copy_gb_per_s": report["copy"]["gb_per_s"],
               "matmul_tflop_per_s": report["matmul"]["tflop_per_s"],
               "decode": [{"backend": r["backend"], "kv_dtype": r["kv_dtype"], "batch": r["batch"],
                           "context": r["context"], "gb_per_s": r["gb_per_s"],
                           "fraction_of_copy_bandwidth": r["fraction_of_copy_bandwidth"],
                           "max_abs_diff_vs_triton": r["max_abs_diff_vs_triton"]} for r in report["decode"]],
               "ragged": [{"backend": r["backend"], "tflop_per_s": r["tflop_per_s"],
                           "fraction_of_matmul_rate": r["fraction_of_matmul_rate"],
                           "max_abs_diff_vs_triton": r["max_abs_diff_vs_triton"]} for r in report["ragged"]]}
        return out
    if name == "e2e":
        roof = report["decode_roofline"]
        return {"model": report["model"], "attention_backend": report.get("attention_backend"),
                "startup_s": report["startup_s"], "num_step_shapes": report.get("num_step_shapes"),
                "copy_bandwidth_GBps": report["copy_bandwidth_GBps"],
                "offline_output_tokens_per_s": report["offline"]["output_tokens_per_s"],
                "decode_batch": roof["batch"], "decode_step_ms": roof["step_ms"], "roofline_ms": roof["roofline_ms"],
                "fraction_of_roofline": roof["fraction_of_roofline"],
                "greedy_agree_with_xla": report.get("greedy_agreement", {}).get("agree_with_xla"),
                "serving": [{k: s[k] for k in ("concurrency", "output_tokens_per_s", "ttft_ms_p99", "tpot_ms_p50")}
                            for s in report["serving"]],
                "memory": report["memory"]}
    if name == "executables":
        return {k: report.get(k) for k in ("status", "reason", "shapes_loaded", "startup_loaded_s",
                                            "startup_compiled_s", "greedy_equal")}
    if name == "gpu_compile":
        return {"runs": [{k: r[k] for k in ("model", "target", "num_shapes", "num_failed", "seconds",
                                              "planned_over_largest_temp")}
                         | {"kernels": [{k: kr.get(k) for k in ("name", "registers", "spill_store_bytes",
                                                                 "spill_load_bytes", "shared_memory_bytes")}
                                        for kr in r.get("kernels", [])]}
                         for r in report["runs"]]}
    return {}


def trim_log(path: str) -> None:
    if os.path.getsize(path) <= MAX_LOG_BYTES:
        return
    with open(path, "rb") as f:
        data = f.read()
    half = MAX_LOG_BYTES // 2
    with open(path, "wb") as f:
        f.write(data[:half] + b"\n[... %d bytes cut by gpu_check_summary.py ...]\n" % (len(data) - 2 * half)
                + data[-half:])


def add(args) -> int:
    summary = {"check": "bench/gpu_check.sh", "steps": []}
    if os.path.exists(args.summary):
        with open(args.summary) as f:
            summary = json.load(f)
    summary.update({k: v for k, v in (("mode", args.mode), ("started", args.started)) if v})
    log_text = ""
    if args.log and os.path.exists(args.log):
        trim_log(args.log)
        with open(args.log, errors="replace") as f:
            log_text = f.read()
    report, error = None, None
    if args.report and os.path.exists(args.report):
        try:
            with open(args.report) as f:
                report = json.load(f)
        except ValueError as e:
            error = f"unreadable report: {e}"
    step = {"name": args.name, "rc": args.rc, "wall_s": round(args.end - args.start, 1), "timeout_s": args.timeout, "gpu_limit_s": args.gpu_limit,
            "timed_out": args.rc in (124, 137), "log": os.path.basename(args.log) if args.log else None}
    try:
        step["figures"] = figures(args.name, report, log_text)
    except (KeyError, TypeError, ZeroDivisionError) as e:  # a report without its fields: say so, keep the rest
        step["figures"], error = {}, f"figures: {type(e).__name__}: {e}"
    if error:
        step["error"] = error
    if report is not None:
        step["report"] = report
    summary["steps"] = [s for s in summary["steps"] if s["name"] != args.name] + [step]
    summary["ok"] = all(s["rc"] == 0 and "error" not in s for s in summary["steps"])
    temporary = args.summary + ".tmp"
    with open(temporary, "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(temporary, args.summary)  # on disk whole as soon as the step ends
    return 0


def short(name: str, fig: dict) -> str:
    """One line of key figures."""
    if not fig:
        return ""
    if name == "machine":
        return f"{fig.get('num_devices')} x {fig.get('device_kind')}, jax {fig.get('jax')}, " \
               f"attention {fig.get('default_attention_backend')}"
    if name == "kernel_tests":
        return ", ".join(f"{fig[k]} {k}" for k in ("passed", "failed", "skipped", "errors") if fig.get(k)) + \
            ("" if fig.get("finished") else " (cut off)")
    if name == "kernels":
        decode = " ".join(f"{r['backend']}@{r['context']}{'' if r['kv_dtype'] == 'bfloat16' else '/' + r['kv_dtype']}:"
                          f"{100 * r['fraction_of_copy_bandwidth']:.0f}%" for r in fig["decode"])
        ragged = " ".join(f"{r['backend']}:{r['tflop_per_s']:.2f} ({100 * r['fraction_of_matmul_rate']:.0f}%)"
                          for r in fig["ragged"])
        return (f"copy {fig['copy_gb_per_s']:.0f} GB/s, matmul {fig['matmul_tflop_per_s']:.1f} TFLOP/s; decode % of "
                f"copy {decode}; ragged TFLOP/s {ragged}")
    if name == "e2e":
        serving = " ".join(f"c{s['concurrency']}:{s['output_tokens_per_s']:.0f}" for s in fig["serving"])
        return (f"start {fig['startup_s']:.0f} s ({fig['num_step_shapes']} shapes), offline "
                f"{fig['offline_output_tokens_per_s']:.0f} tok/s, decode b{fig['decode_batch']} "
                f"{fig['decode_step_ms']:.2f} ms vs roofline {fig['roofline_ms']:.2f} ms; serving tok/s {serving}")
    if name == "executables":
        if fig["status"] != "loaded":
            return f"{fig['status']}: {(fig.get('reason') or '')[:160]}"
        return (f"{fig['shapes_loaded']} shapes loaded in {fig['startup_loaded_s']:.1f} s (compiled: "
                f"{fig['startup_compiled_s']:.1f} s), greedy tokens {'equal' if fig['greedy_equal'] else 'DIFFER'}")
    if name == "gpu_compile":
        return "; ".join(f"{r['model']} {r['target']}: {r['num_shapes'] - r['num_failed']}/{r['num_shapes']} shapes "
                         f"in {r['seconds']} s" for r in fig["runs"])
    return ""


def table(path: str) -> int:
    with open(path) as f:
        summary = json.load(f)
    print(f"{'step':<13}{'rc':>4}{'wall s':>8}{'limit':>7}  key figures (limit: the GPU run's)")
    for step in summary["steps"]:
        line = step.get("error") or short(step["name"], step.get("figures") or {})
        print(f"{step['name']:<13}{step['rc']:>4}{step['wall_s']:>8.1f}{step['gpu_limit_s']:>7}  {line}")
    total = sum(s["wall_s"] for s in summary["steps"])
    print(f"{'total':<13}{'':>4}{total:>8.1f}{sum(s['gpu_limit_s'] for s in summary['steps']):>7}  "
          f"{'all ok' if summary.get('ok') else 'FAILED'} ({summary.get('mode')})")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("machine").add_argument("out")
    adding = sub.add_parser("add")
    adding.add_argument("summary")
    adding.add_argument("--name", required=True)
    adding.add_argument("--rc", type=int, required=True)
    adding.add_argument("--start", type=float, required=True, help="epoch seconds")
    adding.add_argument("--end", type=float, required=True)
    adding.add_argument("--timeout", type=int, required=True)
    adding.add_argument("--gpu-limit", type=int, required=True, help="the step's limit on the GPU")
    adding.add_argument("--log")
    adding.add_argument("--report")
    adding.add_argument("--mode")
    adding.add_argument("--started")
    sub.add_parser("table").add_argument("summary")
    args = parser.parse_args(argv)
    if args.command == "machine":
        return machine(args.out)
    if args.command == "add":
        return add(args)
    return table(args.summary)


if __name__ == "__main__":
    sys.exit(main())
