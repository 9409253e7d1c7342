"""Compiling the engine's GPU build on a machine without a GPU (XLA "deviceless" ahead-of-time).

`compile_for_gpu` builds the engine as `jaxserve serve` would on a named GPU (bfloat16, the Pallas
kernels, the GPU bucket set, the page pool the planner gives for that GPU's memory, tensor
parallelism over a topology of that many GPUs, quantized weights, a quantized KV cache), with
abstract weights (`jax.ShapeDtypeStruct`: no checkpoint needed), and compiles every step bucket
and sampler shape down to ptxas for the target. Each compiled step reports XLA's memory analysis
next to the planner's activation estimate, and the number of Pallas kernel calls in it (a silent
fallback to XLA attention shows as 0).

Targets are XLA `GpuTargetConfig` text protos shipped in `jaxserve/planning/gpu_targets/` (h100, h200,
a100). Needs the `gpu-compile` extra (jax's CUDA plugin and ptxas, not the CUDA runtime) and
`JAX_PLATFORMS=cpu` set before jax starts (the plugin cannot start without a GPU).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import glob
import importlib.util
import itertools
import os
import re
import shutil
import subprocess
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import topologies

from jaxserve import compat, environment
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.core import encoder_cache
from jaxserve.core.step import Bucket, BucketSet, geometric_buckets, prompt_logprob_rows_limit
from jaxserve.executor import device_setup, executables, prompt_logprobs, sampler, step_functions, vision_encoder
from jaxserve.executor.executable_cache import store_key
from jaxserve.models import llama, prompt_activations, quantization, vision, weights
from jaxserve.multimodal.inputs import GEMMA3_ARCHITECTURE
from jaxserve.parallel import sharding
from jaxserve.planning import memory
from jaxserve.planning.gpu_targets import target_config, target_device_kind, target_memory_budget_bytes
from pallas_kernels import dispatch
from pallas_kernels.compat import quiet_pallas_deprecations

INSTALL_HINT = "pip install -e '.[gpu-compile]' (jax's CUDA plugin and ptxas, about 1.2 GB)"
_ERROR_CHARS = 2000  # of XLA's message kept in a failed bucket's report


class GpuCompileUnavailable(RuntimeError):
    """This installation cannot compile for a GPU (the CUDA plugin or ptxas is missing)."""


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


def _missing() -> list[str]:
    missing = []
    if not any(_installed(f"jax_plugins.xla_cuda{v}") for v in (12, 13)):
        missing.append("jax's CUDA plugin")
    if ptxas_path() is None:
        missing.append("ptxas (nvidia-cuda-nvcc-cu12)")
    return missing


def is_available() -> bool:
    """Whether this installation can compile for a GPU (the gpu-compile extra is installed)."""
    return not _missing()


def check_available() -> None:
    """Raises GpuCompileUnavailable with the install command when the compile cannot run."""
    if not is_available():
        raise GpuCompileUnavailable(f"compiling for a GPU needs {' and '.join(_missing())}: {INSTALL_HINT}")


def gpu_mesh(target: str, tensor_parallel_size: int) -> jax.sharding.Mesh:
    """A (data=1, model=T) mesh over T abstract GPUs of the target."""
    check_available()
    topology = topologies.get_topology_desc(platform="cuda", target_config=target_config(target),
                                            topology=f"1x1x{tensor_parallel_size}")
    return topologies.make_mesh(topology, (1, tensor_parallel_size), sharding.AXES)


@dataclasses.dataclass
class CompiledShape:
    """One compiled program: a step bucket (or a sampler row count) and what XLA says of it."""
    bucket: dict[str, int]  # num_decode, num_prefill_tokens, pages_per_seq (sampler: num_rows, penalties, bias)
    ok: bool
    error: str | None = None  # XLA's message when not ok
    pallas_kernels: int = 0  # Pallas kernel calls in the compiled program
    temp_bytes: int = 0  # XLA's memory analysis, per device
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0  # outputs that reuse donated arguments (the KV cache)
    flops: float | None = None  # XLA's cost analysis (None where it gives none)
    planned_activation_bytes: int | None = None  # the planner's estimate for this shape
    compile_seconds: float = 0.0


def count_pallas_kernels(hlo_text: str) -> int:
    """Pallas GPU kernel calls (custom calls of the Triton or Mosaic GPU lowerings) in HLO text."""
    return sum(len(re.findall(rf'custom_call_target="{re.escape(target)}"', hlo_text))
               for target in compat.PALLAS_GPU_CUSTOM_CALL_TARGETS)


def _abstract(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


@contextlib.contextmanager
def _compiling():
    """The process-wide state a deviceless compile runs under, entered once by the thread that
    starts the compiles (not by each compiling thread: the warning filters are process-wide and
    `warnings.catch_warnings` entered by overlapping threads restores them out of order): the
    persistent compilation cache off (a deviceless GPU executable cannot be loaded back, and must
    not crowd the cache) and the Pallas lowering's deprecation warnings silenced."""
    with executables.persistent_cache_off(), quiet_pallas_deprecations():
        yield


