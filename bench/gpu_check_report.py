"""What a step of bench/gpu_check.sh has measured, kept as it goes, and the greedy-token comparison
the steps share. Only the standard library: the step scripts import it before jax.

`StepReport` is the step's JSON report: every figure is written to disk as soon as it is measured
(the file replaced whole), and, when the check runs the script ($GPU_CHECK_SUMMARY and
$GPU_CHECK_STEP set), folded into the check's summary.json at once, so that a step killed by its
time limit, or a call killed at any moment, leaves every figure measured before. `guard(name)` runs
one part (a backend, a measurement) so that its exception is recorded as that part's failed check
and the rest goes on. `check(name, status, ...)` records one comparison: "ok" when two independent
results were compared and agreed, "differ" when they did not, "unknown" when there was nothing to
compare (a missing figure is never "ok").

`compare_greedy` compares greedy tokens with a reference's up to the first position where the
reference's top two logits are closer than a bound: there any two correct implementations that
round differently (bfloat16 kernels, another compiler's choices) may take either token, and every
later position follows from a different prefix.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_check_summary  # noqa: E402  (bench/, standard library only)

# Top-2 logit gap (nats) under which a greedy choice is a near-tie. Two correct bfloat16 implementations
# of the same model differ in their logits by rounding: the chosen tokens' logprobs differed by at most
# 0.015 between the XLA path and the interpreted Triton and Mosaic kernels, and 0.019 between them and
# transformers in float32, on bench/gpu_agreement.py's tiny model (2026-12-05); 0.1 leaves room for the
# 8B-shaped model's wider layers, and a comparison reports its own largest difference beside it.
NEAR_TIE_NATS = 0.1


def _plain(value):
    """JSON for numpy scalars and arrays (anything with .item() / .tolist()), else str."""
    for method in ("tolist", "item"):
        if hasattr(value, method):
            return getattr(value, method)()
    return str(value)


class StepReport(dict):
    """A step's report, written to `path` (and into the check's summary) after every change."""

    def __init__(self, path: str, **fields):
        super().__init__(fields)
        self.path = path
        self.setdefault("checks", {})
        self.write()

    def put(self, key: str, value):
        self[key] = value
        self.write()
        return value

    def append(self, key: str, row: dict) -> dict:
        self.setdefault(key, []).append(row)
        self.write()
        return row

    def check(self, name: str, status: str, **details) -> dict:
        assert status in ("ok", "differ", "failed", "unknown"), status
        self["checks"][name] = {"status": status, **details}
        self.write()
        return self["checks"][name]

    @contextlib.contextmanager
    def guard(self, name: str):
        """Runs one part: an exception becomes check `name` failed (with the error) and is not raised."""
        try:
            yield
        except Exception as error:  # one backend's failure must not lose the others' figures
            lines = traceback.format_exception(type(error), error, error.__traceback__)
            print("".join(lines), file=sys.stderr, flush=True)
            self.check(name, "failed", error=f"{type(error).__name__}: {str(error)[:1500]}")

    @contextlib.contextmanager
    def phase(self, name: str):
        """Records one part's wall seconds in self["phase_s"][name], even when it raises."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.setdefault("phase_s", {})[name] = round(time.perf_counter() - start, 3)
            self.write()

    def write(self) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        temporary = f"{self.path}.tmp"
        with open(temporary, "w") as f:
            json.dump(self, f, indent=1, default=_plain)
        os.replace(temporary, self.path)
        summary, step = os.environ.get("GPU_CHECK_SUMMARY"), os.environ.get("GPU_CHECK_STEP")
        if summary and step and os.path.exists(summary):
            with open(self.path) as f:
                gpu_check_summary.running(summary, step, json.load(f))

    def exit_status(self) -> int:
        """1 when a check failed or differed, else 0 (unknown checks are the summary's to report)."""
        return 1 if any(c["status"] in ("failed", "differ") for c in self["checks"].values()) else 0


def require_gpu() -> None:
    """On the check's GPU run ($GPU_CHECK_MODE=gpu) this process must see a GPU, else exit 2: a
    CUDA that failed to start in this step's process would run everything on the CPU, the kernels
    interpreted, and compare CPU results. Anywhere else, nothing."""
    if os.environ.get("GPU_CHECK_MODE") != "gpu":
        return
    import jax

    if jax.default_backend() != "gpu":
        print(f"no GPU found in this step's process: jax's backend is {jax.default_backend()!r}", file=sys.stderr)
        sys.exit(2)


def top2_gap(top: dict) -> float | None:
    """The gap between the two largest values of {token: logprob or logit}; None with fewer than two."""
    values = sorted(top.values(), reverse=True)
    return values[0] - values[1] if len(values) >= 2 else None


def compare_greedy(candidate: list[list[int]], reference: list[list[int]], reference_gaps: list[list[float | None]],
                   bound: float = NEAR_TIE_NATS) -> dict:
    """Each sequence of `candidate` against `reference` up to the first position where the
    reference's top-2 gap is under `bound` (a gap of None, unknown, counts as a near-tie).

    Returns {"status": "ok" | "differ" | "unknown", "bound_nats", "compared_positions": total,
    "sequences": [{"compared", "first_near_tie", "first_difference"}]}: "differ" when a token
    differs (or is missing) before that position; "unknown" when no position was compared."""
    if len(candidate) != len(reference) or len(reference) != len(reference_gaps):
        return {"status": "differ", "bound_nats": bound, "compared_positions": 0,
                "reason": f"{len(candidate)} sequences against {len(reference)} (gaps: {len(reference_gaps)})"}
    sequences, differ = [], False
    for cand, ref, gaps in zip(candidate, reference, reference_gaps):
        near_tie = next((i for i, gap in enumerate(gaps[:len(ref)]) if gap is None or gap < bound), None)
        limit = len(ref) if near_tie is None else near_tie
        first_difference = next((i for i in range(limit) if i >= len(cand) or cand[i] != ref[i]), None)
        differ = differ or first_difference is not None
        sequences.append({"compared": limit, "first_near_tie": near_tie, "first_difference": first_difference})
    compared = sum(s["compared"] for s in sequences)
    status = "differ" if differ else ("ok" if compared else "unknown")
    result = {"status": status, "bound_nats": bound, "compared_positions": compared, "sequences": sequences}
    if status == "unknown":
        result["reason"] = "every sequence starts with a near-tie: nothing compared"
    return result
