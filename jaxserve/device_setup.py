"""Device-side choices made once at start-up: dtype, quantization, attention backend, KV pool size."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from jaxserve import memory, quantization
from jaxserve.config import ModelConfig
from pallas_kernels import dispatch, kv_quant


def enable_compilation_cache() -> None:
    """JAX's persistent compilation cache, so that restarts skip compiling the step shapes."""
    cache_dir = os.environ.get("JAXSERVE_COMPILATION_CACHE",
                               os.path.join(os.path.expanduser("~"), ".cache", "jaxserve", "xla"))
    if jax.config.jax_compilation_cache_dir is None and cache_dir:
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def param_dtype(name: str | None):
    """float32 on CPU and bfloat16 on GPU unless a dtype is named."""
    if name is None:
        return jnp.bfloat16 if on_gpu() else jnp.float32
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


def quantize_weights(params, name: str | None):
    """`params` with the linear layers quantized as `name` (int8, int4, ...; None: unchanged).
    ValueError for an unknown format or a group size that does not fit. Sharded weights stay on
    their devices; the runner places the results in their tensor-parallel layout."""
    if not name:
        return params
    return quantization.quantize_params(params, name)


def array_bytes(*trees) -> tuple[int, ...]:
    """Bytes of the arrays of each pytree (all shards together)."""
    return tuple(quantization.tree_bytes(tree) for tree in trees)


def attention_backend(override: str | None) -> str:
    return dispatch.attention_backend(override)


def plan_num_pages(model_config: ModelConfig, cfg, max_model_len: int, params, *,
                   shardings=None) -> int:
    """KV pages for the engine: the planner's answer for one device's memory budget (the first
    device of `shardings`' mesh, else the first device), with weights and KV heads split over
    its tensor-parallel devices.

    On CPU the pool is also capped at what max_num_seqs sequences of max_model_len tokens can
    use, so that a laptop-sized run does not zero gigabytes it will never touch."""
    dtype = params["embed"].dtype  # quantized weights: the dtype of the float leaves
    measured_weights_bytes = None  # quantized weights: what the loaded arrays hold on one device
    if quantization.params_formats(params):
        measured_weights_bytes = (quantization.tree_bytes(params) if shardings is None
                                  else shardings.per_device_bytes(params))
    tensor_parallel_size = 1 if shardings is None else shardings.tensor_parallel_size
    device = jax.devices()[0] if shardings is None else shardings.mesh.devices.flat[0]
    budget = memory.device_memory_budget_bytes(device)
    plan = memory.plan_memory(
        model_config, device_memory_bytes=budget, memory_utilization=cfg.memory_utilization,
        weight_dtype=jnp.dtype(dtype).name, page_size=cfg.page_size, max_model_len=max_model_len,
        kv_cache_dtype=cfg.kv_cache_dtype,
        measured_weights_bytes=measured_weights_bytes,
        max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
        max_prefill_seqs=cfg.max_num_prefill_seqs, tensor_parallel_size=tensor_parallel_size)
    num_pages = plan.num_pages
    if not on_gpu():
        pages_per_seq = -(-max_model_len // cfg.page_size)
        num_pages = min(num_pages, cfg.max_num_seqs * pages_per_seq + 1)
    return num_pages


DISTRIBUTED_ENV_VARS = ("JAXSERVE_COORDINATOR_ADDRESS", "JAXSERVE_NUM_PROCESSES", "JAXSERVE_PROCESS_ID")


def initialize_distributed() -> bool:
    """Joins a multi-host job (jax.distributed.initialize) when $JAXSERVE_COORDINATOR_ADDRESS
    (host:port of process 0), $JAXSERVE_NUM_PROCESSES and $JAXSERVE_PROCESS_ID are set; then
    jax.devices() lists the devices of every host. Must run before jax touches a device.
    Returns whether this process is part of a multi-host job."""
    if jax.distributed.is_initialized():
        return True
    values = [os.environ.get(name) for name in DISTRIBUTED_ENV_VARS]
    if not values[0]:
        return False
    try:
        num_processes, process_id = int(values[1]), int(values[2])
    except (TypeError, ValueError):
        raise ValueError(f"{DISTRIBUTED_ENV_VARS[0]} is set, so {DISTRIBUTED_ENV_VARS[1]} and "
                         f"{DISTRIBUTED_ENV_VARS[2]} must be integers") from None
    jax.distributed.initialize(values[0], num_processes=num_processes, process_id=process_id)
    return True
