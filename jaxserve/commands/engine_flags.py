"""Engine flags shared by `serve`, `generate` and `plan`, and the sampling flags of `generate`.

The engine flags are EngineConfig's fields (jaxserve.settings.setting declares each one's help, bounds
and vLLM alias beside the field): a flag left unset keeps the EngineConfig default, so the three
commands run, and plan for, the same engine. absl checks each flag's own bounds as it parses; the
settings together are checked right after (`settings_problem`, which jaxserve.commands.cli calls),
before anything loads. The sampling flags are SamplingParams' fields, each checked by the request
check (jaxserve.core.request.check_sampling_params) as it is parsed.
"""
from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import types
import typing

from absl import flags

from checkpoints.default_model import DEFAULT_MODEL
from jaxserve.config import EngineConfig
from jaxserve.core.request import SamplingParams, check_sampling_params
from jaxserve.parallel import multihost, multihost_front  # jax only inside their functions: `plan` starts without jax
from jaxserve.settings import Flag, SettingError

_DEFINE = {int: flags.DEFINE_integer, float: flags.DEFINE_float, bool: flags.DEFINE_boolean, str: flags.DEFINE_string}


def _flag_fields() -> list[tuple[dataclasses.Field, type, Flag]]:
    """(field, its type less None, its Flag) of every EngineConfig field declared with `setting`."""
    hints = typing.get_type_hints(EngineConfig)
    out = []
    for field in dataclasses.fields(EngineConfig):
        if "flag" in field.metadata:
            kind = _without_none(hints[field.name])
            kind = str if typing.get_origin(kind) is tuple else kind  # sizes: their text (EngineConfig parses it)
            out.append((field, kind, field.metadata["flag"]))
    return out


def _without_none(hint):
    """int | None -> int; any other type as it is."""
    if isinstance(hint, types.UnionType):
        return next(t for t in typing.get_args(hint) if t is not type(None))
    return hint


ENGINE_FLAGS = tuple(field.name for field, _, _ in _flag_fields())


def _help(field: dataclasses.Field, flag: Flag) -> str:
    default = flag.unset if flag.unset is not None else field.default
    return flag.help if default is None else f"{flag.help} (default: {default})"


def define_engine_flags(fv: flags.FlagValues) -> None:
    """The --model flag and one flag per EngineConfig setting (config.setting), with vLLM's names
    as aliases; each defaults to None, which keeps the EngineConfig default (named in the help)."""
    flags.DEFINE_string("model", DEFAULT_MODEL, "a converted model directory, a .gguf file, a Hugging Face "
                        "folder, a Hugging Face id 'org/name' in the local Hugging Face cache ($HF_HOME; never "
                        f"downloaded), or '{DEFAULT_MODEL}' (SmolLM2-135M-Instruct, fetched and converted on first "
                        "use)", flag_values=fv)
    for field, kind, flag in _flag_fields():
        bounds = {key: value for key, value in (("lower_bound", flag.minimum), ("upper_bound", flag.maximum))
                  if value is not None}
        if flag.repeated:
            flags.DEFINE_multi_string(field.name, None, _help(field, flag), flag_values=fv)
        elif flag.choices is not None:
            flags.DEFINE_enum(field.name, None, list(flag.choices), _help(field, flag), flag_values=fv)
        else:
            _DEFINE[kind](field.name, None, _help(field, flag), flag_values=fv, **bounds)
        if flag.vllm_name:  # a vLLM command line ports by changing dashes
            flags.DEFINE_alias(flag.vllm_name, field.name, flag_values=fv)


def settings_problem(fv: flags.FlagValues) -> str | None:
    """What is wrong with the engine flags together (EngineConfig.check: a bucket list, settings
    that do not combine), naming the flags; None when they can work or `fv` has no engine flags."""
    if not all(name in fv for name in ENGINE_FLAGS):
        return None
    try:
        engine_config(fv)
    except SettingError as e:
        return str(e)
    return None


def engine_kwargs(fv: flags.FlagValues) -> dict:
    """The engine flags the user set; the others keep the EngineConfig defaults."""
    return {name: fv[name].value for name in ENGINE_FLAGS if fv[name].value is not None}


# A batch job (`generate`, `bench throughput` and `bench latency`) decodes up to 64 sequences at
# once on the CPU, where a server's default is 32 (its streams' TPOT): SmolLM2's decode step costs
# 1.25x less per token at 64 rows than at 32, and only 1.07x less again at 128 (bench/RESULTS.md,
# "Offline throughput: jaxserve generate vs transformers").
CPU_BATCH_MAX_NUM_SEQS = 64


def batch_defaults(fv: flags.FlagValues) -> dict:
    """A batch job's own engine default on the CPU where the user set none: --max_num_seqs
    CPU_BATCH_MAX_NUM_SEQS (within --max_num_batched_tokens), its figure being throughput, not a
    stream's TPOT; none with explicit --decode_buckets (their largest is --max_num_seqs). Loads
    jax: call it once the flags are read (and, in a multi-host job, not at all)."""
    from jaxserve.executor import device_setup  # loads jax: only once the flags are read (`plan` starts without it)

    kwargs = engine_kwargs(fv)
    if "max_num_seqs" in kwargs or "decode_buckets" in kwargs or device_setup.on_gpu():
        return {}
    budget = kwargs.get("max_num_batched_tokens", EngineConfig().max_num_batched_tokens)
    return {"max_num_seqs": min(CPU_BATCH_MAX_NUM_SEQS, budget)}


