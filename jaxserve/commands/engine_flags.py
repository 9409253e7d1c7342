"""Engine flags shared by `serve`, `generate` and `plan`, and the sampling flags of `generate`.

The engine flags' defaults are EngineConfig's (jaxserve.engine): a flag left unset keeps the
EngineConfig default, so the three commands run, and plan for, the same engine.
"""
from __future__ import annotations

import dataclasses

from absl import flags

from jaxserve.config import EngineConfig

_DEFAULTS = EngineConfig()

_ENGINE_INT_FLAGS = {
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "token budget of one step (decode tokens + prefill chunks)",
    "max_num_prefill_seqs": "most prefill chunks in one step",
    "long_prefill_token_threshold": "most prefill tokens a step carries beside decoding sequences (bounds "
                                    "their time per output token while a long prompt is prefilled; costs that "
                                    "prompt's time to first token)",
    "page_size": "tokens per KV cache page",
    "num_pages": "KV cache pages per layer, null page included",
    "max_model_len": "longest prompt + completion, in tokens",
    "max_waiting_requests": "bound of the waiting queue",
    "tensor_parallel_size": "devices each model replica is split over (attention heads, MLP, vocabulary)",
    "data_parallel_size": "model replicas, each on its own tensor_parallel_size devices",
    "num_scheduler_steps": "multi-step decoding: decode steps per device call when every running sequence "
                           "decodes (1: one step per call; tokens then reach the client n at a time)",
    "num_speculative_tokens": "speculative decoding: most tokens proposed per sequence and step",
    "prompt_lookup_min": "speculative_method=ngram: shortest n-gram matched",
    "prompt_lookup_max": "speculative_method=ngram: longest n-gram matched (tried first)",
    "speculative_disable_by_batch_size": "speculative decoding: no speculation in steps with more running sequences",
}
# vLLM's engine flag names for the same settings (absl's underscore form), accepted as aliases.
VLLM_FLAG_ALIASES = {"gpu_memory_utilization": "memory_utilization", "block_size": "page_size",
                     "num_gpu_blocks_override": "num_pages"}
# What an unset flag means where the EngineConfig default is None.
_OPEN_DEFAULTS = {
    "num_pages": "what the memory planner fits (`jaxserve plan` shows it)",
    "max_model_len": "min(the model's context, 2048)",
    "dtype": "float32 on CPU, bfloat16 on GPU",
    "attention_backend": "pallas on GPU, xla on CPU",
    "quantization": "as stored",
    "speculative_method": "off",
    "speculative_model": "none",
    "speculative_disable_by_batch_size": "never",
    "long_prefill_token_threshold": "serve on CPU: 32; otherwise no bound",
}


def _default(name: str) -> str:
    value = getattr(_DEFAULTS, name)
    return f"(default: {_OPEN_DEFAULTS[name] if value is None else value})"


