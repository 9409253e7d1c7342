"""XLA's compiler threads, found and told to yield the CPU to serving (Linux; no jax here).

XLA compiles on threads of its own (a pool, and LLVM's workers), not on the Python thread that
asks for the compile, and apart from the threads that run executables (`tf_XLAEigen`, and a
helper). A background warm-up's compile on a 2-core machine took the cores a serving step
needed: the step ran 2.1x slower beside it. Under the idle scheduling class (SCHED_IDLE) a
thread runs only when no other wants the CPU, so the compiles go on at full speed while the
engine has nothing to step and stop taking CPU while it steps (the step was as fast as alone).

The compiler threads have no names of their own, so they are found by what they do: the
threads that used CPU while the process only compiled (`CpuByThread` over the warm-up's first
phase), less the Python threads (one of them serves; the warm-up's own go in as they take their
next shape, jaxserve.executor.warmup) and the executable threads. It is done when a warm-up goes to the background (threads the compiler
starts later from those inherit it) and undone when it ends; undoing needs CAP_SYS_NICE (root
has it), so elsewhere the threads stay in the idle class, and a later compile (a prompt-logprob
shape on first use) also waits for the cores that serving leaves.
"""
from __future__ import annotations

import os
import threading

TASKS_DIR = "/proc/self/task"
EXECUTION_THREAD_PREFIX = "tf_XLAEigen"  # XLA:CPU's pool that runs executables: never demoted


def cpu_ticks_by_thread() -> dict[int, int]:
    """{thread id: user + system CPU ticks} of this process's threads ({} without /proc)."""
    ticks = {}
    try:
        tids = os.listdir(TASKS_DIR)
    except OSError:
        return ticks
    for tid in tids:
        try:
            with open(f"{TASKS_DIR}/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state is field 3
            ticks[int(tid)] = int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return ticks


def thread_name(tid: int) -> str:
    try:
        with open(f"{TASKS_DIR}/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


class CpuByThread:
    """What each thread did over a stretch: `start()` before it, then `busy()`: the threads
    that used CPU since (ids, ascending)."""

    def __init__(self) -> None:
        self._before: dict[int, int] = {}

    def start(self) -> None:
        self._before = cpu_ticks_by_thread()

    def busy(self) -> list[int]:
        return sorted(tid for tid, ticks in cpu_ticks_by_thread().items() if ticks > self._before.get(tid, 0))


def compiler_threads(busy_while_compiling: list[int]) -> list[int]:
    """Of the threads busy while the process only compiled, those of XLA's compiler: not a
    Python thread, not one that runs executables."""
    python = {t.native_id for t in threading.enumerate()}
    return [tid for tid in busy_while_compiling
            if tid not in python and not thread_name(tid).startswith(EXECUTION_THREAD_PREFIX)]


def yield_to_others(tids: list[int]) -> list[int]:
    """Puts the threads `tids` in the idle scheduling class; returns those it did (none where
    the platform has no SCHED_IDLE, or for a thread that ended)."""
    return _set_class(tids, "SCHED_IDLE")


def back_to_normal(tids: list[int]) -> list[int]:
    """Puts the threads `tids` back in the normal class; returns those it did (none without
    CAP_SYS_NICE: the kernel lets an unprivileged thread into the idle class, not out of it)."""
    return _set_class(tids, "SCHED_OTHER")


def _set_class(tids: list[int], policy_name: str) -> list[int]:
    policy = getattr(os, policy_name, None)
    if policy is None:
        return []
    done = []
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            done.append(tid)
        except OSError:
            continue
    return done


def is_idle_class(tid: int) -> bool:
    """Whether thread `tid` is in the idle scheduling class (False once it ended)."""
    try:
        return hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(tid) == os.SCHED_IDLE
    except OSError:
        return False
