"""bench/gpu_check.sh's first step: what the machine has, and whether jax sees a GPU at all.

    python3 bench/gpu_check_machine.py machine OUT.json --mode=gpu       # exit 2: no GPU found (the reason jax gives)
    python3 bench/gpu_check_machine.py machine OUT.json --mode=dry-run   # the CPU, as the dry run expects
    python3 bench/gpu_check_machine.py ptxas                             # the folder of a ptxas, or nothing

On the GPU run the check exports JAX_PLATFORMS=cuda,cpu, so that a CUDA that fails to start is an error
(jax would otherwise fall back to the CPU, and the kernel tests would pass interpreted): the probe here
starts jax in a subprocess under a time limit and reports "no GPU found: <jax's reason>" when it cannot
list a GPU. Only the standard library in this process: it must run where jax itself does not.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata

# The lent machine's packages (../shared/GPU.md); gguf and llguidance are not there.
PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin", "flax", "orbax-checkpoint",
            "transformers", "tokenizers", "safetensors", "sentencepiece", "jinja2", "aiohttp", "absl-py",
            "prometheus-client", "tqdm", "numpy", "psutil", "pytest", "torch", "triton", "gguf", "llguidance",
            "nvidia-cuda-nvcc", "nvidia-cuda-nvcc-cu12", "nvidia-cuda-nvcc-cu13")
PROBE_TIMEOUT_S = 90  # jax's start on a GPU takes seconds; a hung driver must not eat the call
# What the probe prints as its last line: the devices, the platform and the attention backend dispatch picks.
PROBE = """
import json, jax
devices = jax.devices()
info = {"jax_backend": jax.default_backend(), "devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind, "platform": devices[0].platform,
        "compute_capability": getattr(devices[0], "compute_capability", None)}
stats = devices[0].memory_stats() or {}
info["bytes_limit"] = stats.get("bytes_limit")
try:
    from pallas_kernels import dispatch
    info["default_attention_backend"] = dispatch.attention_backend()
    info["triton_unusable_reason"] = dispatch.triton_unusable_reason()
except Exception as e:  # the devices are the gate; the backend's choice is a figure
    info["dispatch_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(info))
"""


def ptxas_candidates() -> list[str]:
    """Where a ptxas may be, in order: the nvidia wheels (CUDA 13's nvidia/cu13/bin, CUDA 12's
    nvidia/cuda_nvcc/bin, any other nvidia/*/bin), the CUDA toolkit ($CUDA_HOME, $CUDA_PATH,
    /usr/local/cuda*), then PATH."""
    folders = []
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        folders += [os.path.join(root, "cu13", "bin"), os.path.join(root, "cuda_nvcc", "bin")]
        folders += sorted(glob.glob(os.path.join(root, "*", "bin")))
    for variable in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        if os.environ.get(variable):
            folders.append(os.path.join(os.environ[variable], "bin"))
    folders += ["/usr/local/cuda/bin"] + sorted(glob.glob("/usr/local/cuda-*/bin"), reverse=True)
    folders += os.environ.get("PATH", "").split(os.pathsep)
    seen, unique = set(), []
    for folder in folders:
        if folder and folder not in seen:
            seen.add(folder)
            unique.append(folder)
    return unique


def find_ptxas() -> str | None:
    """The folder of the first executable ptxas among ptxas_candidates(), else None."""
    for folder in ptxas_candidates():
        path = os.path.join(folder, "ptxas")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return folder
    return None


def jax_complaints(stderr: str) -> str | None:
    """What jax (or its CUDA plugin) said went wrong at start-up, from its stderr: the lines of
    errors and failed initialisations, not the tracebacks' frames; None when it said nothing."""
    keys = ("Unable to initialize backend", "plugin configuration error", "Error", "error:", "CUDA_ERROR",
            "not found", "Could not")
    lines = []
    for line in stderr.splitlines():
        text = line.strip()
        if text and not line.startswith(" ") and not text.startswith("Traceback") and any(k in text for k in keys) \
                and text not in lines:
            lines.append(text)
    return " | ".join(lines[-4:])[-800:] or None


def probe_jax(timeout_s: float = PROBE_TIMEOUT_S) -> tuple[dict | None, str | None]:
    """(what jax sees or None, what jax complained of or None): its devices, backend and the
    attention backend the engine would take, from a subprocess under a time limit."""
    try:
        result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"jax did not list its devices within {timeout_s:.0f} s"
    sys.stderr.write(result.stderr[-4000:])
    complaints = jax_complaints(result.stderr)
    if result.returncode != 0:
        return None, complaints or f"exit {result.returncode}"
    return json.loads(result.stdout.strip().splitlines()[-1]), complaints


def gpu_check(info: dict | None, complaints: str | None) -> dict:
    """The GPU run's gate: ok only when jax's default backend is a GPU."""
    if info is None:
        return {"status": "failed", "reason": f"no GPU found: jax did not start: {complaints}"}
    if info.get("jax_backend") != "gpu":
        said = f"; jax said: {complaints}" if complaints else ""
        return {"status": "failed", "reason": f"no GPU found: jax's backend is {info.get('jax_backend')!r} "
                                              f"({', '.join(info.get('devices', []))}){said}"}
    return {"status": "ok", "device_kind": info.get("device_kind")}


def machine(out: str, mode: str) -> int:
    """Writes what the machine has to `out`; exit 2 on the GPU run when jax sees no GPU."""
    report = {"python": platform.python_version(), "cpus": os.cpu_count(), "packages": {},
              "jax_platforms": os.environ.get("JAX_PLATFORMS")}
    for name in PACKAGES:
        try:
            report["packages"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            report["packages"][name] = None
    report["ptxas"] = find_ptxas()
    if shutil.which("nvidia-smi"):
        try:
            query = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
            smi = subprocess.run(query, capture_output=True, text=True, timeout=20)
            report["nvidia_smi"] = (smi.stdout or smi.stderr).strip()
        except subprocess.TimeoutExpired:
            report["nvidia_smi"] = "nvidia-smi did not answer within 20 s"
    info, complaints = probe_jax()
    report.update(info or {})
    report["jax_complaints"] = complaints
    if mode == "gpu":
        check = gpu_check(info, complaints)
        report["gpu_found"] = check["status"] == "ok"
        report["checks"] = {"gpu": check}
    else:  # the dry run: jax must start, on the CPU
        report["checks"] = {"jax_starts": {"status": "ok"} if info else {"status": "failed", "reason": complaints}}
    failed = [c["reason"] for c in report["checks"].values() if c["status"] != "ok"]
    if failed:
        report["reason"] = failed[0]
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps(report, indent=1))
    if failed:
        print(failed[0], file=sys.stderr)
    return 2 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    probing = sub.add_parser("machine")
    probing.add_argument("out")
    probing.add_argument("--mode", choices=("gpu", "dry-run"), required=True)
    sub.add_parser("ptxas")
    args = parser.parse_args(argv)
    if args.command == "ptxas":
        print(find_ptxas() or "")
        return 0
    return machine(args.out, args.mode)


if __name__ == "__main__":
    sys.exit(main())
