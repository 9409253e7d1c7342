"""Device-side choices made once at start-up: dtype, quantization, attention backend, KV pool size."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve import environment
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.models import cpu_layout, quantization
from jaxserve.planning import memory
from pallas_kernels import dispatch, kv_quant


def enable_compilation_cache() -> None:
    """JAX's persistent compilation cache, so that restarts skip compiling the step shapes
    (environment.compilation_cache_dir)."""
    cache_dir = environment.compilation_cache_dir()
    if jax.config.jax_compilation_cache_dir is None and cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def process_count() -> int:
    """Processes of the jax job (1 unless multi-host)."""
    return jax.process_count()


def device_kind() -> str:
    """What the first device is, as jax names it ("cpu", "NVIDIA H100 80GB HBM3", ...)."""
    return jax.devices()[0].device_kind


def param_dtype(name: str | None):
    """The jnp dtype named (float32, bfloat16, float16); None: this platform's default
    (EngineConfig.for_platform: bfloat16 on GPU, float32 on CPU)."""
    if name is None:
        name = EngineConfig().for_platform(on_gpu()).dtype
    try:
        return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use float32, bfloat16 or float16") from None


def kv_cache_dtype(name: str | None):
    """The KV page dtype for a --kv_cache_dtype name: None for 'auto' (the weights' float dtype),
    int8 (per-token scales) or float8_e4m3fn ('fp8'). ValueError on any other name."""
    if name is None or name == "auto":
        return None
    if name not in kv_quant.KV_CACHE_DTYPES:
        raise ValueError(f"unsupported kv_cache_dtype {name!r}; use auto, {', '.join(kv_quant.KV_CACHE_DTYPES)}")
    return kv_quant.KV_CACHE_DTYPES[name]


def check_attention_operands(backend: str, config: ModelConfig, dtype, kv_dtype, page_size: int) -> None:
    """ValueError, naming the flags to change, when `backend`'s kernels cannot take this model's
    attention: queries in `dtype` over pages of `page_size` in `kv_dtype` (None: `dtype`)."""
    q = jax.ShapeDtypeStruct((1, config.num_q_heads, config.head_dim), dtype)
    pages = jax.eval_shape(lambda: kv_quant.zeros((1, page_size, config.num_kv_heads, config.head_dim),
                                                  kv_dtype or dtype))
    reason = dispatch.unsupported_operands(backend, q, pages)
    if reason:
        raise ValueError(f"--attention_backend={backend}: the Mosaic GPU kernels do not take {reason}; use "
                         "--attention_backend=pallas (Triton) or xla, or change --dtype / --kv_cache_dtype / "
                         "--page_size")


def quantize_weights(params, name: str | None, config, *, embedding: bool = False, sharded: bool = False):
    """`params` with the linear layers quantized as `name` (int8, int4, ...; None: unchanged),
    and with `embedding` the token embedding and lm_head in int8 (quantization.quantize_embedding).
    ValueError for an unknown format, a group size that does not fit, or an int8 embedding of
    `sharded` weights (the tensor-parallel rules split only a float embedding). Sharded weights
    stay on their devices; the runner places the results in their tensor-parallel layout."""
    if embedding and sharded:
        raise ValueError("quantize_embedding needs the weights on one device (tensor and data parallel size 1, one process)")
    if name:
        params = quantization.quantize_params(params, name, config)
    if embedding and not isinstance(params["embed"], quantization.QuantEmbedding):
        params = quantization.quantize_embedding(params)
    return params


def array_bytes(*trees) -> tuple[int, ...]:
    """Bytes of the arrays of each pytree (all shards together)."""
    return tuple(quantization.tree_bytes(tree) for tree in trees)


def attention_backend(override: str | None) -> str:
    """The attention backend: `override` (EngineConfig.attention_backend), else
    $JAXSERVE_ATTENTION_BACKEND, else the platform's (pallas_kernels.dispatch)."""
    if override:
        return dispatch.attention_backend(override)
    try:
        return dispatch.attention_backend(environment.attention_backend())
    except ValueError as e:
        raise ValueError(f"{e} (from ${environment.ATTENTION_BACKEND})") from None


def platform_config(cfg):
    """`cfg` (an EngineConfig) with this machine's defaults filled in: the attention backend
    (pallas_kernels.dispatch's choice: Pallas on a GPU with its lowering, else the XLA path;
    $JAXSERVE_ATTENTION_BACKEND wins) and the dtype (EngineConfig.for_platform)."""
    cfg = dataclasses.replace(cfg, attention_backend=attention_backend(cfg.attention_backend))
    return cfg.for_platform(on_gpu())


def memory_budget_bytes(shardings=None) -> int:
    """The memory budget of the device the KV pool is planned for: the first device of
    `shardings`' mesh, else the first device. Read it before the weights are loaded."""
    device = jax.devices()[0] if shardings is None else shardings.mesh.devices.flat[0]
    return memory.device_memory_budget_bytes(device)


def plan_engine(model_config: ModelConfig, cfg, params, *, shardings=None,
                device_memory_bytes: int | None = None, draft_model: ModelConfig | None = None) -> memory.MemoryPlan:
    """memory.plan_engine for an engine over the loaded `params` (on one device, or split as
    `shardings` says): this machine's platform defaults, the weights' float dtype, and, for
    quantized weights, the bytes one device holds of them in place of the estimate."""
    cfg = platform_config(dataclasses.replace(cfg, dtype=jnp.dtype(params["final_norm"].dtype).name))
    if device_memory_bytes is None:
        device_memory_bytes = memory_budget_bytes(shardings)
    measured = quantized_weights_bytes(params, shardings)
    layouts = cpu_step_layout_bytes(params, cfg, on_gpu())
    if measured is not None or layouts:
        measured = (quantization.tree_bytes(params) if measured is None else measured) + layouts
    return memory.plan_engine(model_config, cfg, device_memory_bytes=device_memory_bytes, on_gpu=on_gpu(),
                              measured_weights_bytes=measured, draft_model=draft_model)


def cpu_step_layout_bytes(params, cfg: EngineConfig, gpu: bool) -> int:
    """The bytes the CPU step's copies of quantized or bfloat16 weights take (cpu_layout.layer_views:
    the C++ kernel's layout, or the transposed one) when each replica sits on one CPU device; 0 on
    a GPU or with tensor parallelism (the step reads the stored weights)."""
    if gpu or cfg.tensor_parallel_size > 1:
        return 0
    return cpu_layout.layer_views_bytes(params, cfg.cpu_int8_activations)


def quantized_weights_bytes(params, shardings=None) -> int | None:
    """The bytes one device holds of `params` (arrays or abstract arrays, split as `shardings`
    says) when some of them are quantized; None for float weights (the planner estimates those)."""
    if not quantization.params_formats(params) and not isinstance(params["embed"], quantization.QuantEmbedding):
        return None
    return quantization.tree_bytes(params) if shardings is None else shardings.per_device_bytes(params)
