"""Engine and sampling flags shared by `generate` and `serve`."""
from __future__ import annotations

from absl import flags

_ENGINE_INT_FLAGS = {
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step (decode tokens + prefill chunks)",
    "max_num_prefill_seqs": "most prefill chunks in one step",
    "page_size": "tokens per KV cache page",
    "num_pages": "KV cache pages per layer, null page included (default: from the memory planner)",
    "max_model_len": "longest prompt + completion, in tokens (default: min(model context, 2048))",
    "max_waiting_requests": "bound of the waiting queue",
    "tensor_parallel_size": "devices each model replica is split over (attention heads, MLP, vocabulary)",
    "data_parallel_size": "model replicas, each on its own tensor_parallel_size devices",
}


def define_engine_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("model", "smollm2", "a converted model directory, a .gguf file, a Hugging Face "
                        "folder, or 'smollm2' (SmolLM2-135M-Instruct, fetched and converted on first use)",
                        flag_values=fv)
    for name, text in _ENGINE_INT_FLAGS.items():
        flags.DEFINE_integer(name, None, f"{text} (default: the engine's)", lower_bound=1, flag_values=fv)
    flags.DEFINE_boolean("enable_prefix_caching", None, "share KV pages of common prompt prefixes "
                         "(default: on)", flag_values=fv)
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                      "weights, activations and KV cache dtype (default: float32 on CPU, bfloat16 on GPU)",
                      flag_values=fv)
    flags.DEFINE_enum("attention_backend", None, ["pallas", "interpret", "xla", "reference"],
                      "attention implementation (default: pallas on GPU, xla on CPU)", flag_values=fv)
    flags.DEFINE_string("quantization", None, "quantize the linear layers after loading: int8 (per output "
                        "channel), int4 (groups of 32 with a zero point); also int8_g32|64|128, "
                        "int4_g64|128, _zp for int8 with a zero point, _sym for symmetric int4 (default: as stored)", flag_values=fv)
    flags.DEFINE_enum("kv_cache_dtype", None, ["auto", "int8", "fp8"], "KV cache storage: auto (the "
                      "weights' float dtype), int8 (per-token-per-head scales) or fp8 (e4m3fn)",
                      flag_values=fv)


def engine_kwargs(fv: flags.FlagValues) -> dict:
    """The engine flags the user set; the others keep the EngineConfig defaults."""
    names = list(_ENGINE_INT_FLAGS) + ["enable_prefix_caching", "dtype", "attention_backend",
                                       "quantization", "kv_cache_dtype"]
    return {name: fv[name].value for name in names if fv[name].value is not None}


def define_sampling_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_integer("max_tokens", 128, "most tokens generated per prompt", flag_values=fv)
    flags.DEFINE_float("temperature", 0.0, "sampling temperature; 0 = greedy", flag_values=fv)
    flags.DEFINE_float("top_p", 1.0, "nucleus sampling mass", flag_values=fv)
    flags.DEFINE_integer("top_k", 0, "sample among the k most likely tokens (0 = off)", flag_values=fv)
    flags.DEFINE_float("min_p", 0.0, "drop tokens below min_p x the top probability", flag_values=fv)
    flags.DEFINE_float("repetition_penalty", 1.0, "penalty on tokens already in prompt or output",
                       flag_values=fv)
    flags.DEFINE_float("presence_penalty", 0.0, "subtracted once from tokens already generated",
                       flag_values=fv)
    flags.DEFINE_float("frequency_penalty", 0.0, "subtracted per occurrence in the output", flag_values=fv)
    flags.DEFINE_integer("seed", None, "sampling seed (per request: same seed, same output)", flag_values=fv)
    flags.DEFINE_multi_string("stop", [], "stop string (repeatable); not included in the text",
                              flag_values=fv)
    flags.DEFINE_boolean("ignore_eos", False, "keep generating past the end-of-sequence token",
                         flag_values=fv)


def sampling_kwargs(fv: flags.FlagValues) -> dict:
    names = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "seed", "stop", "ignore_eos"]
    return {name: fv[name].value for name in names}
