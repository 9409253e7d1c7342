"""The one JSON summary of bench/gpu_check.sh, rewritten after every step and every figure, and its table.

    python3 bench/gpu_check_summary.py start SUMMARY --mode=gpu --plan=machine:20:120,kernel_tests:110:400,...
    python3 bench/gpu_check_summary.py begin SUMMARY NAME                # the step is running
    python3 bench/gpu_check_summary.py add SUMMARY --name=NAME --rc=RC --start=T --end=T --timeout=S \
        --gpu-limit=S [--log=LOG [--log-in-summary]] [--report=J]
    python3 bench/gpu_check_summary.py skip SUMMARY NAME --reason=WHY [--status=not_run]
    python3 bench/gpu_check_summary.py status SUMMARY NAME               # a step's status
    python3 bench/gpu_check_summary.py table SUMMARY                     # the short table printed last

The summary: {"check", "mode", "started", "result", "ok", "steps": [{"name", "status", "rc", "wall_s",
"timeout_s", "gpu_limit_s", "timed_out", "log", "log_text", "reason", "checks", "figures", "report"}]}: "log" names
the step's log file among those that come back, or with --log-in-summary (at most 8 files come back) the
log's text is "log_text" (at most MAX_SUMMARY_LOG_BYTES, its head and tail). Every planned
step is listed from the start ("pending"); a step is "running" from its start, with what its script has
measured so far (bench/gpu_check_report.py calls `running` after each figure), so that a call killed at
any moment leaves every finished step and the figures of the one it was in. A finished step is "ok"
(every comparison it makes compared two results and agreed), "unknown" (it ran, but some comparison had
nothing to compare: a missing figure is never "ok"), "failed", "timed_out" or "skipped" (with the
reason); "not_run" once the check stopped early (no GPU found). `result`: "failed" when a step failed or
timed out, "ok" when every step is ok, "running" while a step is pending or running, else "incomplete".
Only the standard library here: it must run even where a step died of a missing package.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

MAX_LOG_BYTES = 4 << 20  # a log longer than this keeps its head and tail (16 MiB come back per file)
MAX_SUMMARY_LOG_BYTES = 256 << 10  # the same for a log kept in the summary (--log-in-summary)
FINISHED = ("ok", "unknown", "failed", "timed_out", "skipped", "not_run")
BAD_CHECKS = ("differ", "failed")


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def save(path: str, summary: dict) -> None:
    """Writes the summary whole (a temporary file renamed over it: never half written)."""
    summary["result"] = overall(summary["steps"])
    summary["ok"] = summary["result"] == "ok"
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(temporary, path)


def overall(steps: list[dict]) -> str:
    statuses = [s["status"] for s in steps]
    if any(s in ("failed", "timed_out") for s in statuses):
        return "failed"
    if all(s == "ok" for s in statuses):
        return "ok"
    if any(s in ("pending", "running") for s in statuses):
        return "running"
    return "incomplete"


def find_step(summary: dict, name: str) -> dict:
    for step in summary["steps"]:
        if step["name"] == name:
            return step
    step = {"name": name, "status": "pending"}
    summary["steps"].append(step)
    return step


def start(path: str, mode: str, plan: str) -> None:
    """A new summary listing every planned step (name:gpu_limit_s:dry_run_limit_s, comma-separated,
    in the order they run) as pending, with the limit of this mode."""
    steps = []
    for item in plan.split(","):
        name, gpu_limit, dry_limit = item.split(":")
        steps.append({"name": name, "status": "pending", "gpu_limit_s": int(gpu_limit),
                      "timeout_s": int(dry_limit if mode == "dry-run" else gpu_limit)})
    save(path, {"check": "bench/gpu_check.sh", "mode": mode, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                       time.gmtime()),
                "steps": steps})


def begin(path: str, name: str) -> None:
    summary = load(path)
    step = find_step(summary, name)
    step.update(status="running", started_at=time.time())
    save(path, summary)


def running(path: str, name: str, report: dict) -> None:
    """The step's figures so far (called by the step's own script after each figure)."""
    summary = load(path)
    step = find_step(summary, name)
    step.update(status="running", report=report, checks=report.get("checks", {}),
                figures=safe_figures(name, report, ""))
    if "started_at" in step:
        step["wall_s"] = round(time.time() - step["started_at"], 1)
    save(path, summary)


def skip(path: str, name: str, reason: str, status: str = "skipped") -> None:
    summary = load(path)
    step = find_step(summary, name)
    step.update(status=status, reason=reason, wall_s=0.0)
    save(path, summary)


# ---- a step's checks, status and key figures ----------------------------------------------------------

def pytest_counts(log_text: str) -> dict:
    """passed / failed / skipped / errors from pytest's closing line, else from its -v lines (killed run)."""
    counts = {}
    closing = [line for line in log_text.splitlines() if re.match(r"^=* ?\d+ (passed|failed|skipped|error)", line)
               or re.search(r"=+ .*\d+ (passed|failed|error|skipped).* in [\d.]+s", line)]
    if closing:
        for number, word in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)",
                                       closing[-1]):
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
    skipped = re.findall(r"^SKIPPED \[\d+\] (.+)$", log_text, re.M)
    if skipped:
        counts["skipped_reasons"] = skipped[:10]
    return counts