def _lower_and_compile(jitted, args, mesh, compiler_options=None) -> tuple[Any, float]:
    """Lowers and compiles for the abstract GPU mesh, in the calling thread, under `_compiling()`
    entered by its caller; returns (the executable, seconds of this thread's lowering and compile).
    The abstract mesh is entered here: jax keeps it per thread."""
    start = time.perf_counter()
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        compiled = jitted.lower(*args).compile(compiler_options=compiler_options)
    return compiled, time.perf_counter() - start


def _compile(jitted, args, mesh, compiler_options=None) -> tuple[Any, float]:
    """Lowers and compiles for the abstract GPU mesh (one program, in the calling thread)."""
    with _compiling():
        return _lower_and_compile(jitted, args, mesh, compiler_options)


def _report(key: dict[str, int], jitted, args, mesh, planned: int | None, saved_as=None,
            store: executables.ExecutableStore | None = None) -> CompiledShape:
    """One shape compiled and its report (ok=False with XLA's message when it fails). Runs in a
    compiling thread under `_compiling()`; `compile_seconds` is that thread's wall time, which
    counts the waits for the GIL and the cores when other shapes compile beside it. With a
    `store`, the executable is saved there under `saved_as` (the warm-up's key of the shape)."""
    try:
        compiled, seconds = _lower_and_compile(jitted, args, mesh)
    except Exception as e:  # XLA's error is the report: a kernel over the shared-memory limit, ...
        return CompiledShape(key, ok=False, error=f"{type(e).__name__}: {e}"[:_ERROR_CHARS],
                             planned_activation_bytes=planned)
    if store is not None:
        store.save(saved_as, compiled)
    stats = compiled.memory_analysis()
    costs = compiled.cost_analysis()
    costs = costs[0] if isinstance(costs, (list, tuple)) and costs else costs
    return CompiledShape(
        key, ok=True, pallas_kernels=count_pallas_kernels(compiled.as_text()),
        temp_bytes=stats.temp_size_in_bytes, argument_bytes=stats.argument_size_in_bytes,
        output_bytes=stats.output_size_in_bytes, alias_bytes=stats.alias_size_in_bytes,
        flops=costs.get("flops") if isinstance(costs, dict) else None,
        planned_activation_bytes=planned, compile_seconds=round(seconds, 3))


