"""The LoRA slab of a runner's model: its shapes under the engine's limits, and writes of an adapter
into a slot (jaxserve.models.lora holds the slab's arrays and the step's use of them)."""
from __future__ import annotations

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.models import lora as lora_lib


class LoRASlots:
    """The LoRA slab of a runner's model: its shapes under the engine's --max_loras and
    --max_lora_rank, and an adapter written into one of its slots (jaxserve.models.lora)."""

    def __init__(self, config: ModelConfig, engine_config: EngineConfig, dtype):
        self.config, self.dtype = config, dtype
        self.max_loras, self.max_rank = engine_config.max_loras, engine_config.max_lora_rank
        self.names = lora_lib.adaptable_names(config)
        self.shapes = lora_lib.projection_shapes(config)

    def init(self, shardings=None):
        """The zero slab, on the devices of `shardings` (a sharding.ModelShardings: a replica's mesh,
        where its step reads it; replicated) or, None, the default device."""
        sharding = None if shardings is None else shardings.replicated
        return lora_lib.init_slab(self.config, self.max_loras, self.max_rank, self.dtype, self.names, sharding)

    def write(self, slab, slot: int, adapter):
        arrays = adapter.padded(self.max_rank, self.names, self.shapes, self.config.num_layers)
        return lora_lib.write_slot(slab, slot, arrays)
