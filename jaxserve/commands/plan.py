"""`jaxserve plan`: how many KV pages and concurrent sequences fit on one device; with
`--target=h100 --compile`, the GPU build compiled for that GPU without one (jaxserve.gpu_compile)."""
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
    flags.DEFINE_enum("target", None, ["a100", "h100", "h200"], "Plan for this GPU (its memory) instead of "
                      "the local device; with --compile, compile the GPU build for it.", flag_values=fv)
    flags.DEFINE_boolean("compile", False, "With --target: build the engine as `serve` would on that GPU "
                         "(bfloat16, Pallas kernels, the GPU buckets, --tensor_parallel_size GPUs) with abstract "
                         "weights and compile every step bucket and sampler shape; needs the gpu-compile extra.",
                         flag_values=fv)
    flags.DEFINE_enum("buckets", "all", ["all", "ends"], "With --compile: every bucket warm-up compiles, or "
                      "the smallest and largest of each kind.", flag_values=fv)
    flags.DEFINE_integer("max_num_prefill_seqs", 2, "Prefill chunks per step (the engine's "
                         "max_num_prefill_seqs).", lower_bound=1, flag_values=fv)
    flags.DEFINE_string("quantization", None, "With --compile: quantized linear weights (int8, int4, ...).",
                        flag_values=fv)


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
    if fv.device_memory_gb is None and fv.target is not None:
        from jaxserve.gpu_targets import target_memory_budget_bytes
        return target_memory_budget_bytes(fv.target)
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
    """Prints the memory plan (and the compile report); returns 0, or 2 with a message on stderr
    on bad input or when a bucket fails to compile."""
    if fv.compile and fv.target is None:
        print("jaxserve plan: --compile needs --target (one of a100, h100, h200)", file=sys.stderr)
        return 2
    try:
        model = _load_model_config(fv)
        if fv.compile:
            return _compile(fv, model)
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
            max_prefill_seqs=fv.max_num_prefill_seqs,
            backend="pallas" if fv.target else "reference",
        )
    except (ValueError, OSError) as e:  # ConfigError and MemoryPlanError are ValueErrors
        print(f"jaxserve plan: {e}", file=sys.stderr)
        return 2
    if fv.format == "table":
        print(format_table(plan))
    else:
        print(json.dumps(plan.to_dict(), indent=2))
    return 0


def _compile(fv: flags.FlagValues, model: ModelConfig) -> int:
    from jaxserve import gpu_compile
    try:
        report = gpu_compile.compile_for_gpu(
            model, target=fv.target, tensor_parallel_size=fv.tensor_parallel_size, dtype=fv.dtype,
            quantization_format=fv.quantization, kv_cache_dtype=fv.kv_cache_dtype, page_size=fv.page_size,
            max_model_len=fv.max_model_len, max_num_seqs=fv.max_num_seqs,
            max_num_batched_tokens=fv.max_num_batched_tokens, max_num_prefill_seqs=fv.max_num_prefill_seqs,
            memory_utilization=fv.gpu_memory_utilization, which_buckets=fv.buckets)
    except gpu_compile.GpuCompileUnavailable as e:
        print(f"jaxserve plan: {e}", file=sys.stderr)
        return 2
    compiled = report["compile"]
    if fv.format == "table":
        print(format_compile_table(report))
    else:
        print(json.dumps({**report["plan"], "compile": compiled}, indent=2))
    failed = [b for b in compiled["buckets"] + compiled["sampler"] if not b["ok"]]
    if failed:
        print(f"jaxserve plan: {len(failed)} shape(s) failed to compile for {fv.target}; the first, "
              f"{failed[0]['bucket']}: {failed[0]['error']}", file=sys.stderr)
        return 2
    return 0


def format_compile_table(report: dict) -> str:
    """The plan, then one line per compiled shape: XLA's bytes next to the planner's."""
    mib = lambda n: "-" if n is None else f"{n / memory.MiB:,.1f}"
    compiled = report["compile"]
    lines = [f"{key}: {value}" for key, value in report["plan"].items()]
    lines.append(f"compiled for {compiled['target']} x {compiled['tensor_parallel_size']} with jax "
                 f"{compiled['jax_version']} (MiB per device)")
    lines.append(f"{'shape':<34} {'ok':<3} {'pallas':>6} {'temp':>9} {'planned':>9} {'args':>10} {'out':>9} "
                 f"{'compile s':>9}")
    for entry in compiled["buckets"] + compiled["sampler"]:
        shape = ",".join(f"{k}={v}" for k, v in entry["bucket"].items())
        lines.append(f"{shape:<34} {'yes' if entry['ok'] else 'NO':<3} {entry['pallas_kernels']:>6} "
                     f"{mib(entry['temp_bytes']):>9} {mib(entry['planned_activation_bytes']):>9} "
                     f"{mib(entry['argument_bytes']):>10} {mib(entry['output_bytes']):>9} "
                     f"{entry['compile_seconds']:>9}")
    return "\n".join(lines)
