"""Which bound a run hit, from its engine steps: "scheduling-bound" when the host (its part of the
steps and the gaps between them) takes a large fraction of the wall time, else "bandwidth-bound"
or "compute-bound", whichever ceiling the steps came closer to (the step records' utilizations,
jaxserve.planning.predict's roofline against the device's ceilings). Plain arithmetic, no jax;
serve.metrics reads the same figures back from a server's /metrics text."""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from jaxserve.core.outputs import StepRecord

# A run whose host time (scheduling, packing, detokenizing, and the gaps between steps while work
# waited) is at least this fraction of its step wall time is scheduling-bound.
SCHEDULING_BOUND_FRACTION = 0.5


@dataclasses.dataclass(frozen=True)
class RunBound:
    """The verdict and the figures it rests on (utilizations: mean over steps, None if unknown)."""
    bound: str  # "bandwidth-bound" | "compute-bound" | "scheduling-bound" | "device-bound" (ceilings unknown) | "idle"
    num_steps: int
    device_seconds: float
    host_seconds: float
    host_gap_seconds: float
    host_fraction: float  # (host + gap) / (device + host + gap)
    bandwidth_utilization: float | None
    compute_utilization: float | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def diagnose_totals(*, num_steps: int, device_seconds: float, host_seconds: float, host_gap_seconds: float,
                    bandwidth_utilization: float | None, compute_utilization: float | None) -> RunBound:
    """The verdict from a run's totals and its steps' mean utilizations."""
    wall = device_seconds + host_seconds + host_gap_seconds
    host_fraction = (host_seconds + host_gap_seconds) / wall if wall > 0 else 0.0
    if num_steps == 0 or wall <= 0:
        bound = "idle"
    elif host_fraction >= SCHEDULING_BOUND_FRACTION:
        bound = "scheduling-bound"
    elif bandwidth_utilization is None or compute_utilization is None:
        bound = "device-bound"
    else:
        bound = "bandwidth-bound" if bandwidth_utilization >= compute_utilization else "compute-bound"
    return RunBound(bound, num_steps, device_seconds, host_seconds, host_gap_seconds, host_fraction,
                    bandwidth_utilization, compute_utilization)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def diagnose_steps(records: Iterable[StepRecord]) -> RunBound:
    """The bound of the run these step records (Engine.step_records) describe."""
    records = list(records)
    return diagnose_totals(
        num_steps=len(records), device_seconds=sum(r.device_seconds for r in records),
        host_seconds=sum(r.host_seconds for r in records), host_gap_seconds=sum(r.host_gap_seconds for r in records),
        bandwidth_utilization=_mean([r.bandwidth_utilization for r in records if r.bandwidth_utilization is not None]),
        compute_utilization=_mean([r.compute_utilization for r in records if r.compute_utilization is not None]))