def pytest_check(counts: dict) -> dict:
    """One check of a pytest run: ok only when it finished, something passed and nothing failed,
    errored or skipped (a test skipped on the GPU is a figure missing, not a pass)."""
    if counts.get("failed") or counts.get("errors"):
        return {"status": "failed", "failed_tests": counts.get("failed_tests", [])}
    if not counts.get("finished"):
        return {"status": "unknown", "reason": "pytest did not finish"}
    if not counts.get("passed"):
        return {"status": "unknown", "reason": "no test passed"}
    if counts.get("skipped"):
        return {"status": "unknown", "reason": f"{counts['skipped']} skipped",
                "skipped_reasons": counts.get("skipped_reasons", [])}
    return {"status": "ok"}


def gpu_compile_checks(report: dict) -> dict:
    """bench/gpu_compile.py's report read as checks: every shape compiled, and ptxas reported no
    spills for each kernel (a kernel without a report, or spills not reported, is unknown)."""
    runs = report.get("runs", [])
    if not runs:
        return {"shapes_compiled": {"status": "unknown", "reason": "no run finished"}}
    failed = sum(r.get("num_failed", 0) for r in runs)
    shapes = sum(r.get("num_shapes", 0) for r in runs)
    checks = {"shapes_compiled": {"status": "differ" if failed else ("ok" if shapes else "unknown"),
                                  "shapes": shapes, "failed": failed}}
    kernels = [k for r in runs for k in r.get("kernels", [])]
    unreported = [k.get("name") for k in kernels
                  if k.get("spill_store_bytes") is None or k.get("spill_load_bytes") is None]
    spilling = [k.get("name") for k in kernels if k.get("spill_store_bytes") or k.get("spill_load_bytes")]
    if spilling:
        checks["no_spills"] = {"status": "differ", "kernels": spilling}
    elif unreported or not kernels:
        checks["no_spills"] = {"status": "unknown",
                               "reason": f"ptxas gave no spill figures for {unreported or 'any kernel'}"}
    else:
        checks["no_spills"] = {"status": "ok", "kernels": len(kernels)}
    return checks


def step_status(rc: int | None, checks: dict, report: dict | None) -> str:
    """A finished step's status from its exit status, its report's own status and its checks."""
    if rc in (124, 137):
        return "timed_out"
    if report and report.get("status") == "skipped" and rc == 0:
        return "skipped"
    if rc != 0 or any(c.get("status") in BAD_CHECKS for c in checks.values()):
        return "failed"
    if not checks or any(c.get("status") != "ok" for c in checks.values()):
        return "unknown"
    return "ok"


