"""GPU targets to compile for without the GPU: XLA `GpuTargetConfig` text protos, one per file
(`h100.txtpb`, ...). Plain data and file reading, no jax."""
from __future__ import annotations

import os
import re

from jaxserve import environment

TARGETS_DIR = os.path.dirname(os.path.abspath(__file__))


def target_names() -> list[str]:
    return sorted(name.removesuffix(".txtpb") for name in os.listdir(TARGETS_DIR) if name.endswith(".txtpb"))


def target_config(name: str) -> str:
    """The GpuTargetConfig text proto of a shipped target; ValueError naming the known ones."""
    path = os.path.join(TARGETS_DIR, f"{name}.txtpb")
    if not os.path.isfile(path):
        raise ValueError(f"unknown GPU target {name!r}; known targets: {', '.join(target_names())}")
    with open(path) as f:
        return f.read()


def target_memory_bytes(name: str) -> int:
    """Device memory of one GPU of the target (its `device_memory_size`)."""
    return int(re.search(r"device_memory_size:\s*(\d+)", target_config(name)).group(1))


def target_device_kind(name: str) -> str:
    """The `device.device_kind` jax reports for a GPU of the target (its `device_description_str`)."""
    return re.search(r'device_description_str:\s*"([^"]*)"', target_config(name)).group(1)


def target_memory_budget_bytes(name: str) -> int:
    """What jax's allocator would offer the engine on one GPU of the target: its memory times
    $XLA_PYTHON_CLIENT_MEM_FRACTION (0.75 unless set), as `memory_stats()["bytes_limit"]` reports
    there: the budget the engine plans with."""
    return int(target_memory_bytes(name) * environment.xla_mem_fraction())


# Per GPU, the figures the latency predictor (jaxserve.planning.predict) needs beside the protos'
# memory_bandwidth: the dense bfloat16 tensor-core peak (without structured sparsity) and the
# NVLink bandwidth of one GPU, both directions together, as NVIDIA's datasheets state them:
#   a100: "NVIDIA A100 Tensor Core GPU" datasheet, A100 80GB SXM: BF16 312 TFLOPS, NVLink 600 GB/s
#   h100: "NVIDIA H100 Tensor Core GPU" datasheet, H100 SXM: BF16 1,979 TFLOPS with sparsity (989.5
#         dense), NVLink 900 GB/s
#   h200: "NVIDIA H200 Tensor Core GPU" datasheet, H200 SXM: BF16 1,979 TFLOPS with sparsity (989.5
#         dense), NVLink 900 GB/s
TARGET_PEAK_BF16_FLOPS = {"a100": 312e12, "h100": 989.5e12, "h200": 989.5e12}
TARGET_NVLINK_BYTES_PER_S = {"a100": 600e9, "h100": 900e9, "h200": 900e9}


def target_memory_bandwidth(name: str) -> float:
    """Memory bandwidth of one GPU of the target in bytes/s (its `memory_bandwidth`)."""
    return float(re.search(r"memory_bandwidth:\s*(\d+)", target_config(name)).group(1))


def target_for_device_kind(device_kind: str) -> str | None:
    """The shipped target whose GPU a jax `device.device_kind` names ("NVIDIA H100 80GB HBM3"),
    or None (a CPU, another GPU)."""
    kind = device_kind.lower()
    return next((name for name in target_names() if name in kind), None)
