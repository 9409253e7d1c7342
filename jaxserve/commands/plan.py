"""`jaxserve plan`: the engine `jaxserve serve` (and `generate`) would build with the same flags,
sized for one device: weights, KV bytes per token, activations, the KV pages (the pool the engine
allocates) and the concurrency. With `--target=h100 --compile`, the GPU build compiled for that
GPU without one (jaxserve.planning.gpu_compile). With `--measure_buckets`, the step buckets worth
compiling on this machine, measured (jaxserve.planning.bucket_measure, jaxserve.core.bucket_choice)."""
from __future__ import annotations

import dataclasses
import json
import sys

from absl import flags

from checkpoints.load import open_model
from jaxserve.commands import engine_flags
from jaxserve.config import ConfigError, ModelConfig
from jaxserve.core import bucket_choice
from jaxserve.planning import memory, predict
from jaxserve.planning.gpu_targets import target_memory_budget_bytes
from jaxserve.settings import format_bucket_sizes


def define_flags(fv: flags.FlagValues) -> None:
    engine_flags.define_engine_flags(fv)
    flags.DEFINE_string("config", None, "Hugging Face config.json of the model, instead of --model.",
                        flag_values=fv)
    flags.DEFINE_float("device_memory_gb", None, "Memory of one device in GiB (2**30 bytes); default: the "
                       "--target's, else read from the first jax device as the engine does (on CPU: half the "
                       "available RAM).", flag_values=fv)
    flags.DEFINE_enum("format", None, ["json", "table"], "Output format; default: a table on a terminal, "
                      "else JSON.", flag_values=fv)
    flags.DEFINE_enum("target", None, ["a100", "h100", "h200"], "Plan for this GPU (its memory and the GPU "
                      "defaults: bfloat16, Pallas kernels) instead of the local device; with --compile, compile "
                      "the GPU build for it.", flag_values=fv)
    flags.DEFINE_boolean("compile", False, "With --target: build the engine as `serve` would on that GPU "
                         "(bfloat16, Pallas kernels, the GPU buckets, --tensor_parallel_size GPUs) with abstract "
                         "weights and compile every step bucket and sampler shape; needs the gpu-compile extra.",
                         flag_values=fv)
    flags.DEFINE_boolean("predict", False, "Also predict decode TPOT, TTFT and the most decode throughput "
                         "(a roofline over the device's ceilings: --target's preset, else --memory_bandwidth_gbps / "
                         "--peak_tflops, else a few-second probe of this CPU; docs/predict.md).", flag_values=fv)
    flags.DEFINE_list("predict_batch_sizes", ["1", "8", "32"], "With --predict: decode batch sizes.", flag_values=fv)
    flags.DEFINE_integer("predict_context_len", 512, "With --predict: tokens of context of every decoding "
                         "sequence.", flag_values=fv)
    flags.DEFINE_integer("predict_prompt_len", 512, "With --predict: prompt tokens of the TTFT prediction.",
                         flag_values=fv)
    flags.DEFINE_enum("buckets", "all", ["all", "ends"], "With --compile: every bucket warm-up compiles, or "
                      "the smallest and largest of each kind.", flag_values=fv)
    flags.DEFINE_integer("compile_workers", None, "With --compile: shapes lowered and compiled at once, on that "
                         "many threads (XLA compiles outside the GIL); default: the machine's cores; 1 compiles "
                         "them one after another.", lower_bound=1, flag_values=fv)
    flags.DEFINE_boolean("measure_buckets", False, "Build the engine of --model and the engine flags on this "
                         "machine, time a step in each of its decode and prefill buckets (median of "
                         "--measure_repeats) and print the --decode_buckets / --prefill_buckets worth compiling: a "
                         "bucket whose steps cost at most --measure_tolerance more in the next larger bucket kept is "
                         "dropped (jaxserve.core.bucket_choice).", flag_values=fv)
    flags.DEFINE_float("measure_tolerance", bucket_choice.DEFAULT_TOLERANCE, "With --measure_buckets: the fraction "
                       "of extra step time a step may pay in a larger bucket before its own bucket is kept.",
                       lower_bound=0.0, flag_values=fv)
    flags.DEFINE_integer("measure_context_len", 512, "With --measure_buckets: tokens of context of every decoding "
                         "row of the measured decode steps (at most the engine's max_model_len).", lower_bound=1,
                         flag_values=fv)
    flags.DEFINE_integer("measure_repeats", 5, "With --measure_buckets: timed steps of each bucket (after one "
                         "untimed), interleaved over the buckets; their median counts.", lower_bound=1,
                         flag_values=fv)


