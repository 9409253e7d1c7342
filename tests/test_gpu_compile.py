"""The GPU build compiled for Hopper on this CPU machine (XLA deviceless AOT, down to ptxas).

Needs the gpu-compile extra (`make test` installs it). The compile set is the smallest and largest
bucket of each kind; bench/gpu_compile.py sweeps every bucket of bigger models.
"""
import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve.commands import cli
from jaxserve.config import ModelConfig
from jaxserve.engine import EngineConfig
from jaxserve.planning import gpu_compile, gpu_targets, memory
from pallas_kernels import dispatch
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.paged_decode import paged_decode_attention
from pallas_kernels.ragged_prefill import ragged_paged_attention

pytestmark = [pytest.mark.slow, pytest.mark.skipif(  # compiles for a GPU: out of `make test-quick`
    not gpu_compile.is_available(), reason="the gpu-compile extra is not in this environment (`make test` runs "
    f"these tests in .venv-gpu-compile; or {gpu_compile.INSTALL_HINT})")]

SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_q_heads=9,
                      num_kv_heads=3, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True)
TINY_LLAMA3 = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_q_heads=8,
                          num_kv_heads=2, head_dim=64, max_position_embeddings=1024, rope_theta=500000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 256})


QWEN_VL = ModelConfig.from_hf_dict({"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
           "image_token_id": 1000, "video_token_id": 1001, "vision_start_token_id": 1002, "vision_end_token_id": 1003,
           "vision_config": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                             "out_hidden_size": 256, "fullatt_block_indexes": [1], "window_size": 112, "patch_size": 14,
                             "spatial_merge_size": 2, "temporal_patch_size": 2, "hidden_act": "silu"},
           "text_config": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
                           "max_position_embeddings": 1024, "rms_norm_eps": 1e-6,
                           "rope_parameters": {"rope_type": "default", "mrope_section": [16, 8, 8], "rope_theta": 1e6}}})
GEMMA3 = ModelConfig.from_hf_dict({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "mm_tokens_per_image": 16,
          "image_token_index": 1000, "boi_token_index": 1001, "eoi_token_index": 1002,
          "vision_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
                            "image_size": 224, "patch_size": 14, "hidden_act": "gelu_pytorch_tanh", "model_type": "siglip_vision_model"},
          "text_config": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 1024,
                          "query_pre_attn_scalar": 64, "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"],
                          "rope_theta": 1e6, "rope_local_base_freq": 1e4, "hidden_activation": "gelu_pytorch_tanh", "model_type": "gemma3_text"}})


def assert_compiled(report, num_step_shapes):
    steps, samplers = report["compile"]["buckets"], report["compile"]["sampler"]
    assert len(steps) == num_step_shapes
    for entry in steps + samplers:
        assert entry["ok"], entry
    for entry in steps:  # one kernel per attention part: a fallback to XLA attention shows as fewer
        parts = (entry["bucket"]["num_decode"] > 0) + (entry["bucket"]["num_prefill_tokens"] > 0)
        assert entry["pallas_kernels"] == parts, entry
        assert entry["argument_bytes"] > 0 and entry["output_bytes"] > 0
    return steps, samplers


def test_smollm2_compiles_for_h100_and_the_planner_bounds_xla():
    cfg = EngineConfig(max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=512, max_num_prefill_seqs=2)
    report = gpu_compile.compile_for_gpu(SMOLLM2, cfg, target="h100", which_buckets="ends")
    # decode {0,8,32} x prefill {0,32,512} at one table width (128 pages: the kernels walk only a
    # context's own pages), and one sampler per decode size (a decode step has its mixed step's rows)
    steps, samplers = assert_compiled(report, num_step_shapes=8)
    assert {entry["bucket"]["pages_per_seq"] for entry in steps} == {128}
    assert sorted({entry["bucket"]["num_rows"] for entry in samplers}) == [2, 10, 34]
    largest_temp = max(entry["temp_bytes"] for entry in steps + samplers)
    assert largest_temp <= report["plan"]["activation_bytes"] <= 1.5 * largest_temp
    assert report["compile"]["target"] == "h100" and report["compile"]["jax_version"] == jax.__version__
    assert report["plan"]["num_pages"] > 100_000  # ~55 GB of KV pages for a 135M model


