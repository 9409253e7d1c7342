"""Progress of a start-up phase (model download, conversion, warm-up compile) that a user waits on.

On a terminal a tqdm bar; otherwise (a log file, a service's journal) an INFO line at most every
`interval_s` seconds with the count, the time so far and the time left (the caller logs the end,
with what the phase produced), so a first start is never silent for minutes. Host-side: no jax.
"""
from __future__ import annotations

import logging
import sys
import threading
import time

from tqdm import tqdm


class Progress:
    """`with Progress(total, "warm-up", "shapes") as p: ... p.advance()`; thread-safe."""

    def __init__(self, total: int, phase: str, unit: str, logger: logging.Logger, interval_s: float = 10.0,
                 terminal: bool | None = None):
        self.total, self.phase, self.unit, self.logger, self.interval_s = total, phase, unit, logger, interval_s
        self.done = 0
        self._lock = threading.Lock()
        self._start = self._last_line = time.perf_counter()
        terminal = sys.stderr.isatty() if terminal is None else terminal
        self._bar = tqdm(total=total, desc=phase, unit=f" {unit}", leave=False) if terminal else None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def elapsed_s(self) -> float:
        return time.perf_counter() - self._start

    def advance(self, count: int = 1) -> None:
        with self._lock:
            self.done += count
            if self._bar is not None:
                self._bar.update(count)
                return
            now = time.perf_counter()
            if now - self._last_line < self.interval_s or self.done >= self.total:
                return
            self._last_line = now
            elapsed = now - self._start
            left = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
            self.logger.info("%s: %d of %d %s, %.0f s so far, about %.0f s left", self.phase, self.done, self.total,
                             self.unit, elapsed, left)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
