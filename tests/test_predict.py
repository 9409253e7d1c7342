"""The latency predictor (jaxserve.planning.predict): its arithmetic on a hand-computable model,
the bound it names, and `jaxserve plan --predict`."""
from __future__ import annotations

import dataclasses
import json

import pytest

from jaxserve.commands import cli
from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.planning import memory, predict
from tests.test_memory import run_cli  # `jaxserve plan` in process: (exit code, stdout, stderr)

# 2 layers, d=8, 2 query heads and 1 KV head of 4, MLP 16, vocabulary 32, tied embeddings.
TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 32,
        "tie_word_embeddings": True, "max_position_embeddings": 4096}
TINY_TP = {**TINY, "num_key_value_heads": 2, "intermediate_size": 32}
CEILINGS = predict.Ceilings(memory_bandwidth=1e3, peak_flops=1e3, interconnect_bandwidth=None, source="test")


def tiny(config=TINY) -> ModelConfig:
    return ModelConfig.from_hf_dict(config)


def cost_model(weight_dtype="float32", tp=1, config=TINY) -> predict.StepCostModel:
    compute = "float32" if weight_dtype == "float32" else "bfloat16"
    return predict.StepCostModel.create(tiny(config), weight_dtype=weight_dtype, compute_dtype=compute,
                                        kv_cache_dtype=compute, tensor_parallel_size=tp)


def test_the_constants_and_a_decode_step_by_hand():
    c = cost_model()
    linear = 2 * (8 * 8 + 8 * 4 + 8 * 4 + 8 * 8 + 3 * 8 * 16)  # q, k, v, o, gate, up, down: 1152
    assert c.weights_bytes == (linear + 32 * 8 + 5 * 8) * 4  # + embedding (tied) + 5 norms of 8: 5792
    assert c.kv_bytes_per_token == 2 * 2 * 1 * 4 * 4  # K and V, 2 layers, 1 head of 4, float32
    assert c.activation_bytes_per_token == 2 * (4 * 8 + (2 * 2 + 2 * 1) * 4 + 4 * 16) * 4 + 2 * 32 * 4  # 1216
    assert c.matmul_params == linear + 32 * 8
    assert c.attention_flops_per_pair == 4 * 2 * 2 * 4
    step = c.decode(batch=2, context=10)
    assert step.bytes == 5792 + 64 * (2 * 10 + 2) + 1216 * 2 == 9632
    assert step.flops == 2 * 1408 * 2 + 64 * 2 * 11 == 7040
    assert step.interconnect_bytes == 0 and step.collectives == 0
    # Prefill of 5 tokens in chunks of 3: positions 0-2 see 1+2+3 keys, positions 3-4 see 4+5.
    first, second = c.prefill(5, chunk=3)
    assert (first.flops, second.flops) == (2 * 1408 * 3 + 64 * 6, 2 * 1408 * 2 + 64 * 9)
    assert second.bytes == 5792 + 64 * (3 + 2) + 1216 * 2


def test_the_linear_layers_and_the_attention_add_each_under_its_own_ceiling():
    step = cost_model().decode(batch=2, context=10)
    assert (step.attention_bytes, step.attention_flops, step.rows) == (64 * 22, 64 * 2 * 11, 2)
    # Linear: 8224 bytes, 5632 FLOPs; attention: 1408 bytes, 1408 FLOPs.
    skewed = predict.Ceilings(memory_bandwidth=1e3, peak_flops=100.0, interconnect_bandwidth=None, source="test")
    times = step.times(skewed)
    assert times == pytest.approx({"bandwidth": 0.0, "compute": (5632 + 1408) / 100.0, "interconnect": 0.0})
    # Probed rates give the times; the device-wide roofline (1.2e3 B/s, 1e3 FLOP/s) names each
    # part's bound: the linear layers bandwidth (8224 / 1.2e3 > 5632 / 1e3), the attention compute.
    probed = predict.Ceilings(1.2e3, 1e3, None, "test", operators=(predict.OperatorCeilings(2, 1e4, 1e3, 1e2),))
    times = step.times(probed)  # linear max(0.8224, 5.632) s, attention max(14.08, 1.408) s
    assert times == pytest.approx({"bandwidth": 5.632, "compute": 14.08, "interconnect": 0.0})
    assert step.seconds_and_bound(probed) == (pytest.approx(14.08 + 5.632), "compute")


