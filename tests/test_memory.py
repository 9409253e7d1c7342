import dataclasses
import json
import pathlib
import subprocess
import sys

import pytest
from absl import flags

from jaxserve.commands import cli
from jaxserve.commands import engine_flags
from jaxserve.commands import plan as plan_command
from jaxserve.config import ModelConfig
from jaxserve.engine import EngineConfig
from jaxserve.models import weights
from jaxserve.planning import memory

LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
    "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
}
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
}
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
    "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True,
}


def model(cfg):
    return ModelConfig.from_hf_dict(cfg)


# The engine the planner tests size: a GPU server's scheduling budget, one prefill at a time.
PLANNED = EngineConfig(dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=2048, max_num_prefill_seqs=1)


def planned(**settings) -> EngineConfig:
    return dataclasses.replace(PLANNED, **settings)


@pytest.mark.parametrize("cfg, published", [
    (LLAMA2_7B, 6_738_415_616), (LLAMA3_8B, 8_030_261_248), (SMOLLM2_135M, 134_515_008)])
def test_param_counts_match_published_models(cfg, published):
    m = model(cfg)
    assert sum(memory.count_params(m).values()) == published == weights.num_params(m)
    for dtype, nbytes in (("bfloat16", 2), ("float16", 2), ("float32", 4)):
        assert memory.weights_bytes(m, dtype) == published * nbytes


def test_kv_bytes_per_token():
    assert memory.kv_bytes_per_token(model(LLAMA2_7B), "bfloat16") == 2 * 32 * 32 * 128 * 2 == 524288
    llama3 = model(LLAMA3_8B)
    assert memory.kv_bytes_per_token(llama3, "bfloat16") == 2 * 32 * 8 * 128 * 2
    assert memory.kv_bytes_per_token(llama3, "float32") == 2 * memory.kv_bytes_per_token(llama3, "bf16")
    assert memory.kv_bytes_per_token(llama3, "fp8") * 2 == memory.kv_bytes_per_token(llama3, "bfloat16")
    assert memory.kv_bytes_per_token(model(SMOLLM2_135M), "bfloat16") == 2 * 30 * 3 * 64 * 2