@pytest.mark.parametrize("model", [QWEN_VL, GEMMA3], ids=["qwen2.5-vl", "gemma3"])
def test_vision_language_models_compile_with_their_encoder_and_image_inputs(model):
    """The step reads the image-embedding pool, M-RoPE positions (Qwen) or the key limits of
    bidirectional image spans (Gemma 3, into the same attention kernels); the encoder compiles
    per image shape; the plan counts the tower, the pool and the encoder's activations."""
    cfg = EngineConfig(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256, max_num_prefill_seqs=2)
    report = gpu_compile.compile_for_gpu(model, cfg, target="h100", which_buckets="ends")
    assert_compiled(report, num_step_shapes=5)  # decode {0, 8} x prefill {0, 32, 256}, not the empty step
    encoders = report["compile"]["encoder"]
    assert encoders and all(entry["ok"] for entry in encoders), encoders
    if model is QWEN_VL:  # 64, 128, ... patches up to an image of 256 - 8 + 1 tokens
        assert [entry["bucket"]["encoder"] for entry in encoders] == [64, 128, 256, 512, 996]
    else:  # SigLIP's one size
        assert [entry["bucket"]["encoder"] for entry in encoders] == [1]
    plan = report["plan"]
    assert plan["vision_weights_bytes"] > 0 and plan["image_pool_bytes"] == (2 * 256 + 1) * 256 * 2
    assert max(entry["temp_bytes"] for entry in encoders) <= plan["vision_activation_bytes"]


def test_tensor_parallel_int8_weights_and_fp8_kv_compile_with_the_sharded_kernels():
    cfg = EngineConfig(tensor_parallel_size=2, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
                       max_num_prefill_seqs=2, quantization="int8", kv_cache_dtype="fp8", num_pages=512)
    report = gpu_compile.compile_for_gpu(TINY_LLAMA3, cfg, target="h200", which_buckets="ends")
    assert_compiled(report, num_step_shapes=3)  # decode {0, 8} x prefill {0, 32} x pages {16}
    assert report["compile"]["tensor_parallel_size"] == 2 and report["plan"]["weight_dtype"] == "int8"


def _dot_operand_types(hlo_text: str) -> set[str]:
    """The element types of the operands of every dot in compiled HLO text (fusions included)."""
    types = {}
    for line in hlo_text.splitlines():
        found = re.match(r"\s*(?:ROOT )?%(\S+) = (\w+)\[", line)
        if found:
            types[found[1]] = found[2]
    dots = re.findall(r"= \w+\[[^\]]*\]\{?[^ ]*\s*dot\(%(\S+), %(\S+)\)", hlo_text)
    return {types.get(name.rstrip(","), "?") for pair in dots for name in pair}


def test_int8_activations_compile_to_int8_dots_for_hopper():
    """--gpu_prompt_dtype=int8 on --quantization=int8 weights: the prefill step's matmuls take int8
    operands (XLA's GEMM fusions on the 8-bit codes), the decode step's stay bfloat16 products of
    the dequantized weights."""
    cfg = EngineConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128, max_num_prefill_seqs=2,
                       quantization="int8", gpu_prompt_dtype="int8", num_pages=64)
    build, _ = gpu_compile._build(TINY_LLAMA3, cfg, "h100")
    buckets = [b for b in build.buckets.all() if b.num_decode in (0, 8) and b.num_prefill_tokens in (0, 128)]
    types = {}
    for key, jitted, args, mesh, _ in gpu_compile._step_jobs(build, buckets):
        compiled, _ = gpu_compile._compile(jitted, args, mesh)
        types[(key["num_decode"], key["num_prefill_tokens"])] = _dot_operand_types(compiled.as_text())
    assert "s8" in types[(0, 128)] and "s8" in types[(8, 128)], types
    assert "s8" not in types[(8, 0)], types


def test_fp8_activations_compile_to_fp8_dots_for_hopper():
    """The float8 product of --gpu_prompt_dtype=fp8 (e4m3 rows x e4m3 weights) stays a float8 dot."""
    from jaxserve.models import prompt_matmul
    mesh = gpu_compile.gpu_mesh("h100", 1)
    x, q, scale = _abstract(mesh, ((256, 512), jnp.bfloat16), ((512, 1024), jnp.float8_e4m3fn), ((1, 1024), jnp.float32))
    linear = jax.jit(lambda x, q, s: prompt_matmul.quantized_activations_linear(x, q, s, "fp8"))
    compiled, _ = gpu_compile._compile(linear, (x, q, scale), mesh)
    assert _dot_operand_types(compiled.as_text()) == {"f8e4m3fn"}