def test_probed_operator_ceilings_interpolate_on_log_rows():
    ops = (predict.OperatorCeilings(1, 10.0, 100.0, 1.0), predict.OperatorCeilings(16, 50.0, 900.0, 5.0))
    ceilings = dataclasses.replace(CEILINGS, operators=ops)
    assert ceilings.at_rows(1) == ops[0] and ceilings.at_rows(64) == ops[1]
    at_4 = ceilings.at_rows(4)  # log2 4 is halfway from log2 1 to log2 16
    assert (at_4.rows, at_4.matmul_bandwidth, at_4.matmul_flops, at_4.attention_bandwidth) == (4, 30.0, 500.0, 3.0)
    plain = CEILINGS.at_rows(7)
    assert (plain.matmul_bandwidth, plain.matmul_flops, plain.attention_bandwidth) == (1e3, 1e3, 1e3)


def test_the_bound_moves_from_bandwidth_to_compute_as_the_batch_grows():
    c = cost_model()
    bounds = [c.decode(batch, 16).seconds_and_bound(CEILINGS)[1] for batch in (1, 64)]
    assert bounds == ["bandwidth", "compute"]
    times = c.decode(1, 16).times(CEILINGS)
    assert times["bandwidth"] == c.decode(1, 16).bytes / 1e3 and times["interconnect"] == 0


def test_tensor_parallelism_adds_interconnect_time_and_splits_the_bytes():
    one, two = cost_model(config=TINY_TP), cost_model(tp=2, config=TINY_TP)
    assert two.weights_bytes < one.weights_bytes and two.kv_bytes_per_token == one.kv_bytes_per_token // 2
    assert two.collectives_per_step == 2 * 2 + 1
    # Per token: two all-reduces of d floats per layer (a ring sends 2 (n-1)/n of each) + the logits gather.
    assert two.interconnect_bytes_per_token == 2 * 2 * 8 * 4 * 2 * 1 / 2 + 16 * 4 * 1
    linked = predict.Ceilings(1e3, 1e3, interconnect_bandwidth=1e3, source="test")
    step = two.decode(4, 16)
    assert step.times(linked)["interconnect"] == pytest.approx(
        step.interconnect_bytes / 1e3 + 5 * predict.COLLECTIVE_LATENCY_S)
    with pytest.raises(predict.PredictError, match="interconnect"):
        step.times(CEILINGS)


def test_quantized_weights_move_fewer_bytes():
    by_dtype = {dtype: cost_model(dtype).decode(1, 16).bytes for dtype in ("float32", "bfloat16", "int8", "int4")}
    assert by_dtype["float32"] > by_dtype["bfloat16"] > by_dtype["int8"] > by_dtype["int4"]
    assert cost_model("int8").weights_bytes == memory.weights_bytes(tiny(), "int8")  # the rest in bfloat16
    on_cpu = predict.StepCostModel.create(tiny(), weight_dtype="int8", compute_dtype="float32",
                                          kv_cache_dtype="float32")
    assert on_cpu.weights_bytes == memory.weights_bytes(tiny(), "int8") + (32 * 8 + 5 * 8) * 2  # the rest in float32


def test_ceilings_from_flags_presets_and_the_probe():
    flags_only = predict.resolve_ceilings(EngineConfig(memory_bandwidth_gbps=20, peak_tflops=0.5),
                                          probe=lambda: pytest.fail("no probe when both are given"))
    assert (flags_only.memory_bandwidth, flags_only.peak_flops, flags_only.source) == (20e9, 0.5e12, "flags")
    a100 = predict.resolve_ceilings(EngineConfig(), "a100")
    assert (a100.memory_bandwidth, a100.peak_flops, a100.interconnect_bandwidth) == (2039e9, 312e12, 300e9)
    ops = [predict.OperatorCeilings(8, 1e9, 1e10, 2e9)]
    probed = predict.resolve_ceilings(EngineConfig(peak_tflops=1.0), probe=lambda: (5e9, 7e10, ops))
    assert (probed.memory_bandwidth, probed.peak_flops, probed.source) == (5e9, 1e12, "cpu probe and flags")
    assert probed.operators == ()  # a flag's figure is the ceiling for all the work
    probed = predict.resolve_ceilings(EngineConfig(), probe=lambda: (5e9, 7e10, ops))
    assert (probed.source, probed.operators) == ("cpu probe", tuple(ops))
    assert predict.resolve_ceilings(EngineConfig()) is None
    with pytest.raises(predict.PredictError, match="memory_bandwidth_gbps must be positive"):
        predict.resolve_ceilings(EngineConfig(memory_bandwidth_gbps=0))