def engine_config(fv: flags.FlagValues, **overrides) -> EngineConfig:
    """The EngineConfig the engine flags describe (with `overrides`, e.g. warmup=False)."""
    return dataclasses.replace(EngineConfig(**engine_kwargs(fv)), **overrides)


# generate's sampling flags: SamplingParams' fields, with its defaults except where generate's differ
# (said in the help: why).
_SAMPLING_HELP = {
    "max_tokens": "most tokens generated per prompt",
    "temperature": "sampling temperature; 0 = greedy",
    "top_p": "nucleus sampling mass",
    "top_k": "sample among the k most likely tokens (0 = off)",
    "min_p": "drop tokens below min_p x the top probability",
    "repetition_penalty": "penalty on tokens already in prompt or output",
    "presence_penalty": "subtracted once from tokens already generated",
    "frequency_penalty": "subtracted per occurrence in the output",
    "seed": "sampling seed (per request: same seed, same output)",
    "stop": "stop string (repeatable); not included in the text",
    "ignore_eos": "keep generating past the end-of-sequence token",
}
_GENERATE_DEFAULTS = {  # name: (generate's default, why it is not SamplingParams', the API's)
    "max_tokens": (128, "a batch's completions are rarely that short"),
    "temperature": (0.0, "greedy, so that a batch run again gives the same output"),
}


def define_sampling_flags(fv: flags.FlagValues) -> None:
    """One flag per SamplingParams field of _SAMPLING_HELP, of the field's type and default (except
    _GENERATE_DEFAULTS'), each checked as it is parsed by check_sampling_params: exit 2 naming it."""
    hints = typing.get_type_hints(SamplingParams)
    fields = {field.name: field for field in dataclasses.fields(SamplingParams)}
    for name, text in _SAMPLING_HELP.items():
        field = fields[name]
        default = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
        if name in _GENERATE_DEFAULTS:
            text = f"{text} (not the API's default of {default:g}: {_GENERATE_DEFAULTS[name][1]})"
            default = _GENERATE_DEFAULTS[name][0]
        kind = _without_none(hints[name])
        if typing.get_origin(kind) is list:  # stop: repeatable
            flags.DEFINE_multi_string(name, default, text, flag_values=fv)
        else:
            _DEFINE[kind](name, default, text, flag_values=fv)
        flags.register_validator(name, lambda value, name=name: _valid_sampling(name, value), flag_values=fv)


def _valid_sampling(name: str, value) -> bool:
    try:
        check_sampling_params(SamplingParams(**{name: value}))
    except ValueError as e:
        raise flags.ValidationError(str(e)) from None
    return True


def sampling_kwargs(fv: flags.FlagValues) -> dict:
    """The sampling flags as SamplingParams keyword arguments."""
    return {name: fv[name].value for name in _SAMPLING_HELP}


def define_distributed_flags(fv: flags.FlagValues) -> None:
    """The flags of a multi-host job (`serve` and `generate`; see jaxserve.parallel.multihost)."""
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
    options = multihost.resolve_join_options(fv.coordinator_address, fv.num_processes, fv.process_id,
                                             heartbeat_timeout_s=fv.heartbeat_timeout_s)
    if options is not None and options.num_processes:
        defaults = EngineConfig()
        from jaxserve.parallel import sharding  # imports jax: only for a multi-host job
        sharding.check_parallel_sizes(fv.tensor_parallel_size or defaults.tensor_parallel_size,
                                      fv.data_parallel_size or defaults.data_parallel_size, options.num_processes)
    return options


def enter_job(fv: flags.FlagValues, command: str, **follow_overrides):
    """How `command` starts in a multi-host job: (the job's JoinOptions, None for a single
    process; None to go on as process 0 or alone, else the exit code this process ends with:
    2 for settings that cannot work, 1 when it cannot join, a worker's after following process 0
    (`follow_front` with `follow_overrides`))."""
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
    # Every process of a job logs its role, its share of the weights and how the job ends.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src.xla_bridge", "jax._src.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        multihost.initialize(options)
    except Exception as e:  # the runtime raises XlaRuntimeError / ValueError / RuntimeError
        print(f"jaxserve {command}: cannot join the multi-host job: {e}", file=sys.stderr)
        return None
    import jax  # deferred, as below: single-process commands (and `plan`) start without jax here
    return jax.process_index()


def follow_front(fv: flags.FlagValues, command: str, **overrides) -> int:
    """A worker process (process_id > 0) of `command`: builds the same engine as process 0, then
    runs the steps process 0 sends until it says stop (0), or fails loudly: 2 when the engine
    cannot be built (process 0 fails the same way), 1 when process 0 is lost or a step fails."""
    import jax  # a worker process only
    from jaxserve.engine import Engine

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
        multihost_front.follow(engine)
    except Exception as e:  # process 0 lost (MultiHostError), or a step failed here (reported to process 0)
        text = str(e) if isinstance(e, multihost.MultiHostError) else f"a step failed: {type(e).__name__}: {e}"
        print(f"jaxserve {command}: process {pid}: {text}", file=sys.stderr)
        multihost.exit_now(1)
    multihost_front.leave()
    return 0


def run_front(engine, work, command: str, fv: flags.FlagValues) -> int:
    """Process 0 of a multi-host job: routes the engine's steps to every process, runs `work()`,
    then tells the others to stop. A failed job exits at once with 1, naming the failure."""


    try:
        front = multihost_front.Front(fv.step_timeout_s, fv.heartbeat_timeout_s)
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