def compile_for_gpu(model_config: ModelConfig, engine_config: EngineConfig, *, target: str,
                    which_buckets: str = "all", workers: int | None = None,
                    save_executables: str | None = None) -> dict[str, Any]:
    """Plans and compiles the engine of `engine_config` (its GPU defaults: bfloat16, the Pallas
    kernels) for `engine_config.tensor_parallel_size` GPUs of `target`.

    The config's weight format, KV cache dtype, page size, limits and max_logprobs are the
    build's; its memory_utilization sizes the pool unless it fixes num_pages. Returns {"plan":
    the memory plan, "compile": {target, jax_version, tensor_parallel_size, workers,
    wall_seconds, buckets, sampler}}, every byte count per device. `which_buckets`: "all" (what
    warm-up compiles) or "ends" (the smallest and largest of each kind). `workers`: shapes
    lowered and compiled at once, on that many threads (XLA compiles with the GIL released, as
    in the engine's warm-up); default os.cpu_count(), 1 compiles them one after another. The
    reports keep the order of the shapes whatever the workers; `wall_seconds` is the whole
    compile's. ValueError on a configuration the engine would refuse; GpuCompileUnavailable
    without the gpu-compile extra. A bucket that fails to compile is reported with ok=False and
    XLA's message, not raised.

    `save_executables`: a folder that gets every executable the engine's warm-up would compile
    (the prompt-logprob shapes too, compiled here for it), in the layout `serve --executables`
    loads on the target (jaxserve.executor.executables), described as the engine on that GPU
    describes itself: the same jax and source there, and the same limits and num_pages (the
    report's `executables` says which). Needs every bucket (`which_buckets="all"`).
    """
    workers = workers if workers is not None else (os.cpu_count() or 1)
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    if save_executables is not None:
        check_savable(engine_config, which_buckets)
    build, plan = _build(model_config, engine_config, target)
    chosen = build.buckets.all() if which_buckets == "all" else build.buckets.smallest_and_largest()
    step_jobs, sampler_jobs = _step_jobs(build, chosen), _sampler_jobs(build, chosen)
    encoder_jobs = _encoder_jobs(build)
    prompt_jobs, store = [], None
    if save_executables is not None:
        store = _store_for_target(build, target, save_executables)
        step_jobs = [job + (store_key("forward", bucket), store) for job, bucket in zip(step_jobs, chosen)]
        sampler_jobs = [job + (store_key("sample", (job[0]["num_rows"], job[0]["penalties"], job[0]["bias"])), store)
                        for job in sampler_jobs]
        prompt_jobs = _prompt_logprob_jobs(build, step_jobs, store)
    reports, wall_seconds = _compile_all(step_jobs + sampler_jobs + prompt_jobs + encoder_jobs, workers)
    encoders = reports[len(reports) - len(encoder_jobs):]
    reports = reports[:len(reports) - len(encoder_jobs)]
    steps, samplers = reports[:len(step_jobs)], reports[len(step_jobs):len(step_jobs) + len(sampler_jobs)]
    plan_dict = plan.to_dict()
    if build.num_pages != plan.num_pages:
        plan_dict["num_pages_compiled"] = build.num_pages
    report = {"target": target, "jax_version": jax.__version__, "tensor_parallel_size": build.tensor_parallel_size,
              "workers": workers, "wall_seconds": round(wall_seconds, 3),
              "buckets": [dataclasses.asdict(s) for s in steps],
              "sampler": [dataclasses.asdict(s) for s in samplers]}
    if encoders:  # a vision-language model's image encoder, one program per image shape
        report["encoder"] = [dataclasses.asdict(s) for s in encoders]
    if store is not None:
        report["prompt_logprobs"] = [dataclasses.asdict(s) for s in reports[len(step_jobs) + len(sampler_jobs):]]
        report["executables"] = {"directory": save_executables, "saved": store.saved, "shapes": len(reports),
                                 "num_pages": build.num_pages, "device_kind": target_device_kind(target),
                                 "jax_version": jax.__version__}
    return {"plan": plan_dict, "compile": report}


@dataclasses.dataclass(frozen=True)
class _Build:
    """The engine `serve` would build on the target, with abstract weights and KV cache."""
    cfg: EngineConfig  # with the GPU's defaults filled in
    model_config: ModelConfig  # the model asked for
    run_config: ModelConfig  # the model one replica's step runs (KV heads replicated past the TP size)
    mesh: jax.sharding.Mesh  # of abstract GPUs
    replicated: Any  # the mesh's replicated sharding
    params: Any  # abstract, in their shardings
    kv_cache: Any
    num_pages: int
    max_model_len: int
    buckets: BucketSet
    functions: step_functions.StepFunctions
    encoder: vision_encoder.VisionEncoder | None = None  # a vision-language model's, abstract params

    @property
    def tensor_parallel_size(self) -> int:
        return self.cfg.tensor_parallel_size