def _rows(report: dict, key: str, fields: tuple[str, ...]) -> list[dict]:
    return [{k: row.get(k) for k in fields} for row in report.get(key, [])]


def figures(name: str, report: dict | None, log_text: str) -> dict:
    """The few numbers of a step worth a line of the table; a figure not measured is absent."""
    if name == "kernel_tests":
        return pytest_counts(log_text)
    if not report:
        return {}
    if name == "machine":
        return {k: report.get(k) for k in ("device_kind", "jax_backend", "default_attention_backend", "python",
                                           "gpu_found", "ptxas")} | {
            "jax": report.get("packages", {}).get("jax"), "num_devices": len(report.get("devices", []))}
    if name == "kernels":
        return {"mode": report.get("mode"), "backends": report.get("backends"),
                "copy_gb_per_s": report.get("copy", {}).get("gb_per_s"),
                "matmul_tflop_per_s": report.get("matmul", {}).get("tflop_per_s"),
                "decode": _rows(report, "decode", ("backend", "kv_dtype", "context", "gb_per_s",
                                                   "fraction_of_copy_bandwidth", "relative_diff_vs_reference",
                                                   "error")),
                "ragged": _rows(report, "ragged", ("backend", "tflop_per_s", "fraction_of_matmul_rate",
                                                   "relative_diff_vs_reference", "error")),
                "grouped_matmul": _rows(report, "grouped_matmul", ("case", "tokens", "kernel_speedup_over_xla",
                                                                   "relative_diff_vs_xla", "error"))}
    if name == "agreement":
        return {"model": report.get("model"), "bound_nats": report.get("near_tie_bound_nats"),
                "comparisons": {k: {f: c.get(f) for f in ("status", "compared_positions", "reason")}
                                for k, c in report.get("checks", {}).items()}}
    if name == "e2e":
        return e2e_figures(report)
    if name == "kv_offload":
        link, rows = report.get("host_link", {}), ("pages", "gb_per_s", "ratio_to_host_link")
        pinned = link.get("pinned", {})
        return {"machine": report.get("machine"), "page_bytes": report.get("page_bytes"),
                "host_to_device_gb_per_s": link.get("host_to_device_gb_per_s"),
                "device_to_host_gb_per_s": link.get("device_to_host_gb_per_s"),
                "pinned": {k: pinned[k] for k in ("host_to_device_gb_per_s", "device_to_host_gb_per_s", "error",
                                                  "reason") if k in pinned},
                "restore": _rows(report, "restore", rows), "save": _rows(report, "save", rows)}
    if name == "lora_pooling":
        return lora_pooling_figures(report)
    if name == "executables":
        return {k: report.get(k) for k in ("status", "reason", "shapes_loaded", "startup_loaded_s",
                                            "startup_compiled_s")}
    if name == "gpu_compile":
        return {"runs": [{k: r.get(k) for k in ("model", "target", "num_shapes", "num_failed", "seconds",
                                                 "planned_over_largest_temp")}
                         | {"kernels": [{k: kr.get(k) for k in ("name", "registers", "spill_store_bytes",
                                                                 "spill_load_bytes", "shared_memory_bytes")}
                                        for kr in r.get("kernels", [])]}
                         for r in report.get("runs", [])]}
    return {}


def e2e_figures(report: dict) -> dict:
    roof = report.get("decode_roofline", {})
    return {"model": report.get("model"), "attention_backend": report.get("attention_backend"),
            "startup_s": report.get("startup_s"), "num_step_shapes": report.get("num_step_shapes"),
            "num_pages": report.get("num_pages"), "copy_bandwidth_GBps": report.get("copy_bandwidth_GBps"),
            "offline_output_tokens_per_s": report.get("offline", {}).get("output_tokens_per_s"),
            "decode_batch": roof.get("batch"), "decode_step_ms": roof.get("step_ms"),
            "roofline_ms": roof.get("roofline_ms"), "fraction_of_roofline": roof.get("fraction_of_roofline"),
            "serving": [{k: s.get(k) for k in ("concurrency", "output_tokens_per_s", "ttft_ms_p99", "tpot_ms_p50")}
                        for s in report.get("serving", [])],
            "memory": report.get("memory")}


