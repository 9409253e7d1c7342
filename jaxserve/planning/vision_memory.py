"""The memory of a vision-language model's image path on one device, for the planner: its tower's
weights (in the compute dtype, as the engine loads them), the image-embedding pool the encoder
cache hands out (jaxserve.core.encoder_cache.pool_rows rows of the language model's width), and an
estimate of the activations of the encoder's largest call: its rows' residual stream, attention
projections and MLP, and one block of attention scores and their softmax in float32 (Qwen2.5-VL: the patch bucket
of the largest image a step holds; Gemma 3: SigLIP's patches). On the CPU a float32 tower's
matrices are counted as the C++ kernel's strips (vision.cpu_strips: columns padded to 64)."""
from __future__ import annotations

import math

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core.encoder_cache import max_image_tokens, pool_rows

def vision_memory(model: ModelConfig, cfg: EngineConfig, compute_dtype: str, itemsize: int) -> dict[str, int]:
    """MemoryPlan's vision_weights_bytes, image_pool_bytes and vision_activation_bytes; {} for a text
    model. `itemsize`: bytes of one element in `compute_dtype` (the planner's table)."""
    if not model.multimodal_architecture:
        return {}
    from cpu_kernels import STRIP  # (device code, as the towers' declarations: imported here)
    from jaxserve.models import qwen_vision, vision
    module, config = vision.tower(model)
    # On the CPU (XLA path) a float32 tower's matrices are the C++ kernel's strips: columns padded to STRIP
    strips = cfg.attention_backend == "xla" and compute_dtype == "float32"
    weights = sum(math.prod(d.shape[:-1]) * (-(-d.shape[-1] // STRIP) * STRIP if strips and d.is_matrix else d.shape[-1])
                  for d in module.weight_decls(config)) * itemsize
    if module is qwen_vision:
        rows = qwen_vision.patch_buckets(max_image_tokens(cfg), config)[-1]
        block = qwen_vision.QUERY_BLOCK
    else:
        rows, block = config.num_patches, module.QUERY_BLOCK
    D, F = config.hidden_size, config.intermediate_size
    # the residual stream, q, k, v (and the window's neighbours), the MLP's two halves; the scores of one
    # query block and their softmax
    activations = rows * (6 * D + 2 * F) * itemsize + 2 * config.num_heads * min(rows, block) * rows * 4
    return {"vision_weights_bytes": weights, "image_pool_bytes": pool_rows(cfg) * model.hidden_size * itemsize,
            "vision_activation_bytes": activations}
