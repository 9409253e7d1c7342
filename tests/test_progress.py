"""jaxserve.core.progress: a start-up phase's count, time so far and time left, as log lines off a terminal."""
import logging
import threading

from jaxserve.core import progress as progress_module
from jaxserve.core.progress import Progress


def test_log_lines_count_and_estimate_the_time_left(caplog, monkeypatch):
    clock = iter(float(t) for t in [0, 5, 20, 40, 60])  # the start; then one reading per advance
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: next(clock))
    logger = logging.getLogger("test.progress")
    with caplog.at_level(logging.INFO, logger="test.progress"):
        with Progress(5, "warm-up", "shapes compiled", logger, interval_s=10, terminal=False) as p:
            for _ in range(4):
                p.advance()
    lines = [r.getMessage() for r in caplog.records]
    # 5 s: too soon after the start; 20 s: 2 of 5 (30 s left); 40 s: 3 of 5 (about 27 s left); 60 s: 4 of 5
    assert lines == ["warm-up: 2 of 5 shapes compiled, 20 s so far, about 30 s left",
                     "warm-up: 3 of 5 shapes compiled, 40 s so far, about 27 s left",
                     "warm-up: 4 of 5 shapes compiled, 60 s so far, about 15 s left"]


def test_advance_from_many_threads_counts_every_step():
    with Progress(400, "warm-up", "shapes", logging.getLogger("test.progress"), terminal=False) as p:
        threads = [threading.Thread(target=lambda: [p.advance() for _ in range(100)]) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert p.done == 400