def lora_pooling_figures(report: dict) -> dict:
    embed, load = report.get("embeddings", {}), report.get("lora_load_summary", {})
    return {"machine": report.get("machine"), "targets": report.get("targets"),
            "lora_decode": _rows(report, "lora_decode", ("family", "backend", "base_ms", "lora_ms", "lora_over_base",
                                                         "lora_base_rows_over_base", "within_target")),
            "embeddings": {k: embed.get(k) for k in ("inputs", "input_tokens", "jaxserve_s", "tokens_per_s",
                                                     "roofline_s", "fraction_of_roofline", "transformers_s",
                                                     "over_transformers", "lowest_cosine", "within_target")},
            "lora_load": {"load_s": load.get("load_s", {}).get("median"),
                          "first_token_s": load.get("first_token_s", {}).get("median"),
                          "first_token_max_s": load.get("first_token_s", {}).get("max"),
                          "base_first_token_s": load.get("base_first_token_s", {}).get("median"),
                          "repeats": len(report.get("lora_load", [])), "within_target": load.get("within_target")}}


def safe_figures(name: str, report: dict | None, log_text: str) -> dict:
    try:
        return figures(name, report, log_text)
    except (AttributeError, KeyError, TypeError) as e:  # a report of another shape: say so, keep the rest
        return {"error": f"figures: {type(e).__name__}: {e}"}


def trim_log(path: str, limit: int = MAX_LOG_BYTES) -> None:
    if os.path.getsize(path) <= limit:
        return
    with open(path, "rb") as f:
        data = f.read()
    half = limit // 2
    with open(path, "wb") as f:
        f.write(data[:half] + b"\n[... %d bytes cut by gpu_check_summary.py ...]\n" % (len(data) - 2 * half)
                + data[-half:])


def read_report(path: str | None) -> tuple[dict | None, str | None]:
    if not path or not os.path.exists(path):
        return None, None
    try:
        with open(path) as f:
            return json.load(f), None
    except ValueError as e:
        return None, f"unreadable report: {e}"


def add(args) -> int:
    """Folds a finished step (its exit status, seconds, log and report) into the summary."""
    summary = load(args.summary)
    log_text = ""
    if args.log and os.path.exists(args.log):
        trim_log(args.log, MAX_SUMMARY_LOG_BYTES if args.log_in_summary else MAX_LOG_BYTES)
        with open(args.log, errors="replace") as f:
            log_text = f.read()
    report, error = read_report(args.report)
    step = find_step(summary, args.name)
    step.pop("started_at", None)
    step.update(rc=args.rc, wall_s=round(args.end - args.start, 1), timeout_s=args.timeout,
                gpu_limit_s=args.gpu_limit, timed_out=args.rc in (124, 137),
                log=os.path.basename(args.log) if args.log and not args.log_in_summary else None)
    if args.log_in_summary:
        step["log_text"] = log_text
    step["figures"] = safe_figures(args.name, report, log_text)
    checks = dict((report or {}).get("checks", {}))
    if args.name == "kernel_tests":
        checks["tests"] = pytest_check(step["figures"])
    if args.name == "gpu_compile" and report is not None:
        checks.update(gpu_compile_checks(report))
    step["checks"] = checks
    step["status"] = step_status(args.rc, checks, report)
    reason = error or (report or {}).get("reason")
    if reason:
        step["reason"] = reason
    if report is not None:
        step["report"] = report
    save(args.summary, summary)
    return 0


