"""Device-side choices made once at start-up: dtype, attention backend, KV pool size."""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from jaxserve import memory
from jaxserve.config import ModelConfig
from pallas_kernels import dispatch


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


def attention_backend(override: str | None) -> str:
    return dispatch.attention_backend(override)


def plan_num_pages(model_config: ModelConfig, cfg, max_model_len: int, params) -> int:
    """KV pages for the engine: the planner's answer for this device's memory budget.

    On CPU the pool is also capped at what max_num_seqs sequences of max_model_len tokens can
    use, so that a laptop-sized run does not zero gigabytes it will never touch."""
    dtype = jax.tree_util.tree_leaves(params)[0].dtype
    budget = memory.device_memory_budget_bytes(jax.devices()[0])
    plan = memory.plan_memory(
        model_config, device_memory_bytes=budget, memory_utilization=cfg.memory_utilization,
        weight_dtype=jnp.dtype(dtype).name, page_size=cfg.page_size, max_model_len=max_model_len,
        max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
        max_prefill_seqs=cfg.max_num_prefill_seqs)
    num_pages = plan.num_pages
    if not on_gpu():
        pages_per_seq = -(-max_model_len // cfg.page_size)
        num_pages = min(num_pages, cfg.max_num_seqs * pages_per_seq + 1)
    return num_pages
