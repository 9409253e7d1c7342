"""Step records priced against the roofline: a stage in front of step listeners.

The engine records what each step did (`StepRecord`: shape, tokens, context read, time) and
nothing more. A `StepPricer` adds the roofline's estimate of that work on one device
(`jaxserve.planning.predict`: bytes moved, FLOPs) and, where the device's ceilings are known,
the fraction of them the step achieved. The async client wraps its listeners with one
(`StepPricer.priced`), so /metrics and the benchmarks get priced records while a step nobody
listens to costs nothing more.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from jaxserve.config import EngineConfig
from jaxserve.core.outputs import StepRecord
from jaxserve.executor import device_setup
from jaxserve.planning import gpu_targets, memory, predict


class StepPricer:
    """The roofline's bytes, FLOPs and utilization of the steps of one engine's model and settings."""

    def __init__(self, model_config, cfg: EngineConfig):
        """Ceilings from cfg's memory_bandwidth_gbps / peak_tflops, else the GPU preset of the
        device's kind; none on a CPU told nothing (then records get no utilization)."""
        run = device_setup.platform_config(cfg)
        self.costs = predict.StepCostModel.create(
            memory.parallel_model(model_config, cfg),
            weight_dtype=memory.normalize_dtype(run.quantization or run.dtype, memory.WEIGHT_DTYPES),
            compute_dtype=run.dtype,
            kv_cache_dtype=run.dtype if run.kv_cache_dtype == "auto" else run.kv_cache_dtype,
            tensor_parallel_size=run.tensor_parallel_size)
        target = gpu_targets.target_for_device_kind(device_setup.device_kind()) if device_setup.on_gpu() else None
        self.ceilings = predict.resolve_ceilings(run, target)

    @classmethod
    def for_engine(cls, engine) -> "StepPricer":
        """The pricer of an `Engine`'s steps."""
        return cls(engine.model_config, engine.config)

    def cost(self, record: StepRecord) -> predict.StepCost:
        """The roofline's bytes and FLOPs of the step on one device."""
        steps = record.num_steps
        if steps == 1:
            return self.costs.step(record.num_tokens, record.num_kv_tokens_read, record.num_attention_pairs)
        # Multi-step decoding (decode rows only): `steps` passes over the weights in one call, each
        # row's context one longer at every pass.
        rows = record.num_decode_rows
        extra = rows * steps * (steps - 1) // 2
        cost = self.costs.step(rows * steps, steps * record.num_kv_tokens_read + extra,
                               steps * record.num_attention_pairs + extra)
        return dataclasses.replace(cost, bytes=cost.bytes + (steps - 1) * self.costs.weights_bytes,
                                   collectives=cost.collectives * steps, rows=rows)

    def price(self, record: StepRecord) -> StepRecord:
        """The record with its estimated bytes and FLOPs, and their utilization where the ceilings
        are known."""
        cost = self.cost(record)
        bandwidth_use = compute_use = None
        if self.ceilings is not None and record.device_seconds > 0:
            bandwidth_use = cost.bytes / record.device_seconds / self.ceilings.memory_bandwidth
            compute_use = cost.flops / record.device_seconds / self.ceilings.peak_flops
        return dataclasses.replace(record, estimated_bytes=cost.bytes, estimated_flops=cost.flops,
                                   bandwidth_utilization=bandwidth_use, compute_utilization=compute_use)

    def priced(self, listener: Callable[[StepRecord], None]) -> Callable[[StepRecord], None]:
        """A step listener that prices each record, then hands it to `listener`."""
        return PricedListener(self, listener)


class PricedListener:
    """`listener` fed priced records. Equal to `listener` itself (and to another PricedListener of
    it), so that `remove_step_listener(listener)` finds it."""

    def __init__(self, pricer: StepPricer, listener: Callable[[StepRecord], None]):
        self.pricer, self.listener = pricer, listener

    def __call__(self, record: StepRecord) -> None:
        self.listener(self.pricer.price(record))

    def __eq__(self, other) -> bool:
        return self.listener == (other.listener if isinstance(other, PricedListener) else other)

    def __hash__(self) -> int:
        return hash(self.listener)