# ---- the table ------------------------------------------------------------------------------------------

def _pct(x) -> str:
    return "?" if x is None else f"{100 * x:.0f}%"


def not_ok(step: dict) -> str:
    """The checks of a step that are not ok, each with its status and why (shortened; not the
    step's own reason again)."""
    bad = []
    for name, check in (step.get("checks") or {}).items():
        why = check.get("reason") or check.get("error")
        if check.get("status") != "ok" and why != step.get("reason"):
            bad.append(f"{name}: {check.get('status')}" + (f" ({str(why)[:80]})" if why else ""))
    return f" [{'; '.join(bad)[:300]}]" if bad else ""


def short(name: str, step: dict) -> str:
    """One line of key figures (or why there are none), then the checks that are not ok."""
    if step.get("reason") and step["status"] in ("skipped", "not_run", "failed", "unknown"):
        return step["reason"][:200] + not_ok(step)
    return figures_line(name, step.get("figures") or {}, step) + not_ok(step)


def figures_line(name: str, fig: dict, step: dict) -> str:
    if name == "machine":
        return f"{fig.get('num_devices')} x {fig.get('device_kind')}, jax {fig.get('jax')}, " \
               f"attention {fig.get('default_attention_backend')}, ptxas {fig.get('ptxas') or 'none'}"
    if name == "kernel_tests":
        text = ", ".join(f"{fig[k]} {k}" for k in ("passed", "failed", "skipped", "errors") if fig.get(k))
        return text + ("" if fig.get("finished") else " (cut off)")
    if name == "kernels":
        decode = " ".join(f"{r['backend']}@{r['context']}{'' if r['kv_dtype'] == 'bfloat16' else '/' + r['kv_dtype']}:"
                          f"{_pct(r.get('fraction_of_copy_bandwidth'))}" for r in fig.get("decode", []))
        return f"copy {fig.get('copy_gb_per_s') or 0:.0f} GB/s; decode % of copy {decode}"
    if name == "e2e":
        serving = " ".join(f"c{s['concurrency']}:{s['output_tokens_per_s'] or 0:.0f}" for s in fig.get("serving", []))
        return (f"start {fig.get('startup_s') or 0:.0f} s ({fig.get('num_step_shapes')} shapes), offline "
                f"{fig.get('offline_output_tokens_per_s') or 0:.0f} tok/s, "
                f"decode {fig.get('decode_step_ms') or 0:.2f} ms "
                f"vs roofline {fig.get('roofline_ms') or 0:.2f} ms; serving tok/s {serving}")
    if name == "kv_offload":
        copies = "; ".join(f"{kind} " + " ".join(f"{r['pages']}p:{r['gb_per_s'] or 0:.1f}"
                                                f"({_pct(r['ratio_to_host_link'])})" for r in fig.get(kind, []))
                           for kind in ("restore", "save") if fig.get(kind))
        return (f"link h2d {fig.get('host_to_device_gb_per_s') or 0:.1f} "
                f"d2h {fig.get('device_to_host_gb_per_s') or 0:.1f} GB/s; GB/s (% of link) {copies}")
    if name == "lora_pooling":
        decode = " ".join(f"{r['family']} {r['lora_over_base'] or 0:.2f}x" for r in fig.get("lora_decode", []))
        embed, load = fig.get("embeddings", {}), fig.get("lora_load", {})
        theirs = f", {embed['over_transformers']:.2f}x transformers" if embed.get("over_transformers") else ""
        return (f"lora/base {decode or '?'}; embed {embed.get('tokens_per_s') or 0:.0f} tok/s "
                f"({_pct(embed.get('fraction_of_roofline'))} of roofline){theirs}; "
                f"load to 1st token {load.get('first_token_s') or 0:.3f} s "
                f"(max {load.get('first_token_max_s') or 0:.3f})")
    if name == "gpu_compile":
        return "; ".join(f"{r['model']} {r['target']}: {(r['num_shapes'] or 0) - (r['num_failed'] or 0)}/"
                         f"{r['num_shapes']} shapes in {r['seconds']} s" for r in fig.get("runs", []))
    ok = [k for k, c in (step.get("checks") or {}).items() if c.get("status") == "ok"]
    return f"ok: {', '.join(ok)}"[:200]


