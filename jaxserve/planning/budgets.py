"""What memory an engine may plan with: the host RAM available now (capped by a cgroup limit) and
a device's allocator limit. No jax at import (the device's is read when asked)."""
from __future__ import annotations

import os


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None  # missing file, or "max" (no cgroup limit)


def _available_host_bytes() -> int:
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < (1 << 60):
            available = min(available, max(limit - usage, 0))
    return available


def host_memory_budget_bytes(fraction: float = 0.5) -> int:
    """A fraction of the host RAM available now (MemAvailable, capped by a cgroup limit).

    The budget for the page pool on CPU. Call it before the weights are loaded: the planner
    subtracts the weights itself.
    """
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    return int(_available_host_bytes() * fraction)


def device_memory_budget_bytes(device=None) -> int:
    """The bytes the XLA allocator may hand out on `device` (default: the first jax device).

    This is `memory_stats()['bytes_limit']` (which already reflects XLA's preallocation
    fraction), not the memory free now. Devices without memory stats (CPU) fall back to
    host_memory_budget_bytes().
    """
    import jax  # deferred: the rest of this module stays importable without jax

    device = jax.devices()[0] if device is None else device
    try:
        stats = device.memory_stats()
    except Exception:  # some backends raise instead of returning None
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if device.platform == "cpu":
        return host_memory_budget_bytes()
    raise ValueError(f"cannot read the memory size of {device}; pass the budget explicitly")
