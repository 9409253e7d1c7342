"""`jaxserve plan`: how many KV pages and concurrent sequences fit on one device."""
from __future__ import annotations

import json
import sys

from absl import flags

from jaxserve import memory
from jaxserve.config import ConfigError, ModelConfig


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("config", None, "Hugging Face config.json of the model.", flag_values=fv)
    flags.DEFINE_string("model", None, "Converted checkpoint directory or a known model name "
                        "(e.g. smollm2); alternative to --config.", flag_values=fv)
    flags.DEFINE_string("dtype", "bfloat16", f"Weight dtype: {', '.join(memory.WEIGHT_DTYPES)}.",
                        flag_values=fv)
    flags.DEFINE_string("kv_cache_dtype", "auto", "KV cache dtype; 'auto' follows the compute dtype.",
                        flag_values=fv)
    flags.DEFINE_integer("page_size", 16, "Tokens per KV page.", flag_values=fv)
    flags.DEFINE_integer("max_model_len", None, "Longest sequence (prompt + output); default: the "
                         "model's max_position_embeddings.", flag_values=fv)
    flags.DEFINE_integer("max_num_batched_tokens", 2048, "Tokens of the largest step bucket.",
                         flag_values=fv)
    flags.DEFINE_integer("max_num_seqs", 256, "Sequences of the largest step bucket.", flag_values=fv)
    flags.DEFINE_float("device_memory_gb", None, "Memory of one device in GiB (2**30 bytes); "
                       "default: read from the first jax device (host RAM on CPU).", flag_values=fv)
    flags.DEFINE_float("gpu_memory_utilization", 0.9, "Fraction of the device memory to use.",
                       flag_values=fv)
    flags.DEFINE_integer("tensor_parallel_size", 1, "Devices the model is split over.", flag_values=fv)
    flags.DEFINE_enum("format", "json", ["json", "table"], "Output format.", flag_values=fv)


def _load_model_config(fv: flags.FlagValues) -> ModelConfig:
    if (fv.config is None) == (fv.model is None):
        raise ConfigError("give exactly one of --config=config.json or --model=DIR|NAME")
    if fv.config is not None:
        return ModelConfig.from_json_file(fv.config)
    try:
        from checkpoints.default_model import resolve_model
        from checkpoints.load import load_config
    except ImportError as e:
        raise ConfigError(f"--model is unavailable ({e}); use --config=config.json") from None
    return load_config(resolve_model(fv.model))


def _device_memory_bytes(fv: flags.FlagValues) -> int:
    if fv.device_memory_gb is None:
        return memory.device_memory_budget_bytes()
    if not fv.device_memory_gb > 0:
        raise memory.MemoryPlanError(f"--device_memory_gb must be positive, got {fv.device_memory_gb}")
    return int(fv.device_memory_gb * memory.GiB)


def format_table(plan: memory.MemoryPlan) -> str:
    """A two-column human-readable view of the plan."""
    rows = []
    for key, value in plan.to_dict().items():
        if key.endswith("_bytes"):
            shown = f"{memory.format_bytes(value)} ({value:,} B)"
        elif isinstance(value, int):
            shown = f"{value:,}"
        else:
            shown = str(value)
        rows.append((key, shown))
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key:<{width}}  {shown}" for key, shown in rows)


def run(fv: flags.FlagValues) -> int:
    """Prints the memory plan; returns 0, or 2 with a message on stderr on bad input."""
    try:
        model = _load_model_config(fv)
        plan = memory.plan_memory(
            model,
            device_memory_bytes=_device_memory_bytes(fv),
            memory_utilization=fv.gpu_memory_utilization,
            weight_dtype=fv.dtype,
            kv_cache_dtype=fv.kv_cache_dtype,
            page_size=fv.page_size,
            max_model_len=fv.max_model_len,
            max_num_batched_tokens=fv.max_num_batched_tokens,
            max_num_seqs=fv.max_num_seqs,
            tensor_parallel_size=fv.tensor_parallel_size,
        )
    except (ValueError, OSError) as e:  # ConfigError and MemoryPlanError are ValueErrors
        print(f"jaxserve plan: {e}", file=sys.stderr)
        return 2
    if fv.format == "table":
        print(format_table(plan))
    else:
        print(json.dumps(plan.to_dict(), indent=2))
    return 0