def _build(model_config: ModelConfig, engine_config: EngineConfig, target: str) -> tuple[_Build, memory.MemoryPlan]:
    """The engine of `engine_config` on `target` GPUs, abstract, and its memory plan there."""
    cfg = engine_config.for_platform(on_gpu=True)
    cfg = dataclasses.replace(cfg, attention_backend=dispatch.attention_backend(cfg.attention_backend))
    tensor_parallel_size = cfg.tensor_parallel_size
    sharding.check_tensor_parallel(
        sharding.with_expert_parallel(model_config, cfg.enable_expert_parallel, tensor_parallel_size),
        tensor_parallel_size)
    max_model_len = cfg.model_len(model_config)
    mesh = gpu_mesh(target, tensor_parallel_size)
    shardings = sharding.ModelShardings.create(model_config, mesh, expert_parallel=cfg.enable_expert_parallel)
    run_config = shardings.model_config
    float_dtype = jnp.dtype(cfg.dtype)
    params = jax.eval_shape(lambda: weights.random_params(run_config, float_dtype))
    if cfg.quantization:
        params = jax.eval_shape(lambda p: quantization.quantize_params(p, cfg.quantization, run_config), params)
    params = _abstract(params, sharding.quantized_checkpoint_shardings(shardings.params, params))
    plan = memory.plan_engine(model_config, dataclasses.replace(cfg, num_pages=None),
                              device_memory_bytes=target_memory_budget_bytes(target), on_gpu=True,
                              measured_weights_bytes=shardings.per_device_bytes(params))
    params = prompt_activations.mark(params, cfg.gpu_prompt_dtype)  # as ModelRunner
    encoder = None
    if model_config.multimodal_architecture:  # as ModelRunner: the tower, its pool beside the weights
        encoder = _abstract_encoder(model_config, cfg, float_dtype)
        params = {**params, "image_embeddings": jax.ShapeDtypeStruct(encoder.pool.shape, encoder.pool.dtype)}
    num_pages = cfg.num_pages or plan.num_pages
    kv_dtype = device_setup.kv_cache_dtype(cfg.kv_cache_dtype) or float_dtype
    device_setup.check_attention_operands(cfg.attention_backend, run_config, float_dtype, kv_dtype, cfg.page_size)
    kv_cache = jax.eval_shape(lambda: llama.init_kv_cache(run_config, llama.KVCacheSpec(num_pages, cfg.page_size),
                                                          kv_dtype))
    kv_cache = _abstract(kv_cache, jax.tree.map(lambda _: shardings.kv_cache, kv_cache))
    buckets = step_functions.bucket_set(cfg, cfg.attention_backend, max_model_len)
    # As ModelRunner: without tensor parallelism (one replica) the step runs unsharded.
    functions = step_functions.build(
        run_config, params, backend=cfg.attention_backend, page_size=cfg.page_size, max_logprobs=cfg.max_logprobs,
        prefill_hidden_rows=max(buckets.prefill), verify_row_tokens=buckets.verify_row_tokens,
        shardings=shardings if tensor_parallel_size > 1 else None)
    return _Build(cfg, model_config, run_config, mesh, shardings.replicated, params, kv_cache, num_pages,
                  max_model_len, buckets, functions, encoder), plan


def _abstract_encoder(model_config: ModelConfig, cfg: EngineConfig, dtype) -> vision_encoder.VisionEncoder:
    """The runner's VisionEncoder of a vision-language model, over abstract tower params in `dtype`."""
    module, vision_config = vision.tower(model_config)
    decls = module.weight_decls(vision_config)
    params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dtype), vision.param_shapes(decls),
                          is_leaf=lambda leaf: isinstance(leaf, tuple))
    return vision_encoder.VisionEncoder(module, vision_config, params, hidden_size=model_config.hidden_size,
                                        num_rows=encoder_cache.pool_rows(cfg), dtype=dtype,
                                        max_image_tokens=encoder_cache.max_image_tokens(cfg))