def _abstract(mesh, *shapes_and_dtypes):
    replicated = NamedSharding(mesh, P())
    return [jax.ShapeDtypeStruct(shape, dtype, sharding=replicated) for shape, dtype in shapes_and_dtypes]


KERNEL_SHAPES = {  # (query heads, KV heads, head_dim): Llama-3-8B and SmolLM2
    "llama3_8b": (32, 8, 128),
    "smollm2": (9, 3, 64),
}


@pytest.mark.parametrize("model", sorted(KERNEL_SHAPES))
def test_kernels_at_their_shipped_block_sizes_do_not_spill_on_sm90a(model):
    heads, kv_heads, head_dim = KERNEL_SHAPES[model]
    mesh = gpu_compile.gpu_mesh("h100", 1)
    pages = ((1024, 16, kv_heads, head_dim), jnp.bfloat16)
    decode = _abstract(mesh, ((64, heads, head_dim), jnp.bfloat16), pages, pages, ((64, 64), jnp.int32),
                       ((64,), jnp.int32))
    ragged = _abstract(mesh, ((512, heads, head_dim), jnp.bfloat16), pages, pages, ((4, 64), jnp.int32),
                       ((4,), jnp.int32), ((5,), jnp.int32))
    reports = (gpu_compile.kernel_reports(jax.jit(paged_decode_attention), decode, mesh, "h100")
               + gpu_compile.kernel_reports(jax.jit(ragged_paged_attention), ragged, mesh, "h100"))
    print(json.dumps([vars(r) for r in reports], indent=1))
    assert sorted(r.name for r in reports) == ["paged_decode_attention", "ragged_paged_attention"]
    for r in reports:
        assert r.gpu == "sm_90a" and r.threads > 0
        assert 0 < r.shared_memory_bytes <= 232448, r  # the H100's shared memory per block
    if jax.__version__.startswith("0.10."):  # later XLA dumps no PTX (README: what runs where)
        for r in reports:
            assert 0 < r.registers <= 255 and r.spill_store_bytes == r.spill_load_bytes == 0, r


GROUPED_MATMUL_SHAPES = {  # (rows = tokens x top-k, K, N, experts): the experts' gate/up and down matmuls
    "qwen3_30b_a3b_decode_gate": (64 * 8, 2048, 768, 128),
    "qwen3_30b_a3b_decode_down": (64 * 8, 768, 2048, 128),
    "mixtral_8x7b_prefill_gate": (512 * 2, 4096, 14336, 8),
    "mixtral_8x7b_prefill_down": (512 * 2, 14336, 4096, 8),
}


@pytest.mark.parametrize("shape", sorted(GROUPED_MATMUL_SHAPES))
def test_grouped_matmul_at_its_default_blocks_does_not_spill_on_sm90a(shape):
    rows, k, n, experts = GROUPED_MATMUL_SHAPES[shape]
    mesh = gpu_compile.gpu_mesh("h100", 1)
    args = _abstract(mesh, ((rows, k), jnp.bfloat16), ((experts, k, n), jnp.bfloat16), ((experts,), jnp.int32))
    reports = gpu_compile.kernel_reports(jax.jit(grouped_matmul), args, mesh, "h100")
    print(json.dumps([vars(r) for r in reports], indent=1))
    assert [r.name for r in reports] == ["grouped_matmul"]
    (report,) = reports
    assert report.gpu == "sm_90a" and report.threads == 128  # 4 warps
    assert 0 < report.shared_memory_bytes <= 232448, report
    assert report.grid[0] * report.grid[1] * report.grid[2] >= n // 128  # work items x column blocks
    if jax.__version__.startswith("0.10."):
        assert 0 < report.registers <= 255 and report.spill_store_bytes == report.spill_load_bytes == 0, report


def test_the_pallas_grouped_matmul_backend_puts_the_kernel_in_a_gpu_program():
    mesh = gpu_compile.gpu_mesh("h100", 1)
    args = _abstract(mesh, ((64, 256), jnp.bfloat16), ((8, 256, 512), jnp.bfloat16), ((8,), jnp.int32))
    kernels = {}
    for backend in ("xla", "pallas"):
        program = jax.jit(lambda *a, backend=backend: dispatch.grouped_matmul(*a, backend=backend))
        compiled, _ = gpu_compile._compile(program, args, mesh)
        kernels[backend] = gpu_compile.count_pallas_kernels(compiled.as_text())
    assert kernels == {"xla": 0, "pallas": 1}