def define_engine_flags(fv: flags.FlagValues) -> None:
    """The --model flag and one flag per EngineConfig setting a user may change; each defaults
    to None, which keeps the EngineConfig default (named in the help)."""
    from checkpoints.default_model import DEFAULT_MODEL

    flags.DEFINE_string("model", DEFAULT_MODEL, "a converted model directory, a .gguf file, a Hugging Face "
                        "folder, a Hugging Face id 'org/name' in the local Hugging Face cache ($HF_HOME; never "
                        f"downloaded), or '{DEFAULT_MODEL}' (SmolLM2-135M-Instruct, fetched and converted on first "
                        "use)", flag_values=fv)
    for name, text in _ENGINE_INT_FLAGS.items():
        flags.DEFINE_integer(name, None, f"{text} {_default(name)}", lower_bound=1, flag_values=fv)
    flags.DEFINE_boolean("enable_prefix_caching", None, "share KV pages of common prompt prefixes "
                         f"{_default('enable_prefix_caching')}", flag_values=fv)
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                      f"weights, activations and KV cache dtype {_default('dtype')}", flag_values=fv)
    flags.DEFINE_enum("attention_backend", None, ["pallas", "interpret", "xla", "reference"],
                      f"attention implementation {_default('attention_backend')}", flag_values=fv)
    flags.DEFINE_string("quantization", None, "quantize the linear layers after loading: int8 (per output "
                        "channel), int4 (groups of 32 with a zero point); also int8_g32|64|128, "
                        "int4_g64|128, _zp for int8 with a zero point, _sym for symmetric int4 "
                        f"{_default('quantization')}", flag_values=fv)
    flags.DEFINE_boolean("quantize_embedding", None, "also quantize the token embedding to int8 (one scale per "
                         "vocabulary row) and with it the tied lm_head (an untied one per output channel); one "
                         f"device per replica (no tensor parallelism) {_default('quantize_embedding')}",
                         flag_values=fv)
    flags.DEFINE_enum("kv_cache_dtype", None, ["auto", "int8", "fp8"], "KV cache storage: auto (the "
                      "weights' float dtype), int8 (per-token-per-head scales) or fp8 (e4m3fn) "
                      f"{_default('kv_cache_dtype')}", flag_values=fv)
    flags.DEFINE_boolean("cpu_int8_activations", None, "quantized weights on the CPU: steps of up to 64 rows "
                         "multiply int8-quantized activations with the weight codes in integer dot products "
                         "(faster decoding; about 0.5% noise on the logits); false: float activations, the "
                         f"weights dequantized by XLA {_default('cpu_int8_activations')}", flag_values=fv)
    flags.DEFINE_enum("speculative_method", None, ["ngram", "draft"], "speculative decoding: ngram (prompt "
                      "lookup: propose what followed the last n tokens earlier in the sequence) or draft (a "
                      f"smaller model with the same tokenizer, --speculative_model) {_default('speculative_method')}",
                      flag_values=fv)
    flags.DEFINE_string("speculative_model", None, "the draft model of --speculative_method=draft (anything "
                        f"--model takes) {_default('speculative_model')}", flag_values=fv)
    flags.DEFINE_float("memory_utilization", None, "fraction of the device's memory budget (on CPU: half the "
                       "available RAM) the weights, activations and KV pages may use "
                       f"{_default('memory_utilization')}", lower_bound=0.0, upper_bound=1.0, flag_values=fv)
    flags.DEFINE_string("executables", None, "load the compiled step shapes from this folder (written by "
                        "--save_executables) instead of compiling them; refused when they were saved for another "
                        "jax, device, model or engine flags (default: kept automatically beside the compilation "
                        "cache)", flag_values=fv)
    flags.DEFINE_string("save_executables", None, "compile every step shape and save the executables in this "
                        "folder, for --executables", flag_values=fv)
    for alias, name in VLLM_FLAG_ALIASES.items():  # a vLLM command line ports by changing dashes
        flags.DEFINE_alias(alias, name, flag_values=fv)


_ENGINE_FLAGS = list(_ENGINE_INT_FLAGS) + ["enable_prefix_caching", "dtype", "attention_backend", "quantization",
                                           "quantize_embedding",
                                           "kv_cache_dtype", "cpu_int8_activations", "memory_utilization",
                                           "speculative_method", "speculative_model", "executables",
                                           "save_executables"]


def engine_kwargs(fv: flags.FlagValues) -> dict:
    """The engine flags the user set; the others keep the EngineConfig defaults."""
    return {name: fv[name].value for name in _ENGINE_FLAGS if fv[name].value is not None}


def engine_config(fv: flags.FlagValues, **overrides) -> EngineConfig:
    """The EngineConfig the engine flags describe (with `overrides`, e.g. warmup=False)."""
    return dataclasses.replace(EngineConfig(**engine_kwargs(fv)), **overrides)


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