def _open_model(fv: flags.FlagValues):
    """(ModelConfig, the opened checkpoints.load.ModelSource or None with --config)."""
    if fv.config is not None:
        if fv["model"].present:
            raise ConfigError("give one of --config=config.json or --model=DIR|NAME, not both")
        return ModelConfig.from_json_file(fv.config), None
    source = open_model(fv.model)
    return source.config, source


def _device_memory_bytes(fv: flags.FlagValues) -> int:
    if fv.device_memory_gb is not None:
        if not fv.device_memory_gb > 0:
            raise memory.MemoryPlanError(f"--device_memory_gb must be positive, got {fv.device_memory_gb}")
        return int(fv.device_memory_gb * memory.GiB)
    if fv.target is not None:
        return target_memory_budget_bytes(fv.target)
    return memory.device_memory_budget_bytes()


def _measured_weights_bytes(source, cfg, on_gpu: bool = False) -> int | None:
    """The bytes one device holds of the weights, from the checkpoint's abstract arrays, where the
    planner's estimate from the config would miss some: weights held quantized (stored so, or
    --quantization), or the CPU step's copies of float ones (device_setup.cpu_step_layout_bytes,
    unless `on_gpu`: a float32 model's tied lm_head in the C++ kernel's strips, a bfloat16
    model's matrices). What the engine measures on the loaded ones; None otherwise."""
    if source is None:
        return None
    import jax  # loads jax: the command runs it after --help and the flags are done
    from jax.sharding import AbstractMesh
    from jaxserve.executor import device_setup
    from jaxserve.models import quantization
    from jaxserve.parallel import sharding
    params = source.abstract_params(cfg.dtype or cfg.for_platform(on_gpu).dtype)
    if cfg.quantization:
        params = jax.eval_shape(lambda p: quantization.quantize_params(p, cfg.quantization, source.config), params)
    if cfg.quantize_embedding:
        params = jax.eval_shape(quantization.quantize_embedding, params)
    layouts = device_setup.cpu_step_layout_bytes(params, cfg, on_gpu)
    shardings = None
    if cfg.tensor_parallel_size > 1:
        mesh = AbstractMesh((1, cfg.tensor_parallel_size), sharding.AXES)
        shardings = sharding.ModelShardings.create(source.config, mesh, expert_parallel=cfg.enable_expert_parallel)
    measured = device_setup.quantized_weights_bytes(params, shardings)
    if measured is None and not layouts:
        return None
    return (quantization.tree_bytes(params) if measured is None else measured) + layouts


def plan_for_flags(fv: flags.FlagValues, model: ModelConfig, source=None) -> memory.MemoryPlan:
    """memory.plan_engine for the engine the flags describe: on the --target GPU, else on this
    machine with its defaults, as the engine resolves them (jaxserve.executor.device_setup)."""
    cfg = engine_flags.engine_config(fv)
    if fv.target is not None:
        on_gpu = True
    else:
        from jaxserve.executor import device_setup  # loads jax: the command runs it after --help and the flags are done
        on_gpu = device_setup.on_gpu()
        cfg = device_setup.platform_config(cfg)
    cfg = cfg.for_platform(on_gpu)
    memory.kv_heads_per_device(memory.parallel_model(model, cfg), cfg.tensor_parallel_size)  # a bad split is named before anything is read
    draft = None
    if cfg.speculative_method == "draft":
        draft = open_model(cfg.speculative_model).config
    return memory.plan_engine(model, cfg, device_memory_bytes=_device_memory_bytes(fv), on_gpu=on_gpu,
                              measured_weights_bytes=_measured_weights_bytes(source, cfg, on_gpu), draft_model=draft)


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


