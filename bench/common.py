"""Helpers shared by the benchmarks: the machine line, latency summaries, tables and JSON output.

No jax import here: the load generators run in processes that never touch the model.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import socket
import sys
from typing import Any, Iterable, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def load_average() -> float | None:
    """1-minute load average (other processes on the machine skew every timing)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def machine_info(with_jax: bool = False) -> dict[str, Any]:
    """Where a figure was measured: CPU, cores, memory, Python and library versions, date."""
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "host": socket.gethostname(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": None if memory_gib() is None else round(memory_gib(), 1),
        "python": platform.python_version(),
        "load_average_1m": load_average(),
    }
    if with_jax:
        import jax
        info["jax"] = jax.__version__
        info["jax_backend"] = jax.default_backend()
        info["jax_devices"] = [str(d) for d in jax.devices()]
    return info


def machine_line(info: dict[str, Any]) -> str:
    parts = [info["date"], f"{info['cpu']} x{info['cores']} cores"]
    if info.get("memory_gib"):
        parts.append(f"{info['memory_gib']:.0f} GiB")
    parts.append(f"Python {info['python']}")
    if "jax" in info:
        parts.append(f"jax {info['jax']} ({info['jax_backend']})")
    if info.get("torch"):
        parts.append(f"torch {info['torch']}")
    if info.get("load_average_1m") is not None:
        parts.append(f"load {info['load_average_1m']}")
    return ", ".join(parts)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Iterable[float], scale: float = 1.0) -> dict[str, float | int]:
    """mean / p50 / p99 / max (times `scale`, e.g. 1000 for ms) and the count."""
    values = [v * scale for v in values if v is not None and not math.isnan(v)]
    if not values:
        return {"count": 0, "mean": math.nan, "p50": math.nan, "p99": math.nan, "max": math.nan}
    return {"count": len(values), "mean": sum(values) / len(values), "p50": percentile(values, 50),
            "p99": percentile(values, 99), "max": max(values)}


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """Plain text table. columns: (key, header, format spec such as '.1f')."""
    cells = [[header for _, header, _ in columns]]
    for row in rows:
        line = []
        for key, _, spec in columns:
            value = row.get(key)
            if value is None or (isinstance(value, float) and math.isnan(value)):
                line.append("-")
            else:
                line.append(format(value, spec))
        cells.append(line)
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    out = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: str | None, data: dict[str, Any]) -> None:
    """Writes `data` (NaN/inf become null) to `path`, creating its folder; nothing when path is None."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(_json_safe(data), f, indent=2)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
