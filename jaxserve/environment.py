"""Every environment variable jaxserve reads, read here and nowhere else in jaxserve.

Each is read when its function is called (not at import, except where noted), so a launcher or a
test may set it after importing jaxserve.

JAXSERVE_CACHE (default ~/.cache/jaxserve)
    Where jaxserve keeps what it builds: converted models, the compilation cache, saved
    executables, the CPU kernels.
JAXSERVE_COMPILATION_CACHE (default xla/ under JAXSERVE_CACHE)
    JAX's persistent compilation cache; the saved executables are kept beside it. Set empty: both off.
JAXSERVE_EXECUTABLES_CACHE (default on)
    0: no automatic store of compiled executables (jaxserve.executor.executables), the compilation
    cache alone; --executables / --save_executables still work. The test suite sets it: its
    engines are built once per commit, so warm-ups are better served by the compilation cache
    (which survives edits that do not change a step) than by stores keyed by the source.
JAXSERVE_ATTENTION_BACKEND (default: the platform's, pallas on a GPU, else xla)
    The attention implementation where EngineConfig.attention_backend is unset: pallas,
    interpret, xla or reference.
JAXSERVE_GROUPED_MATMUL_BACKEND (default: xla)
    The mixture-of-experts grouped matmul (pallas_kernels.dispatch.grouped_matmul): xla (on the
    CPU a loop over the routed experts, on a GPU jax's ragged_dot), ragged_dot, pallas (the kernel
    on a GPU) or interpret; read when a step is traced, and part of a saved executable's fingerprint.
JAXSERVE_API_KEY (default: none, no key)
    `serve`: the key the /v1 routes require where --api_key is unset.
JAXSERVE_COORDINATOR_ADDRESS, JAXSERVE_NUM_PROCESSES, JAXSERVE_PROCESS_ID (default: a SLURM or
Open MPI job's, else a single process)
    A multi-host job (process 0's host:port, the processes, this one's index) where the flags
    --coordinator_address, --num_processes, --process_id are unset.
JAXSERVE_MULTIHOST_KV_MAX_BYTES (default 131072)
    Multi-host: step messages larger than this go as device broadcasts instead of through the
    key-value store; the same value on every process. Read at the import of
    jaxserve.parallel.multihost.
VLLM_ALLOW_RUNTIME_LORA_UPDATING (default off)
    `serve`: True (or 1) turns on POST /v1/load_lora_adapter and /v1/unload_lora_adapter, as in
    vLLM (deployment manifests written for vLLM carry it); --allow_runtime_lora_updating does too.
JAXSERVE_CPU_KERNELS (default on)
    0: the C++ CPU kernels off (XLA's formulations run).
JAXSERVE_KERNEL_CACHE (default cpu_kernels/ under JAXSERVE_CACHE)
    Where the CPU kernels are compiled to.

JAXSERVE_CPU_KERNELS and JAXSERVE_KERNEL_CACHE (and CXX, the compiler) are read by cpu_kernels
itself, in its one `_environment` function: it sits below jaxserve (it may not import it), is used
on its own by its tests, and decides on its first call, from wherever in the model code that comes;
its cache default restates cache_root's rule. pallas_kernels reads nothing: jaxserve passes
JAXSERVE_ATTENTION_BACKEND in (jaxserve.executor.device_setup.attention_backend).

Other programs' variables read here: HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME (the Hugging Face hub
cache, as huggingface_hub finds it), XLA_PYTHON_CLIENT_MEM_FRACTION (jax's share of a GPU's
memory, 0.75 unless set), XLA_FLAGS (part of a saved executable's fingerprint), JAX_PLATFORMS
(jaxserve.platforms sets it to cpu where jax's CUDA plugin cannot run), and the SLURM_* /
OMPI_* variables of a cluster job (`process_environment`, for jaxserve.parallel.multihost).
Set here, not read: MOSAIC_GPU_DUMP_PTXAS and MOSAIC_GPU_DUMP_TO (Mosaic GPU's dumps, while `plan`
compiles the Mosaic kernels for their ptxas reports: `mosaic_gpu_dumps`).
"""
from __future__ import annotations

import contextlib
import os
from typing import Mapping