@pytest.fixture
def tiny_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def test_cli_predict_json(tiny_config_file, capsys):
    rc, out, err = run_cli([f"--config={tiny_config_file}", "--device_memory_gb=1", "--predict", "--format=json",
                            "--memory_bandwidth_gbps=1e-6", "--peak_tflops=1e-9", "--predict_batch_sizes=2,64",
                            "--predict_context_len=10", "--predict_prompt_len=700", "--max_num_seqs=64"], capsys)
    assert rc == 0, err
    result = json.loads(out)
    p = result["predict"]
    assert result["num_pages"] > 0 and p["ceilings"]["source"] == "flags"
    small, large = p["decode"]
    assert (small["batch_size"], small["bytes"], small["flops"]) == (2, 9632, 7040)
    assert small["tpot_ms"] == pytest.approx(max(9632 / 1e3, 7040 / 1e3) * 1e3)
    assert (small["bound"], large["bound"]) == ("bandwidth", "compute")
    assert p["ttft"]["steps"] == 2 and p["ttft"]["chunk_tokens"] == 512  # the default token budget
    best = p["max_decode_throughput"]
    assert best["concurrency"] == 64 and best["tokens_per_s"] == pytest.approx(64 / large["tpot_ms"] * 1e3)


def test_cli_predict_table(tiny_config_file, capsys):
    rc, out, err = run_cli([f"--config={tiny_config_file}", "--device_memory_gb=1", "--predict", "--format=table",
                            "--memory_bandwidth_gbps=10", "--peak_tflops=0.1"], capsys)
    assert rc == 0, err
    assert "ceilings (flags): memory 10.0 GB/s, compute 0.10 TFLOP/s" in out
    assert "TTFT of a 512-token prompt" in out and "max decode throughput" in out


@pytest.mark.parametrize("argv, message", [
    (["--predict_batch_sizes=1,x"], "--predict_batch_sizes must be positive integers"),
    (["--predict_batch_sizes=0"], "--predict_batch_sizes must be positive integers"),
    (["--predict_context_len=0"], "--predict_context_len must be positive"),
    (["--predict_prompt_len=-3"], "--predict_prompt_len must be positive"),
    (["--memory_bandwidth_gbps=-1"], "memory_bandwidth_gbps must be positive"),
    (["--peak_tflops=0"], "peak_tflops must be positive"),
])
def test_cli_bad_predict_input_exits_2(tiny_config_file, capsys, argv, message):
    defaults = ["--memory_bandwidth_gbps=10", "--peak_tflops=0.1"]
    rc = cli.main(["jaxserve", "plan", f"--config={tiny_config_file}", "--device_memory_gb=1", "--predict",
                   *defaults, *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.startswith("jaxserve plan: ") and message in err, err
    assert "Traceback" not in err


def test_tensor_parallel_prediction_without_a_target_needs_the_interconnect(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_TP))
    argv = ["jaxserve", "plan", f"--config={path}", "--device_memory_gb=1", "--predict", "--memory_bandwidth_gbps=10",
            "--peak_tflops=0.1", "--tensor_parallel_size=2"]
    assert cli.main(argv) == 2 and "--interconnect_gbps" in capsys.readouterr().err


def test_the_cpu_probe_measures_every_row_count_asked(monkeypatch):
    from jaxserve.planning import probe
    for name, value in (("COPY_BYTES", 8 << 20), ("WEIGHT_STACK_BYTES", 4 << 20), ("PROBE_CACHE_BYTES", 1 << 20),
                        ("BUDGET_S", 0.01), ("PREFILL_PROBE_ROWS", 16)):
        monkeypatch.setattr(probe, name, value)
    model = ModelConfig.from_hf_dict({**TINY, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                      "num_key_value_heads": 2, "head_dim": 16})
    bandwidth, peak, operators = probe.probe(model, rows=[4, 1, 4], context_len=40, page_size=16)
    assert [o.rows for o in operators] == [1, 4]
    assert bandwidth > 0 and peak >= max(o.matmul_flops for o in operators) > 0
    assert all(o.matmul_bandwidth > 0 and o.attention_bandwidth > 0 for o in operators)
    # The same matmul time gives both rates: FLOP/s / bytes/s = 2 rows / 4 bytes per weight.
    assert operators[1].matmul_flops / operators[1].matmul_bandwidth == pytest.approx(2 * 4 / 4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("rows", [4, 80])
def test_the_matmul_probe_takes_each_compute_dtype(monkeypatch, dtype, rows):
    """Every dtype a prompt's matmuls may run in, at decode rows (summed under a scan) and at a
    prompt chunk's (one call per matrix); int8 through the VNNI kernel where it is built, as
    the engine's int8 prompts."""
    from jaxserve.planning import probe
    monkeypatch.setattr(probe, "WEIGHT_STACK_BYTES", 1 << 20)
    monkeypatch.setattr(probe, "BUDGET_S", 0.01)
    weight_bytes, flops = probe.matmul_rates(64, 128, rows, dtype)
    itemsize = {"float32": 4, "bfloat16": 2, "int8": 1}[dtype]
    assert weight_bytes > 0 and flops / weight_bytes == pytest.approx(2 * rows / itemsize)