def _encoder_jobs(build: _Build) -> list[tuple]:
    """The image encoder's shapes (none for a text model), as the warm-up compiles them."""
    encoder = build.encoder
    if encoder is None:
        return []
    return [({"encoder": size}, encoder.jitted, (encoder.params, jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=build.replicated), encoder.example(size))),
        build.mesh, None) for size in encoder.shapes()]


def _step_jobs(build: _Build, chosen: list[Bucket]) -> list[tuple]:
    """(key, jitted, args, mesh, planned), the arguments of one _report, for each step bucket."""
    jobs = []
    for bucket in chosen:
        arrays = build.buckets.empty_batch(bucket)
        if build.encoder is not None:  # the image inputs of the batch, as ModelRunner.empty_batch
            vision_encoder.add_image_arrays(arrays, bucket, mrope=build.model_config.mrope_section is not None,
                                            bidirectional=build.model_config.multimodal_architecture == GEMMA3_ARCHITECTURE)
        batch = {name: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=build.replicated) for name, a in arrays.items()}
        planned = step_activation_bytes(build.model_config, bucket, build.buckets, build.cfg)
        jobs.append((dataclasses.asdict(bucket), build.functions.forward_for(bucket),
                     (build.params, build.kv_cache, batch), build.mesh, planned))
    return jobs


def _sampler_jobs(build: _Build, chosen: list[Bucket]) -> list[tuple]:
    """The sampler shapes of those buckets' logit rows, in the variants the engine warms up."""
    model, jobs = build.model_config, []
    for num_rows in sorted({len(build.buckets.empty_batch(b)["logits_indices"]) for b in chosen}):
        logits = jax.ShapeDtypeStruct((num_rows, model.vocab_size), jnp.float32, sharding=build.replicated)
        for penalties, bias in itertools.product((False, True), (sampler.ALWAYS_BIAS,)):
            inputs = {name: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=build.replicated) for name, a in
                      sampler.build_sampling_inputs([None] * num_rows, num_rows, build.max_model_len, penalties,
                                                    bias, model.eos_token_ids, vocab_size=model.vocab_size).items()}
            jobs.append(({"num_rows": num_rows, "penalties": penalties, "bias": bias}, build.functions.sample,
                         (logits, inputs), build.mesh, None))
    return jobs


def _store_for_target(build: _Build, target: str, directory: str) -> executables.ExecutableStore:
    """The folder the executables are saved in, described as the runner of this engine on the
    target describes itself (ModelRunner._open_executable_store)."""
    cfg, tensor_parallel_size = build.cfg, build.tensor_parallel_size
    description = executables.engine_description(
        model_config=build.model_config if tensor_parallel_size == 1 else build.run_config,
        backend=cfg.attention_backend, buckets=build.buckets,
        prompt_logprob_buckets=geometric_buckets(8, prompt_logprob_rows_limit(cfg)), page_size=cfg.page_size,
        num_pages=build.num_pages, max_model_len=build.max_model_len, max_logprobs=cfg.max_logprobs,
        eos_token_ids=tuple(sorted(build.model_config.eos_token_ids)), num_scheduler_steps=cfg.num_scheduler_steps,
        cpu_int8_activations=cfg.cpu_int8_activations, mesh=None if tensor_parallel_size == 1 else build.mesh,
        params=build.params, kv_cache=build.kv_cache)
    return executables.ExecutableStore(directory, description, mode="save",
                                       target=("gpu", tensor_parallel_size, target_device_kind(target)))


def check_savable(engine_config: EngineConfig, which_buckets: str) -> None:
    """ValueError when `compile_for_gpu` cannot save every executable that engine's warm-up wants."""
    if which_buckets != "all":
        raise ValueError("saving executables needs every bucket (--buckets=all): the engine loads them all")
    if engine_config.num_scheduler_steps > 1:
        raise ValueError("saving executables for a GPU covers one decode step per call: "
                         "--num_scheduler_steps > 1 compiles its multi-step shapes on the GPU (drop --save_executables)")
    if engine_config.data_parallel_size > 1:
        raise ValueError("saving executables for a GPU covers one replica: --data_parallel_size must be 1")