CACHE = "JAXSERVE_CACHE"
COMPILATION_CACHE = "JAXSERVE_COMPILATION_CACHE"
EXECUTABLES_CACHE = "JAXSERVE_EXECUTABLES_CACHE"
ATTENTION_BACKEND = "JAXSERVE_ATTENTION_BACKEND"
GROUPED_MATMUL_BACKEND = "JAXSERVE_GROUPED_MATMUL_BACKEND"
API_KEY = "JAXSERVE_API_KEY"
COORDINATOR_ADDRESS = "JAXSERVE_COORDINATOR_ADDRESS"
NUM_PROCESSES = "JAXSERVE_NUM_PROCESSES"
PROCESS_ID = "JAXSERVE_PROCESS_ID"
MULTIHOST_KV_MAX_BYTES = "JAXSERVE_MULTIHOST_KV_MAX_BYTES"
DEFAULT_MULTIHOST_KV_MAX_BYTES = 128 * 1024  # bench/multihost.py: below it the key-value store is cheaper
DEFAULT_XLA_MEM_FRACTION = 0.75  # jax's, without XLA_PYTHON_CLIENT_MEM_FRACTION


def cache_root() -> str:
    """Where jaxserve keeps what it builds: $JAXSERVE_CACHE, else ~/.cache/jaxserve (absolute)."""
    return os.path.abspath(os.path.expanduser(os.environ.get(CACHE) or "~/.cache/jaxserve"))


def compilation_cache_dir() -> str | None:
    """$JAXSERVE_COMPILATION_CACHE, else `xla/` under cache_root(); None when set empty (off)."""
    return os.environ.get(COMPILATION_CACHE, os.path.join(cache_root(), "xla")) or None


def executables_cache() -> bool:
    """Whether the automatic executable store is on: $JAXSERVE_EXECUTABLES_CACHE other than 0."""
    return os.environ.get(EXECUTABLES_CACHE, "1").strip() != "0"


def attention_backend() -> str | None:
    """$JAXSERVE_ATTENTION_BACKEND as set (pallas_kernels.dispatch checks the name), None when unset or empty."""
    return os.environ.get(ATTENTION_BACKEND) or None


def grouped_matmul_backend() -> str | None:
    """$JAXSERVE_GROUPED_MATMUL_BACKEND as set (pallas_kernels.dispatch checks the name), None when unset or empty."""
    return os.environ.get(GROUPED_MATMUL_BACKEND, "").strip() or None


def api_key() -> str | None:
    """$JAXSERVE_API_KEY, None when unset or empty."""
    return os.environ.get(API_KEY) or None


def allow_runtime_lora_updating() -> bool:
    """$VLLM_ALLOW_RUNTIME_LORA_UPDATING: true or 1 (any case) turns the LoRA load routes on."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("true", "1")


def multihost_kv_max_bytes() -> int:
    """$JAXSERVE_MULTIHOST_KV_MAX_BYTES, else DEFAULT_MULTIHOST_KV_MAX_BYTES."""
    return int(os.environ.get(MULTIHOST_KV_MAX_BYTES, DEFAULT_MULTIHOST_KV_MAX_BYTES))


def process_environment() -> Mapping[str, str]:
    """The whole environment, for what reads a family of variables: a multi-host job's settings
    (COORDINATOR_ADDRESS, NUM_PROCESSES, PROCESS_ID) and a cluster's (SLURM_*, OMPI_*)."""
    return os.environ


def hf_hub_cache() -> str:
    """The Hugging Face hub cache, read from the environment now (as huggingface_hub does at
    import): $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub (~/.cache)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def xla_mem_fraction() -> float:
    """$XLA_PYTHON_CLIENT_MEM_FRACTION: the share of a GPU's memory jax's allocator takes."""
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", DEFAULT_XLA_MEM_FRACTION))


def xla_flags() -> str:
    """$XLA_FLAGS, empty when unset."""
    return os.environ.get("XLA_FLAGS", "")


def jax_platforms_chosen() -> bool:
    """Whether $JAX_PLATFORMS is set (then jaxserve.platforms leaves the choice alone)."""
    return "JAX_PLATFORMS" in os.environ


@contextlib.contextmanager
def mosaic_gpu_dumps(folder: str):
    """Meanwhile Mosaic GPU writes each kernel it compiles (its PTX, ptxas -v report and resources)
    into `folder`: it reads these variables at every compile."""
    saved = {name: os.environ.get(name) for name in ("MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_TO")}
    os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=folder)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