def concurrency_line(plan: memory.MemoryPlan) -> str:
    """One line naming what limits how many sequences run at once: --max_num_seqs or the KV pool."""
    pool = plan.max_concurrent_seqs
    if plan.max_num_seqs <= pool:
        return (f"concurrency: at most {plan.max_num_seqs} sequences at once, set by --max_num_seqs; the KV pool "
                f"({plan.num_pages - 1:,} pages) holds {pool:,} sequences of the full --max_model_len "
                f"({plan.max_model_len:,} tokens), more with shorter ones")
    return (f"concurrency: {pool:,} sequences of the full --max_model_len ({plan.max_model_len:,} tokens) fit "
            f"in the KV pool ({plan.num_pages - 1:,} pages), fewer than --max_num_seqs {plan.max_num_seqs}: the "
            f"KV cache binds (shorter sequences fit more, up to {plan.max_num_seqs})")


def _output_format(fv: flags.FlagValues) -> str:
    return fv.format or ("table" if sys.stdout.isatty() else "json")


def run(fv: flags.FlagValues) -> int:
    """Prints the memory plan (and the compile report); returns 0, or 2 with a message on stderr
    on bad input or when a bucket fails to compile."""
    if fv.compile and fv.target is None:
        print("jaxserve plan: --compile needs --target (one of a100, h100, h200)", file=sys.stderr)
        return 2
    if fv.save_executables is not None and not fv.compile:
        print("jaxserve plan: --save_executables saves what --target=... --compile compiles (for this machine, "
              "`jaxserve serve --save_executables=DIR` saves them as it starts)", file=sys.stderr)
        return 2
    if fv.measure_buckets and (fv.target is not None or fv.config is not None):
        print("jaxserve plan: --measure_buckets times steps on this machine: it takes --model, not --target or "
              "--config", file=sys.stderr)
        return 2
    try:
        model, source = _open_model(fv)
        if fv.measure_buckets:
            return _measure_buckets(fv, model)
        if fv.compile:
            return _compile(fv, model)
        plan = plan_for_flags(fv, model, source)
        prediction = predict_for_flags(fv, model, plan) if fv.predict else None
    except (ValueError, OSError) as e:  # ConfigError, ConversionError and MemoryPlanError are ValueErrors
        print(f"jaxserve plan: {e}", file=sys.stderr)
        return 2
    if _output_format(fv) == "table":
        print(format_table(plan))
        print(concurrency_line(plan))
        if prediction is not None:
            print(predict.format_table(prediction))
    else:  # stdout stays one JSON document
        document = plan.to_dict() if prediction is None else {**plan.to_dict(), "predict": prediction}
        print(json.dumps(document, indent=2))
        print(concurrency_line(plan), file=sys.stderr)
    return 0


def _batch_sizes(fv: flags.FlagValues) -> list[int]:
    try:
        sizes = [int(size) for size in fv.predict_batch_sizes]
    except ValueError:
        raise predict.PredictError(f"--predict_batch_sizes must be positive integers, got "
                                   f"{','.join(fv.predict_batch_sizes)!r}") from None
    if not sizes or min(sizes) < 1:
        raise predict.PredictError(f"--predict_batch_sizes must be positive integers, got {sizes}")
    return sizes