def _prompt_logprob_jobs(build: _Build, step_jobs: list[tuple], store) -> list[tuple]:
    """The warm-up's prompt-logprob shapes as `_report` jobs: the head over the prefill rows the
    forward returns (their shape read off one prefill step, as the warm-up reads it)."""
    forward, args = next((job[1], job[2]) for job in step_jobs if job[0]["num_prefill_tokens"])
    with jax.sharding.use_abstract_mesh(build.mesh.abstract_mesh):
        hidden = jax.eval_shape(forward, *args)[2]
    hidden = jax.ShapeDtypeStruct(hidden.shape, hidden.dtype, sharding=build.replicated)
    head = prompt_logprobs.head_params(build.params)
    jobs = []
    for num_rows in geometric_buckets(8, prompt_logprob_rows_limit(build.cfg)):
        rows = jax.ShapeDtypeStruct((num_rows,), jnp.int32, sharding=build.replicated)
        jobs.append(({"num_rows": num_rows}, build.functions.prompt_logprobs, (head, hidden, rows, rows), build.mesh,
                     None, store_key("prompt_logprobs", num_rows), store))
    return jobs


def _compile_all(jobs: list[tuple], workers: int) -> tuple[list[CompiledShape], float]:
    """`_report` of each job (its arguments), on `workers` threads, in the jobs' order; and the
    wall seconds of the whole. As the warm-up (jaxserve/executor/warmup.py): a thread per core,
    XLA compiles outside the GIL."""
    start = time.perf_counter()
    with _compiling():
        if workers == 1:
            reports = [_report(*job) for job in jobs]
        else:
            with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gpu-compile") as pool:
                reports = list(pool.map(lambda job: _report(*job), jobs))  # in submission order
    return reports, time.perf_counter() - start


def step_activation_bytes(model_config: ModelConfig, bucket: Bucket, buckets: BucketSet, cfg: EngineConfig) -> int:
    """The planner's activation estimate for one step bucket of the GPU build of `cfg` (its GPU defaults filled in)."""
    return memory.activation_bytes(
        memory.parallel_model(model_config, cfg), compute_dtype=cfg.dtype, weight_dtype=cfg.quantization or cfg.dtype,
        max_num_batched_tokens=bucket.num_prefill_tokens, max_num_seqs=bucket.num_decode,
        max_context_len=bucket.pages_per_seq * cfg.page_size, tensor_parallel_size=cfg.tensor_parallel_size,
        max_prefill_seqs=buckets.max_num_prefill_seqs if bucket.num_prefill_tokens else 0,
        kv_dtype=cfg.kv_cache_dtype, backend=memory.estimated_backend(cfg))


# ---- the kernels on the real compiler ------------------------------------------------------------
KERNEL_NAMES = ("paged_decode_attention", "ragged_paged_attention", "grouped_matmul", "lora_bgmv",  # Triton lowering
                "paged_decode_attention_mosaic", "ragged_paged_attention_mosaic", "lora_bgmv_mosaic")  # Mosaic GPU
_THUNK_LINE = re.compile(r"kCustomKernel .*?\] (\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+"
                         r"shared_memory: (\d+) bytes")


@dataclasses.dataclass
class KernelReport:
    """One Pallas kernel as compiled for the target: ptxas's resource use and XLA's launch."""
    name: str
    gpu: str  # ptxas --gpu-name, e.g. sm_90a
    registers: int | None  # per thread (None: XLA's dump held no PTX for it, as on jax 0.12)
    spill_store_bytes: int | None
    spill_load_bytes: int | None
    shared_memory_bytes: int  # dynamic shared memory of the launch
    threads: int  # per block
    grid: list[int] | None  # None for a Mosaic GPU kernel (its dump does not give the launch grid)


# Where the nvidia-cuda-nvcc wheels put ptxas: CUDA 12's nvidia/cuda_nvcc/bin, CUDA 13's nvidia/cu13/bin.
PTXAS_PACKAGES = ("nvidia.cuda_nvcc", "nvidia.cu13")


