"""The sweep's PNG: the two curves engines are compared by, one point per level.

Left: output throughput (tok/s) against P99 TTFT (ms). Right: output tokens/s per user
(1000 / mean TPOT in ms) against total output tokens/s. Needs matplotlib (the test extra, or
`pip install matplotlib`); `PlotError` says so when it is missing.
"""
from __future__ import annotations

import os
from typing import Sequence


class PlotError(RuntimeError):
    """The plot cannot be drawn (matplotlib missing) or written."""


def _annotated(ax, xs: Sequence, ys: Sequence, labels: Sequence[str], color: str) -> None:
    points = [(x, y, label) for x, y, label in zip(xs, ys, labels) if x is not None and y is not None]
    if not points:
        ax.text(0.5, 0.5, "no values", ha="center", va="center", transform=ax.transAxes)
        return
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=color)
    for x, y, label in points:
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.grid(alpha=0.3)


def plot_sweep(rows: Sequence[dict], kind: str, path: str, title: str = "") -> str:
    """Writes the two panels for the sweep's `sweep.table_row`s to `path`; returns the path."""
    try:
        # matplotlib is optional (only --plot needs it), so it is imported here
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after choosing the file-only backend
    except ImportError:
        raise PlotError("--plot needs matplotlib: pip install matplotlib") from None
    labels = [f"{kind}={row['level']:g}" for row in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    _annotated(left, [r["p99_ttft_ms"] for r in rows], [r["output_throughput"] for r in rows], labels, "tab:blue")
    left.set(xlabel="P99 time to first token (ms)", ylabel="output tokens/s", title="throughput vs P99 TTFT")
    per_user = [1000.0 / r["mean_tpot_ms"] if r["mean_tpot_ms"] else None for r in rows]
    _annotated(right, per_user, [r["output_throughput"] for r in rows], labels, "tab:red")
    right.set(xlabel="output tokens/s per user (1000 / mean TPOT ms)", ylabel="output tokens/s (all users)",
              title="per-user speed vs total throughput")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise PlotError(f"--plot={path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path