def test_an_oversized_block_is_refused_by_the_compiler():
    """The check has teeth: 64 pages of 16 keys per block need 800 KiB of shared memory."""
    mesh = gpu_compile.gpu_mesh("h100", 1)
    pages = ((1024, 16, 8, 128), jnp.bfloat16)
    args = _abstract(mesh, ((64, 32, 128), jnp.bfloat16), pages, pages, ((64, 64), jnp.int32), ((64,), jnp.int32))
    oversized = jax.jit(lambda *a: paged_decode_attention(*a, pages_per_block=64))
    with gpu_compile._compiling():
        report = gpu_compile._report({"pages_per_block": 64}, oversized, args, mesh, None)
    assert not report.ok and "Shared memory size limit exceeded" in report.error and "232448" in report.error


def test_plan_compile_command_reports_json_and_a_failure_exits_2(tmp_path, capsys, monkeypatch):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024,
                                  "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                                  "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 512,
                                  "rms_norm_eps": 1e-5, "rope_theta": 10000.0}))
    args = ["jaxserve", "plan", f"--config={config}", "--target=h100", "--compile", "--buckets=ends",
            "--max_num_seqs=8", "--max_num_batched_tokens=32", "--max_model_len=256"]
    assert cli.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["compile"]["target"] == "h100" and all(b["ok"] for b in out["compile"]["buckets"])
    assert out["device_memory_bytes"] == gpu_targets.target_memory_budget_bytes("h100")
    real_report = gpu_compile._report

    def fail_prefill(key, *rest):
        if key.get("num_prefill_tokens") == 32:
            return gpu_compile.CompiledShape(key, ok=False, error="RESOURCE_EXHAUSTED: injected")
        return real_report(key, *rest)
    monkeypatch.setattr(gpu_compile, "_report", fail_prefill)
    assert cli.main(args) == 2
    assert "failed to compile for h100" in capsys.readouterr().err


def test_without_the_extra_the_command_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(gpu_compile, "is_available", lambda: False)
    assert cli.main(["jaxserve", "plan", "--model=smollm2", "--target=h100", "--compile"]) == 2
    assert "pip install -e '.[gpu-compile]'" in capsys.readouterr().err