def table(path: str) -> int:
    summary = load(path)
    print(f"{'step':<13}{'status':>10}{'wall s':>8}{'limit':>7}  key figures (limit: the GPU run's)")
    for step in summary["steps"]:
        wall = step.get("wall_s")
        line = short(step["name"], step) if step["status"] not in ("pending",) else ""
        print(f"{step['name']:<13}{step['status']:>10}{'' if wall is None else f'{wall:.1f}':>8}"
              f"{step.get('gpu_limit_s', ''):>7}  {line}")
    total = sum(s.get("wall_s") or 0 for s in summary["steps"])
    counts = {}
    for s in summary["steps"]:
        counts[s["status"]] = counts.get(s["status"], 0) + 1
    limits = sum(s.get("gpu_limit_s", 0) for s in summary["steps"])
    print(f"{'total':<13}{summary['result']:>10}{total:>8.1f}{limits:>7}"
          f"  {', '.join(f'{n} {k}' for k, n in counts.items())} ({summary.get('mode')})")
    return 0


def exit_status(path: str) -> int:
    """0: every step ok (in the dry run, also incomplete: some figures need a GPU); 1: a step failed
    or timed out; 3: nothing failed but something was not compared (unknown, skipped, not run)."""
    summary = load(path)
    if summary["result"] == "ok":
        return 0
    if summary["result"] == "failed":
        return 1
    return 0 if summary.get("mode") == "dry-run" else 3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    starting = sub.add_parser("start")
    starting.add_argument("summary")
    starting.add_argument("--mode", required=True)
    starting.add_argument("--plan", required=True, help="name:gpu_limit_s:dry_run_limit_s,... in the order they run")
    beginning = sub.add_parser("begin")
    beginning.add_argument("summary")
    beginning.add_argument("name")
    adding = sub.add_parser("add")
    adding.add_argument("summary")
    adding.add_argument("--name", required=True)
    adding.add_argument("--rc", type=int, required=True)
    adding.add_argument("--start", type=float, required=True, help="epoch seconds")
    adding.add_argument("--end", type=float, required=True)
    adding.add_argument("--timeout", type=int, required=True)
    adding.add_argument("--gpu-limit", type=int, required=True, help="the step's limit on the GPU")
    adding.add_argument("--log")
    adding.add_argument("--log-in-summary", action="store_true",
                        help="keep the log's text in the summary (log_text): its file does not come back")
    adding.add_argument("--report")
    skipping = sub.add_parser("skip")
    skipping.add_argument("summary")
    skipping.add_argument("name")
    skipping.add_argument("--reason", required=True)
    skipping.add_argument("--status", default="skipped", choices=("skipped", "not_run"))
    sub.add_parser("table").add_argument("summary")
    sub.add_parser("exit-status").add_argument("summary")
    asking = sub.add_parser("status")
    asking.add_argument("summary")
    asking.add_argument("name")
    args = parser.parse_args(argv)
    if args.command == "start":
        return start(args.summary, args.mode, args.plan) or 0
    if args.command == "begin":
        return begin(args.summary, args.name) or 0
    if args.command == "add":
        return add(args)
    if args.command == "skip":
        return skip(args.summary, args.name, args.reason, args.status) or 0
    if args.command == "exit-status":
        return exit_status(args.summary)
    if args.command == "status":
        print(find_step(load(args.summary), args.name)["status"])
        return 0
    return table(args.summary)


if __name__ == "__main__":
    sys.exit(main())