def predict_for_flags(fv: flags.FlagValues, model: ModelConfig, plan: memory.MemoryPlan) -> dict:
    """predict.predict for the flags: ceilings of --target or the flags, else probed here."""
    sizes = _batch_sizes(fv)
    for name in ("predict_context_len", "predict_prompt_len"):
        if fv[name].value < 1:
            raise predict.PredictError(f"--{name} must be positive, got {fv[name].value}")
    cfg = engine_flags.engine_config(fv)

    def probe():
        from jaxserve.models import cpu_layout  # loads jax: only when no ceilings are given
        from jaxserve.planning import probe as probe_lib
        rows = [*sizes, predict.prefill_chunk(cfg)]  # the decode steps and the TTFT's prefill chunks
        prompt_dtype = cpu_layout.prompt_compute_dtype(plan.weight_dtype, cfg.cpu_int8_activations,
                                                       cfg.cpu_prompt_dtype)
        return probe_lib.probe(model, rows, fv.predict_context_len, cfg.page_size, prompt_dtype)

    ceilings = predict.resolve_ceilings(cfg, fv.target, probe)
    if cfg.tensor_parallel_size > 1 and ceilings.interconnect_bandwidth is None:
        raise predict.PredictError("--tensor_parallel_size > 1 without --target needs --interconnect_gbps")
    return predict.predict(model, plan, cfg, ceilings, batch_sizes=sizes, context_len=fv.predict_context_len,
                           prompt_len=fv.predict_prompt_len)


def _compile(fv: flags.FlagValues, model: ModelConfig) -> int:
    from jaxserve.planning import gpu_compile  # loads jax: the command runs it after --help and the flags are done
    cfg = engine_flags.engine_config(fv).for_platform(on_gpu=True)
    try:
        report = gpu_compile.compile_for_gpu(model, cfg, target=fv.target, which_buckets=fv.buckets,
                                             workers=fv.compile_workers, save_executables=cfg.save_executables)
    except gpu_compile.GpuCompileUnavailable as e:
        print(f"jaxserve plan: {e}", file=sys.stderr)
        return 2
    compiled = report["compile"]
    if _output_format(fv) == "table":
        print(format_compile_table(report))
    else:
        print(json.dumps({**report["plan"], "compile": compiled}, indent=2))
    failed = [b for b in compiled["buckets"] + compiled["sampler"] + compiled.get("prompt_logprobs", []) if not b["ok"]]
    if failed:
        print(f"jaxserve plan: {len(failed)} shape(s) failed to compile for {fv.target}; the first, "
              f"{failed[0]['bucket']}: {failed[0]['error']}", file=sys.stderr)
        return 2
    saved = compiled.get("executables")
    if saved is not None:
        if saved["saved"] != saved["shapes"]:
            print(f"jaxserve plan: saved {saved['saved']} of {saved['shapes']} executables in {saved['directory']} "
                  "(see the warnings above)", file=sys.stderr)
            return 2
        print(f"saved {saved['saved']} executables in {saved['directory']}: `jaxserve serve --executables="
              f"{saved['directory']} --num_pages={saved['num_pages']}` and the same engine flags load them on "
              f"a {saved['device_kind']} with jax {saved['jax_version']} and this source", file=sys.stderr)
    return 0


def format_compile_table(report: dict) -> str:
    """The plan, then one line per compiled shape: XLA's bytes next to the planner's."""
    mib = lambda n: "-" if n is None else f"{n / memory.MiB:,.1f}"
    compiled = report["compile"]
    lines = [f"{key}: {value}" for key, value in report["plan"].items()]
    lines.append(f"compiled for {compiled['target']} x {compiled['tensor_parallel_size']} with jax "
                 f"{compiled['jax_version']} (MiB per device), {len(compiled['buckets']) + len(compiled['sampler'])} "
                 f"shapes in {compiled['wall_seconds']:.1f} s on {compiled['workers']} thread(s)")
    lines.append(f"{'shape':<34} {'ok':<3} {'pallas':>6} {'temp':>9} {'planned':>9} {'args':>10} {'out':>9} "
                 f"{'compile s':>9}")
    for entry in compiled["buckets"] + compiled["sampler"]:
        shape = ",".join(f"{k}={v}" for k, v in entry["bucket"].items())
        lines.append(f"{shape:<34} {'yes' if entry['ok'] else 'NO':<3} {entry['pallas_kernels']:>6} "
                     f"{mib(entry['temp_bytes']):>9} {mib(entry['planned_activation_bytes']):>9} "
                     f"{mib(entry['argument_bytes']):>10} {mib(entry['output_bytes']):>9} "
                     f"{entry['compile_seconds']:>9}")
    return "\n".join(lines)


