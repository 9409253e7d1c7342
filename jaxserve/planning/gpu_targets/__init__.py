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


def target_memory_budget_bytes(name: str) -> int:
    """What jax's allocator would offer the engine on one GPU of the target: its memory times
    $XLA_PYTHON_CLIENT_MEM_FRACTION (0.75 unless set), as `memory_stats()["bytes_limit"]` reports
    there: the budget the engine plans with."""
    return int(target_memory_bytes(name) * environment.xla_mem_fraction())