def define_distributed_flags(fv: flags.FlagValues) -> None:
    """The flags of a multi-host job (`serve` and `generate`; see jaxserve.parallel.multihost)."""
    from jaxserve.parallel import multihost

    flags.DEFINE_string("coordinator_address", None, "host:port of process 0 of a multi-host job (every process "
                        "runs the same command; default: $JAXSERVE_COORDINATOR_ADDRESS, else a SLURM / Open MPI "
                        "job's, else a single process)", flag_values=fv)
    flags.DEFINE_integer("num_processes", None, "processes of the multi-host job (default: "
                         "$JAXSERVE_NUM_PROCESSES or the cluster's)", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("process_id", None, "this process's index in the job, 0 the front (HTTP server, input "
                         "file, scheduler) (default: $JAXSERVE_PROCESS_ID or the cluster's)", lower_bound=0,
                         flag_values=fv)
    flags.DEFINE_integer("heartbeat_timeout_s", multihost.DEFAULT_HEARTBEAT_TIMEOUT_S, "multi-host: a process "
                         "that sends no heartbeat for this long is lost (the job fails, requests end with an "
                         "error naming it)", lower_bound=1, flag_values=fv)
    flags.DEFINE_float("step_timeout_s", multihost.DEFAULT_STEP_TIMEOUT_S, "multi-host: a step not finished on "
                       "every process after this long fails the job (a hung process; compiling a new shape "
                       "counts, so keep it above the slowest compile when warm-up is off)", lower_bound=0.1,
                       flag_values=fv)


def join_options(fv: flags.FlagValues):
    """The multihost.JoinOptions the distributed flags describe (flags > $JAXSERVE_ variables >
    SLURM / Open MPI), None for a single process; ValueError for settings that cannot work,
    including tensor / data parallel sizes that do not span the processes."""
    from jaxserve.parallel import multihost

    options = multihost.resolve_join_options(fv.coordinator_address, fv.num_processes, fv.process_id,
                                             heartbeat_timeout_s=fv.heartbeat_timeout_s)
    if options is not None and options.num_processes:
        defaults = EngineConfig()
        from jaxserve.parallel import sharding
        sharding.check_parallel_sizes(fv.tensor_parallel_size or defaults.tensor_parallel_size,
                                      fv.data_parallel_size or defaults.data_parallel_size, options.num_processes)
    return options


def enter_job(fv: flags.FlagValues, command: str, **follow_overrides):
    """How `command` starts in a multi-host job: (the job's JoinOptions, None for a single
    process; None to go on as process 0 or alone, else the exit code this process ends with:
    2 for settings that cannot work, 1 when it cannot join, a worker's after following process 0
    (`follow_front` with `follow_overrides`))."""
    import sys

    try:
        options = join_options(fv)
    except ValueError as e:
        print(f"jaxserve {command}: {e}", file=sys.stderr)
        return None, 2
    if options is None:
        return None, None
    process = join_job(options, command)
    if process is None:
        return options, 1
    if process != 0:
        return options, follow_front(fv, command, **follow_overrides)
    return options, None


def join_job(options, command: str) -> int | None:
    """Joins the multi-host job; this process's index (0: the front), or None after printing why
    it could not join."""
    import logging
    import sys

    from jaxserve.parallel import multihost
    # Every process of a job logs its role, its share of the weights and how the job ends.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src.xla_bridge", "jax._src.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        multihost.initialize(options)
    except Exception as e:  # the runtime raises XlaRuntimeError / ValueError / RuntimeError
        print(f"jaxserve {command}: cannot join the multi-host job: {e}", file=sys.stderr)
        return None
    import jax
    return jax.process_index()


def follow_front(fv: flags.FlagValues, command: str, **overrides) -> int:
    """A worker process (process_id > 0) of `command`: builds the same engine as process 0, then
    runs the steps process 0 sends until it says stop (0), or fails loudly: 2 when the engine
    cannot be built (process 0 fails the same way), 1 when process 0 is lost or a step fails."""
    import logging
    import signal
    import sys

    import jax

    from jaxserve.engine import Engine
    from jaxserve.parallel import multihost

    pid = jax.process_index()
    # SIGTERM (a Kubernetes pod deletion reaches every process at once): keep following until
    # process 0 has drained and says stop, or is gone.
    signal.signal(signal.SIGTERM, lambda *_: logging.getLogger(__name__).warning(
        "process %d: SIGTERM; waiting for process 0 to drain and stop the job", pid))
    try:
        engine = Engine.from_model(fv.model, engine_config(fv, **overrides))
    except (ValueError, OSError) as e:
        print(f"jaxserve {command}: process {pid}: cannot load {fv.model!r}: {e}", file=sys.stderr)
        return 2
    try:
        multihost.follow(engine)
    except Exception as e:  # process 0 lost (MultiHostError), or a step failed here (reported to process 0)
        text = str(e) if isinstance(e, multihost.MultiHostError) else f"a step failed: {type(e).__name__}: {e}"
        print(f"jaxserve {command}: process {pid}: {text}", file=sys.stderr)
        multihost.exit_now(1)
    multihost.leave()
    return 0


def run_front(engine, work, command: str, fv: flags.FlagValues) -> int:
    """Process 0 of a multi-host job: routes the engine's steps to every process, runs `work()`,
    then tells the others to stop. A failed job exits at once with 1, naming the failure."""
    import sys

    from jaxserve.parallel import multihost

    try:
        front = multihost.Front(fv.step_timeout_s, fv.heartbeat_timeout_s)
        front.attach(engine)
    except (ValueError, multihost.MultiHostError) as e:  # unsupported settings, or a process lost already
        print(f"jaxserve {command}: {e}", file=sys.stderr)
        multihost.exit_now(2 if isinstance(e, ValueError) else 1)
    try:
        code = work()
    finally:
        front.stop()
    if front.failure is not None:
        print(f"jaxserve {command}: the multi-host job failed: {front.failure}", file=sys.stderr)
        multihost.exit_now(1)
    return code