def ptxas_path() -> str | None:
    """The ptxas of an nvidia-cuda-nvcc wheel, else the one on PATH (a CUDA toolkit), else None."""
    for package in PTXAS_PACKAGES:
        if _installed(package):
            path = os.path.join(list(importlib.util.find_spec(package).submodule_search_locations)[0], "bin", "ptxas")
            if os.path.isfile(path):
                return path
    return shutil.which("ptxas")


def ptxas_gpu_name(target: str) -> str:
    """sm_90a for Hopper (its wgmma instructions), sm_80 for Ampere, from the target's capability."""
    text = target_config(target)
    major = int(re.search(r"major:\s*(\d+)", text).group(1))
    minor = int(re.search(r"minor:\s*(\d+)", text).group(1))
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def _ptxas_resources(report: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from ptxas -v's report of one kernel."""
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return int(re.search(r"Used (\d+) registers", report).group(1)), int(spills.group(1)), int(spills.group(2))


def _mosaic_kernel_reports(dump: str, gpu: str) -> list[KernelReport]:
    """The Mosaic GPU kernels of a compile, from the files environment.mosaic_gpu_dumps had it
    leave: ptxas's registers and spills, the dynamic shared memory Mosaic allocated, the threads of
    the PTX entry."""
    reports = []
    for path in sorted(glob.glob(os.path.join(dump, "*.ptxas"))):
        stem = path[:-len(".ptxas")]
        name = re.sub(r"_\d+$", "", os.path.basename(stem))
        if name not in KERNEL_NAMES:
            continue
        with open(path) as f:
            registers, spill_stores, spill_loads = _ptxas_resources(f.read())
        with open(f"{stem}.resources.txt") as f:
            shared = int(re.search(r"smem_scratch_bytes=(\d+)", f.read()).group(1))
        with open(f"{stem}.ptx") as f:
            threads = int(re.search(r"\.(?:maxntid|reqntid) (\d+)", f.read()).group(1))
        reports.append(KernelReport(name, gpu, registers, spill_stores, spill_loads, shared, threads, None))
    return reports


def kernel_reports(jitted, args, mesh, target: str) -> list[KernelReport]:
    """Compiles `jitted` for the target with XLA's and Mosaic GPU's dumps on, then reads each
    Pallas kernel in it: for the Triton lowering, ptxas -v on its PTX (registers, spills) and
    XLA's thunk sequence (shared memory, launch shape; jax 0.12's XLA dumps no PTX: registers and
    spills are None there); for Mosaic GPU, the ptxas report, resources and PTX it wrote.
    Raises what the compile raises (e.g. shared memory exceeded)."""
    reports = []
    gpu = ptxas_gpu_name(target)
    with tempfile.TemporaryDirectory(prefix="jaxserve-ptx-") as dump, \
            tempfile.TemporaryDirectory(prefix="jaxserve-mosaic-") as mosaic_dump:
        with environment.mosaic_gpu_dumps(mosaic_dump):
            _compile(jitted, args, mesh, compiler_options={"xla_dump_to": dump})
        launches = {}
        for path in glob.glob(os.path.join(dump, "*thunk_sequence.txt")):
            with open(path) as f:
                for name, grid, threads, shared in _THUNK_LINE.findall(f.read()):
                    launches[name] = ([int(g) for g in grid.split(",")], int(threads.split(",")[0]), int(shared))
        ptxas = {}  # kernel name -> (registers, spill stores, spill loads)
        for path in sorted(glob.glob(os.path.join(dump, "*.ptx"))):
            with open(path) as f:
                entries = re.findall(r"\.entry (\w+)\(", f.read())
            for name in (e for e in entries if e in KERNEL_NAMES):
                out = subprocess.run([ptxas_path(), "-v", "--warn-on-spills", "--gpu-name", gpu, path, "-o", os.devnull],
                                     capture_output=True, text=True, check=True).stderr
                ptxas[name] = _ptxas_resources(out)
        for name, (grid, threads, shared) in sorted(launches.items()):
            if name in KERNEL_NAMES:
                reports.append(KernelReport(name, gpu, *ptxas.get(name, (None, None, None)), shared, threads, grid))
        reports += _mosaic_kernel_reports(mosaic_dump, gpu)
    return reports