def test_plan_for_a_target_uses_its_memory_and_the_gpu_activation_formula(capsys):
    assert cli.main(["jaxserve", "plan", "--model=smollm2", "--target=h200", "--max_model_len=2048"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["device_memory_bytes"] == int(0.75 * gpu_targets.target_memory_bytes("h200"))
    engine = EngineConfig()  # the flags' defaults: the engine's
    gpu = memory.activation_bytes(SMOLLM2, max_num_batched_tokens=engine.max_num_batched_tokens,
                                  max_num_seqs=engine.max_num_seqs, max_context_len=2048,
                                  max_prefill_seqs=engine.max_num_prefill_seqs, backend="pallas")
    assert plan["activation_bytes"] == gpu


def test_compiling_on_threads_gives_the_sequential_report_in_its_order():
    """Shapes compiled two at a time report what one at a time does: the same shapes in the same
    order, each with the same outcome, Pallas calls and XLA bytes."""
    cfg = EngineConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, max_num_prefill_seqs=2,
                       num_pages=256)  # steps: decode {0, 8} x prefill {0, 32}; samplers: rows {2, 10} x penalties
    reports = {workers: gpu_compile.compile_for_gpu(TINY_LLAMA3, cfg, target="h100", workers=workers)["compile"]
               for workers in (1, 2)}
    fields = ("bucket", "ok", "error", "pallas_kernels", "temp_bytes", "argument_bytes", "output_bytes",
              "alias_bytes", "planned_activation_bytes")
    shown = {workers: [tuple(entry[f] for f in fields) for entry in report["buckets"] + report["sampler"]]
             for workers, report in reports.items()}
    assert shown[2] == shown[1]
    assert len(reports[1]["buckets"]) == 3 and len(reports[1]["sampler"]) == 4  # more shapes than threads
    assert_compiled({"compile": reports[2]}, num_step_shapes=len(reports[1]["buckets"]))
    for workers, report in reports.items():
        assert report["workers"] == workers
        assert 0 < max(e["compile_seconds"] for e in report["buckets"] + report["sampler"]) <= report["wall_seconds"]


def test_saved_gpu_executables_are_what_the_engine_on_that_gpu_asks_for(tmp_path, monkeypatch):
    """`plan --target=h100 --compile --save_executables` writes a folder that the runner of the same
    engine on an H100 accepts: its description differs from a runner's here only in the machine
    (platform, devices; the CPU kernels' registration), and given that machine, every shape its
    warm-up loads (steps, samplers, prompt logprobs) is in the folder. Whether the executables then
    run on the GPU is what bench/gpu_check.sh tries on a lent one."""
    from jaxserve.executor import executables, runner as runner_module, warmup
    from jaxserve.models import weights
    folder = str(tmp_path / "h100")
    cfg = EngineConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, max_num_prefill_seqs=2,
                       num_pages=256)
    assert cli.main(["jaxserve", "plan", "--config=" + _config_file(tmp_path, TINY_LLAMA3), "--target=h100",
                     "--compile", "--max_model_len=256", "--max_num_seqs=8", "--max_num_batched_tokens=32",
                     "--max_num_prefill_seqs=2", "--num_pages=256", f"--save_executables={folder}",
                     "--format=json"]) == 0
    gpu_cfg = cfg.for_platform(on_gpu=True)
    params = weights.random_params(TINY_LLAMA3, jnp.bfloat16)
    # On a GPU the step reads the weights as they are (cpu_layout.layer_views changes them on the CPU only).
    monkeypatch.setattr(runner_module.cpu_layout, "layer_views", lambda p, **_: p)
    make_runner = lambda: runner_module.ModelRunner(
        TINY_LLAMA3, params, dataclasses.replace(gpu_cfg, executables=folder), num_pages=256, max_model_len=256)
    with pytest.raises(executables.ExecutablesMismatch) as refused:
        make_runner()
    differ = re.findall(r"(\w+): saved ", str(refused.value))
    assert set(differ) <= {"platform", "devices", "cpu_kernels"} and {"platform", "devices"} <= set(differ), refused.value
    assert "saved gpu, here cpu" in str(refused.value) and "1 x NVIDIA H100 80GB HBM3" in str(refused.value)

    here = executables.environment
    monkeypatch.setattr(executables, "environment", lambda target=None: here(target or ("gpu", 1, "NVIDIA H100 80GB HBM3")))
    runner = make_runner()  # the manifest matches: the runner of that GPU
    plan, keys = warmup.WarmupPlan(runner), []

    def asked_for(key):  # what each of the warm-up's shapes loads (not loaded: they are GPU programs)
        keys.append(key)
        raise LookupError(key)

    store = runner.executables.store
    monkeypatch.setattr(store, "load", asked_for)
    for job in (job for phase in plan.phases for job in phase):  # the prompt-logprob shapes among them, last
        with pytest.raises(LookupError):
            runner.executables.load_or_compile(job.kind, job.key, lambda: job.lower(job.key))
    assert len(keys) == len(set(keys)) == 3 + 2 * 2 + len(runner.prompt_logprob_buckets)
    assert not [key for key in keys if not os.path.exists(store._path(key))]
    assert len([name for name in os.listdir(folder) if name.endswith(".exe")]) == len(keys)


def test_saving_gpu_executables_refuses_what_it_cannot_save(tmp_path, capsys):
    config = _config_file(tmp_path, TINY_LLAMA3)
    base = ["jaxserve", "plan", f"--config={config}", "--max_model_len=256", "--max_num_seqs=8",
            "--max_num_batched_tokens=32", "--num_pages=256", f"--save_executables={tmp_path / 'out'}"]
    for extra, message in [([], "--target=... --compile"),
                           (["--target=h100", "--compile", "--buckets=ends"], "needs every bucket"),
                           (["--target=h100", "--compile", "--num_scheduler_steps=4"], "--num_scheduler_steps > 1")]:
        assert cli.main(base + extra) == 2, extra
        assert message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")


def _config_file(tmp_path, config: ModelConfig) -> str:
    """A Hugging Face config.json of `config` (what `plan --config` reads)."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_hf_dict()))
    return str(path)