def test_quantized_weights_count_scales():
    m = model(LLAMA3_8B)
    d, f, q, kv = m.hidden_size, m.intermediate_size, m.q_size, m.kv_size
    counts = memory.count_params(m)
    rest_bf16 = 2 * (counts["embeddings"] + counts["norms"])
    # int8: one bf16 scale per output channel of every linear layer.
    out_channels = m.num_layers * (q + 2 * kv + 2 * f + 2 * d)
    assert memory.weights_bytes(m, "int8") == counts["linear"] + 2 * out_channels + rest_bf16
    # int4: half a byte per weight plus a float16 scale and zero point per 32 inputs.
    in_groups = m.num_layers * (d // 32 * (q + 2 * kv + 2 * f) + q // 32 * d + f // 32 * d)
    assert memory.weights_bytes(m, "int4") == counts["linear"] // 2 + 4 * in_groups + rest_bf16
    sizes = [memory.weights_bytes(m, dt) for dt in ("int4", "int8", "bfloat16", "float32")]
    assert sizes == sorted(sizes) and len(set(sizes)) == 4
    assert memory.resolve_kv_cache_dtype("auto", "int4") == "bfloat16"
    assert memory.resolve_kv_cache_dtype("auto", "float32") == "float32"


def test_tensor_parallel_halves_per_device_weights_and_pages():
    m = model(LLAMA2_7B)
    norms_bytes = 2 * memory.count_params(m)["norms"]
    one = memory.plan_memory(m, planned(max_model_len=4096), device_memory_bytes=40 * memory.GiB)
    two = memory.plan_memory(m, planned(max_model_len=4096, tensor_parallel_size=2),
                             device_memory_bytes=40 * memory.GiB)
    assert two.weights_bytes == (one.weights_bytes - norms_bytes) // 2 + norms_bytes
    assert two.kv_bytes_per_token * 2 == one.kv_bytes_per_token
    assert two.kv_bytes_per_page * 2 == one.kv_bytes_per_page
    assert two.num_pages > 2 * one.num_pages  # half the page size and more room left over
    assert two.num_params == one.num_params


def test_tensor_parallel_head_split_rules():
    llama3 = model(LLAMA3_8B)
    assert memory.kv_heads_per_device(llama3, 4) == 2
    assert memory.kv_heads_per_device(llama3, 16) == 1  # fewer KV heads than devices: replicated
    with pytest.raises(memory.MemoryPlanError, match="divisible"):
        memory.kv_heads_per_device(llama3, 3)
    with pytest.raises(memory.MemoryPlanError, match="must divide"):
        memory.kv_heads_per_device(model(dict(LLAMA3_8B, num_attention_heads=48, num_key_value_heads=8)), 12)
    with pytest.raises(memory.MemoryPlanError, match="divisible"):
        memory.plan_memory(model(SMOLLM2_135M), planned(tensor_parallel_size=2), device_memory_bytes=8 * memory.GiB)


def test_tensor_parallel_rules_are_shardings():
    """The planner refuses exactly the splits jaxserve.parallel.sharding refuses, with its message."""
    from jaxserve.parallel import sharding
    for cfg in (LLAMA3_8B, SMOLLM2_135M, dict(LLAMA3_8B, intermediate_size=14000)):
        m = model(cfg)
        for tp in range(1, 33):
            problem = sharding.tensor_parallel_problem(m, tp)
            if problem is None:
                assert memory.kv_heads_per_device(m, tp) >= 1
            else:
                with pytest.raises(memory.MemoryPlanError) as refused:
                    memory.kv_heads_per_device(m, tp)
                assert problem in str(refused.value)


def test_quantized_weight_dtypes_are_the_quantization_formats():
    from jaxserve.models import quantization
    m = model(LLAMA3_8B)
    assert memory.quant_format("int8_g32_zp") == quantization.parse_format("int8_g32_zp")
    assert memory.quant_format("bfloat16") is None
    assert memory.weights_bytes(m, "int4") == memory.weights_bytes(m, "int4_g32")
    sizes = [memory.weights_bytes(m, name) for name in ("int4_g128_sym", "int4_g64", "int4", "int8", "int8_g32_zp")]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
    with pytest.raises(memory.MemoryPlanError, match="int3"):
        memory.weights_bytes(m, "int3")


def test_kv_heads_replicated_when_fewer_than_devices():
    smol = dict(SMOLLM2_135M, num_attention_heads=12, num_key_value_heads=2, head_dim=48)
    assert memory.kv_heads_per_device(model(smol), 4) == 1
    assert memory.kv_heads_per_device(model(smol), 6) == 1


def test_num_pages_monotone_and_tight_in_the_budget():
    m = model(LLAMA3_8B)
    previous = None
    for gib in range(24, 144, 8):
        p = memory.plan_memory(m, planned(max_model_len=8192), device_memory_bytes=gib * memory.GiB)
        leftover = p.usable_bytes - p.weights_bytes - p.activation_bytes - p.runtime_reserve_bytes
        assert 0 <= leftover - p.kv_cache_bytes < p.kv_bytes_per_page
        assert p.kv_cache_bytes == p.num_pages * p.kv_bytes_per_page
        assert p.max_concurrent_seqs == (p.num_pages - 1) // p.pages_per_seq
        if previous is not None:
            assert p.num_pages > previous.num_pages
            assert p.max_concurrent_seqs >= previous.max_concurrent_seqs
        previous = p
    assert previous.pages_per_seq == 8192 // 16


def test_plan_of_a_known_setup():
    p = memory.plan_memory(model(LLAMA2_7B), planned(memory_utilization=0.9, page_size=16, max_model_len=4096,
                                                     max_num_batched_tokens=2048, max_num_seqs=256),
                           device_memory_bytes=80 * memory.GiB)
    assert p.weights_bytes == 6_738_415_616 * 2
    assert p.kv_bytes_per_page == 16 * 524288
    assert p.runtime_reserve_bytes == int(0.05 * p.usable_bytes)
    # 72 GiB usable: 12.6 GiB of weights, 2.3 GiB of activations, 3.6 GiB reserve, ~54 GiB of pages.
    assert 25 <= p.max_concurrent_seqs <= 30
    assert p.to_dict()["num_pages"] == p.num_pages


def test_activation_formula_terms():
    m = model(SMOLLM2_135M)
    t, s, c = 512, 64, 2048
    got = memory.activation_bytes(m, max_num_batched_tokens=t, max_num_seqs=s, max_context_len=c)
    residual = 2 * t * 576 * 2
    attention = (t * (9 + 6) * 64 * 2 + 2 * 9 * t * c * 4 + 2 * c * 3 * 64 * 4 + 2 * t * 9 * 64 * 4)
    mlp = 3 * t * 1536 * 2
    logits = 2 * s * 49152 * 4
    assert got == residual + max(attention, mlp, logits)
    # A long context makes the prefill scores dominate; many sequences make the logits dominate.
    grows_with_context = memory.activation_bytes(m, max_num_batched_tokens=t, max_num_seqs=s,
                                                 max_context_len=2 * c)
    grows_with_seqs = memory.activation_bytes(m, max_num_batched_tokens=t, max_num_seqs=8 * s,
                                              max_context_len=c)
    assert grows_with_context > got and grows_with_seqs > got


def test_mosaic_int8_pages_add_the_gathered_scales():
    """The Mosaic kernels over int8 pages gather each sequence's K and V scales into one float32
    [S + P, hkv, 2, C] array per call (measured: XLA's temp for the 8B decode kernel at 256 rows x
    8192 keys grows by exactly its 128 MiB); the Triton kernels and fp8 pages add nothing. Here the
    attention term dominates (a narrow MLP, long contexts), so the difference shows in the peak."""
    m = dataclasses.replace(model(LLAMA3_8B), intermediate_size=1024, vocab_size=1024)
    sizes = dict(max_num_batched_tokens=256, max_num_seqs=64, max_context_len=8192, max_prefill_seqs=2)
    pallas = memory.activation_bytes(m, backend="pallas", kv_dtype="int8", **sizes)
    assert memory.activation_bytes(m, backend="mosaic", kv_dtype="bfloat16", **sizes) == pallas
    assert memory.activation_bytes(m, backend="mosaic", kv_dtype="float8_e4m3fn", **sizes) == pallas
    assert memory.activation_bytes(m, backend="mosaic", kv_dtype="int8", **sizes) - pallas == (64 + 2) * 8 * 2 * 8192 * 4
    cfg = planned(attention_backend="mosaic", kv_cache_dtype="int8", dtype="bfloat16")
    assert memory.estimated_backend(cfg) == "mosaic"
    assert memory.estimated_backend(dataclasses.replace(cfg, attention_backend="xla")) == "reference"
    triton = memory.estimated_backend(dataclasses.replace(cfg, attention_backend="triton"))  # "pallas" by its other name
    assert memory.activation_bytes(m, backend=triton, kv_dtype="int8", **sizes) == pallas


def test_weights_do_not_fit():
    with pytest.raises(ValueError, match="weights do not fit"):
        memory.plan_memory(model(LLAMA2_7B), PLANNED, device_memory_bytes=12 * memory.GiB)
    with pytest.raises(memory.MemoryPlanError, match="weights do not fit"):
        memory.plan_memory(model(LLAMA3_8B), planned(dtype="float32", memory_utilization=0.3),
                           device_memory_bytes=80 * memory.GiB)


def test_no_room_for_one_sequence():
    # The weights fit (12.6 of 14.4 GiB usable), the 2.3 GiB of activations and the KV cache do not.
    with pytest.raises(memory.MemoryPlanError, match="no room for the KV cache"):
        memory.plan_memory(model(LLAMA2_7B), planned(max_model_len=4096), device_memory_bytes=16 * memory.GiB)


# (nonsense settings never reach the planner: EngineConfig refuses them, tests/test_settings.py)
@pytest.mark.parametrize("kwargs", [{"device_memory_bytes": -5}, {"quantization": "int3"}, {"dtype": None}])
def test_nonsense_input(kwargs):
    device_memory_bytes = kwargs.pop("device_memory_bytes", 8 * memory.GiB)
    with pytest.raises(memory.MemoryPlanError):
        memory.plan_memory(model(SMOLLM2_135M), planned(**kwargs), device_memory_bytes=device_memory_bytes)


def test_host_and_cpu_device_budgets():
    host = memory.host_memory_budget_bytes()
    with open("/proc/meminfo") as f:
        total_kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    assert 0 < host <= total_kib * 1024 // 2 + 1
    assert memory.host_memory_budget_bytes(0.25) <= host
    with pytest.raises(ValueError):
        memory.host_memory_budget_bytes(0)
    assert memory.device_memory_budget_bytes() > 0  # CPU device: falls back to the host budget


def test_memory_module_does_not_import_jax():
    code = "import sys, jaxserve.planning.memory, jaxserve.commands.plan; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=pathlib.Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "False"


def run_cli(argv, capsys):
    fv = flags.FlagValues()
    plan_command.define_flags(fv)
    fv(["jaxserve plan", *argv])
    rc = plan_command.run(fv)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.fixture
def llama_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    return str(path)


def test_cli_json(llama_config_file, capsys):
    rc, out, err = run_cli([f"--config={llama_config_file}", "--target=h100", "--device_memory_gb=80",
                            "--max_model_len=8192", "--max_num_seqs=128"], capsys)
    assert rc == 0, err
    result = json.loads(out)
    engine = EngineConfig(max_model_len=8192, max_num_seqs=128)  # every other setting: the engine's default
    expected = memory.plan_engine(model(LLAMA3_8B), engine, device_memory_bytes=80 * memory.GiB, on_gpu=True)
    assert result == expected.to_dict()
    assert expected == memory.plan_memory(
        model(LLAMA3_8B), dataclasses.replace(engine, dtype="bfloat16", attention_backend="pallas"),
        device_memory_bytes=80 * memory.GiB)
    for key in ("weights_bytes", "kv_bytes_per_token", "activation_bytes", "num_pages", "max_concurrent_seqs"):
        assert key in result
    assert result["weights_bytes"] == 8_030_261_248 * 2


def test_cli_table(llama_config_file, capsys):
    rc, out, err = run_cli([f"--config={llama_config_file}", "--device_memory_gb=80",
                            "--format=table", "--tensor_parallel_size=2", "--quantization=int8"], capsys)
    assert rc == 0, err
    rows = dict(line.split(None, 1) for line in out.strip().splitlines())
    assert rows["tensor_parallel_size"] == "2" and rows["weight_dtype"] == "int8"
    assert "GiB" in rows["weights_bytes"] and int(rows["num_pages"].replace(",", "")) > 0
    assert out.strip().splitlines()[-1].startswith("concurrency: ")


@pytest.mark.parametrize("max_num_seqs, binding", [(32, "set by --max_num_seqs"), (1024, "the KV cache binds")])
def test_the_binding_concurrency_limit_is_named(llama_config_file, capsys, max_num_seqs, binding):
    rc, out, err = run_cli([f"--config={llama_config_file}", "--device_memory_gb=80", "--max_model_len=1024",
                            f"--max_num_seqs={max_num_seqs}", "--max_num_batched_tokens=1024"], capsys)
    assert rc == 0, err
    plan = json.loads(out)  # stdout stays JSON when it is not a terminal; the line goes to stderr
    assert binding in err and f"{plan['max_concurrent_seqs']:,} sequences of the full --max_model_len" in err
    assert (plan["max_num_seqs"] <= plan["max_concurrent_seqs"]) == (max_num_seqs == 32)


@pytest.mark.parametrize("make_argv", [
    lambda d: [f"--config={d}/missing.json", "--device_memory_gb=80"],
    lambda d: [f"--config={d}/bad.json", "--device_memory_gb=80"],
    lambda d: [f"--config={d}/config.json", "--device_memory_gb=4"],  # weights do not fit
    lambda d: [f"--config={d}/config.json", "--device_memory_gb=-1"],
    lambda d: [f"--config={d}/config.json", "--device_memory_gb=80", "--page_size=0"],
    lambda d: [f"--config={d}/config.json", "--device_memory_gb=80", "--memory_utilization=2"],
    lambda d: [f"--config={d}/config.json", "--device_memory_gb=80", "--memory_utilization=0"],
    lambda d: [f"--config={d}/config.json", "--device_memory_gb=80", "--dtype=int8"],
    lambda d: [f"--config={d}/config.json", "--device_memory_gb=80", "--quantization=int3"],
    lambda d: [f"--config={d}/config.json", "--device_memory_gb=80", "--tensor_parallel_size=3"],
    lambda d: [f"--config={d}/config.json", f"--model={d}", "--device_memory_gb=80"],
    lambda d: [f"--model={d}/no_such_checkpoint", "--device_memory_gb=80"],
])
def test_cli_bad_input_exits_2(make_argv, llama_config_file, tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    rc = cli.main(["jaxserve", "plan", *make_argv(str(tmp_path))])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == "" and err.startswith("jaxserve plan: ") and "Traceback" not in err


def test_plan_and_serve_share_the_engine_flags():
    """One set of engine flags, with EngineConfig's defaults, for plan, serve and generate."""
    from jaxserve.commands import generate as generate_command
    from jaxserve.commands import serve as serve_command

    names = {}
    for command in (plan_command, serve_command, generate_command):
        fv = flags.FlagValues()
        command.define_flags(fv)
        fv(["jaxserve"])
        names[command.__name__] = {name for name in engine_flags.ENGINE_FLAGS if name in fv}
        assert engine_flags.engine_config(fv) == EngineConfig()
        assert fv.model == "smollm2"
    assert len({frozenset(v) for v in names.values()}) == 1
    assert "memory_utilization" in names["jaxserve.commands.plan"]


def test_serve_bounds_prefill_beside_decoding_on_the_cpu_unless_told():
    from jaxserve.commands import serve as serve_command
    from jaxserve.config import CPU_SERVE_LONG_PREFILL_TOKEN_THRESHOLD

    for argv, expected in ((["jaxserve"], CPU_SERVE_LONG_PREFILL_TOKEN_THRESHOLD),
                           (["jaxserve", "--long_prefill_token_threshold=512"], 512)):
        fv = flags.FlagValues()
        serve_command.define_flags(fv)
        fv(argv)
        assert serve_command.serve_engine_kwargs(fv)["long_prefill_token_threshold"] == expected
    assert EngineConfig().long_prefill_token_threshold is None  # generate and the library: no bound


def test_vllm_engine_flag_names_are_aliases():
    """`--gpu_memory_utilization` (vLLM's, and jaxserve's own before) and the others set the same setting."""
    from jaxserve.commands import serve as serve_command

    fv = flags.FlagValues()
    serve_command.define_flags(fv)
    fv(["jaxserve", "--gpu_memory_utilization=0.5", "--block_size=32", "--num_gpu_blocks_override=100"])
    config = engine_flags.engine_config(fv)
    assert (config.memory_utilization, config.page_size, config.num_pages) == (0.5, 32, 100)
    assert "gpu_memory_utilization" in fv.get_help()


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_the_pooling_runner_plans_no_decode_rows_and_no_logits(backend):
    model = ModelConfig.from_hf_dict(SMOLLM2_135M)
    shape = dict(max_num_batched_tokens=64, max_num_seqs=64, max_context_len=64, max_prefill_seqs=1,
                 backend=backend)  # the logits of 64 rows outweigh the step's other phases
    generating = memory.activation_bytes(model, **shape)
    pooling = memory.activation_bytes(model, **shape, pooling=True)
    no_logits = memory.activation_bytes(dataclasses.replace(model, vocab_size=1), **shape, pooling=True)
    assert pooling < generating and pooling == no_logits  # the vocabulary no longer counts
    assert pooling == memory.activation_bytes(dataclasses.replace(model, vocab_size=1),
                                              **{**shape, "max_num_seqs": 0})  # nor the decode rows