def _measure_buckets(fv: flags.FlagValues, model: ModelConfig) -> int:
    """`--measure_buckets`: the engine of the flags built here (warm-up off, a KV pool of the pages
    the measured steps write unless --num_pages), its candidate buckets timed
    (jaxserve.planning.bucket_measure), the buckets worth keeping chosen (bucket_choice) and
    printed, last as the engine flags that select them. ValueError on flags that cannot work."""
    from jaxserve.engine import Engine  # loads jax: the command runs it after --help and the flags are done
    from jaxserve.planning import bucket_measure
    cfg = engine_flags.engine_config(fv, warmup=False)
    if cfg.data_parallel_size > 1:
        raise ConfigError("--measure_buckets times one replica: give --data_parallel_size=1")
    max_model_len = cfg.model_len(model)
    if cfg.max_num_batched_tokens > max_model_len:
        raise ConfigError(f"--measure_buckets times a prefill step of --max_num_batched_tokens="
                          f"{cfg.max_num_batched_tokens} tokens of one sequence: more than max_model_len "
                          f"{max_model_len}")
    context_len = min(fv.measure_context_len, max_model_len)
    needed = bucket_measure.pages_needed(cfg.max_num_seqs, cfg.max_num_batched_tokens, context_len, cfg.page_size)
    if cfg.num_pages is not None and cfg.num_pages < needed:
        raise ConfigError(f"--measure_buckets needs --num_pages >= {needed} (--max_num_seqs rows of "
                          f"--measure_context_len={context_len} tokens), got {cfg.num_pages}")
    engine = Engine.from_model(fv.model, dataclasses.replace(cfg, num_pages=cfg.num_pages or needed))
    times = bucket_measure.measure(engine.runner, context_len, fv.measure_repeats)
    chosen = {kind: bucket_choice.choose_buckets(getattr(times, kind), fv.measure_tolerance)
              for kind in ("decode", "prefill")}
    flags_line = " ".join(f"--{kind}_buckets={format_bucket_sizes(sizes)}" for kind, sizes in chosen.items())
    rows = [dict(kind=kind, size=size, step_seconds=seconds, kept=size in chosen[kind],
                 padded_into=bucket_choice.padded_into(size, chosen[kind]))
            for kind in chosen for size, seconds in sorted(getattr(times, kind).items())]
    if _output_format(fv) == "table":
        print(format_measure_table(rows, times, fv))
        print(flags_line)
    else:
        print(json.dumps(dict(context_len=context_len, repeats=fv.measure_repeats, tolerance=fv.measure_tolerance,
                              buckets=rows, flags=flags_line), indent=2))
        print(flags_line, file=sys.stderr)
    return 0


def format_measure_table(rows: list[dict], times, fv: flags.FlagValues) -> str:
    """One line per candidate bucket: its step time, the next larger bucket kept and what a step
    of this size costs more there (what dropping it would cost: a dropped bucket's steps go there)."""
    seconds = {(row["kind"], row["size"]): row["step_seconds"] for row in rows}
    kept = {kind: [row["size"] for row in rows if row["kind"] == kind and row["kept"]] for kind in ("decode", "prefill")}
    lines = [f"step times on this machine (median of {fv.measure_repeats}; decode rows at {times.context_len} "
             f"tokens of context, prefill tokens of one sequence), tolerance {100 * fv.measure_tolerance:g}%",
             f"{'kind':<8} {'size':>6} {'step ms':>9}  {'next kept':>9} {'extra there':>11}  kept"]
    for row in rows:
        above = [k for k in kept[row["kind"]] if k > row["size"]]
        if above:
            extra = seconds[row["kind"], above[0]] / row["step_seconds"] - 1
            there = f"{above[0]:>9} {100 * extra:>+10.1f}%"
        else:
            there = f"{'-':>9} {'-':>11}"
        lines.append(f"{row['kind']:<8} {row['size']:>6} {1e3 * row['step_seconds']:>9.1f}  {there}  "
                     f"{'yes' if row['kept'] else 'no'}")
    return "\n".join(lines)
