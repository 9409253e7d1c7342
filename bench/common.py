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


class ServerProcess:
    """`jaxserve serve` as a subprocess on a free loopback port, for the load generators.

    Use as a context manager: it waits until /health answers 200 and then, unless
    `wait_for_warmup` is false, until its report says the background warm-up has compiled every
    step shape (a server answers once the first requests' shapes are compiled, and a shape
    compiling beside the measured requests would share their cores), and stops the server
    (SIGTERM, then SIGKILL) on exit. The server's output goes to `log_path`. `command(port)`, when
    given, is another server's command line (e.g. llama.cpp's llama-server) run the same way
    instead of jaxserve (its /health reports no warm-up).
    """

    def __init__(self, model: str, extra_args: Sequence[str] = (), *, log_path: str | None = None,
                 start_timeout_s: float = 900.0, command=None, wait_for_warmup: bool = True):
        self.model = model
        self.wait_for_warmup = wait_for_warmup
        self.extra_args = list(extra_args)
        self.command = command
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or os.path.join(
            os.environ.get("TMPDIR", "/tmp"), f"jaxserve-bench-server-{self.port}.log")
        self.start_timeout_s = start_timeout_s
        self.process = None
        self.start_seconds: float | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def __enter__(self) -> "ServerProcess":
        import subprocess
        import time

        command = self.command(self.port) if self.command is not None else [
            sys.executable, "-m", "jaxserve.commands.cli", "serve", f"--model={self.model}", "--host=127.0.0.1",
            f"--port={self.port}", *self.extra_args]
        self._log = open(self.log_path, "w")
        start = time.monotonic()
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
        try:
            while not self._ready():
                if self.process.poll() is not None:
                    raise RuntimeError(f"the server exited with code {self.process.returncode}:\n{self.log_tail()}")
                if time.monotonic() - start > self.start_timeout_s:
                    raise RuntimeError(f"the server did not become healthy in {self.start_timeout_s:.0f}s:\n"
                                       f"{self.log_tail()}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - start
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _ready(self) -> bool:
        """Whether /health answers 200 and, with `wait_for_warmup`, reports no warm-up still
        compiling (one that failed is done too)."""
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                if response.status != 200:
                    return False
                body = response.read()
        except (urllib.error.URLError, OSError):
            return False
        if not self.wait_for_warmup:
            return True
        try:
            warmup = json.loads(body or b"{}").get("warmup")
        except (ValueError, AttributeError):  # not jaxserve's report
            return True
        return not warmup or bool(warmup.get("error")) or warmup.get("compiled", 0) >= warmup.get("total", 0)

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (graceful drain), SIGKILL after `timeout_s`; returns the exit code."""
        import subprocess

        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-num_lines:])
        except OSError:
            return ""


def system_cpu_seconds() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the whole machine since boot, all cores (from /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields) - idle) / ticks, sum(fields) / ticks


class CpuMeter:
    """Wall time, this process's CPU time, and how many cores other processes kept busy meanwhile
    (on a shared machine every timing depends on the latter)."""

    def __enter__(self) -> "CpuMeter":
        import time
        self._wall, self._cpu, self._system = time.perf_counter(), time.process_time(), system_cpu_seconds()
        return self

    def __exit__(self, *exc_info) -> None:
        import time
        self.wall_s = time.perf_counter() - self._wall
        self.cpu_s = time.process_time() - self._cpu
        system = system_cpu_seconds()
        self.other_cores = None
        if system is not None and self._system is not None and self.wall_s > 0:
            self.other_cores = max(0.0, (system[0] - self._system[0] - self.cpu_s) / self.wall_s)
