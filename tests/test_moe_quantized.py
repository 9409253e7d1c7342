"""Quantized routed experts (int8 / int4): every expert's [in, out] matrix quantized with its own
scales (jaxserve.models.quantization), multiplied one expert at a time by the grouped matmul.

The quantized step must compute exactly what the float step computes on the dequantized weights:
through the CPU's work-item loop (which multiplies each expert's codes through `linear`), through
ragged_dot and the Pallas kernel in interpret mode (which multiply the dequantized experts), with
the experts split over fake devices on their intermediate size and whole per device (expert
parallel). A swapped expert or a wrong expert's scales would change the logits; the float model's
logits are not what the quantized one gives (the check sees the quantization). Conversion with
--quantization stores the experts quantized (HF per-expert tensors and GGUF blocks copied as they
are), and the planner counts their stored bytes.
"""
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.convert import convert_checkpoint
from checkpoints.load import load_config, load_params
from jaxserve.models import llama, quantization, weights
from tests.moe_fake_devices import prefill_logits, worker_results
from tests.test_moe import FAMILIES, make_moe_model
from tests.tiny_models import prefill_batch

pytestmark = pytest.mark.slow  # quantized models, fake devices in subprocesses: out of `make test-quick`

SEED = 2468
# Sizes every group size divides: hidden 32, experts' and shared expert's intermediate 64.
SIZES = dict(intermediate_size=64, moe_intermediate_size=64)
FORMATS = ("int8", "int4_g32_sym", "int8_g32_zp")
EXPERT_LEAVES = ("w_gate_exps", "w_up_exps", "w_down_exps")


def _sizes(family: str) -> dict:
    return {**SIZES, **({"shared_expert_intermediate_size": 64} if family == "qwen2_moe" else {})}


@pytest.fixture(scope="module", params=list(FAMILIES))
def converted(request, tmp_path_factory):
    """(family, torch model, HF folder, float-converted directory)."""
    root = tmp_path_factory.mktemp(f"q_{request.param}")
    model = make_moe_model(str(root / "hf"), request.param, seed=SEED, **_sizes(request.param))
    convert_checkpoint(str(root / "hf"), str(root / "converted"))
    return request.param, model, str(root / "hf"), str(root / "converted")


@functools.partial(jax.jit, static_argnames="config")
def _forward_logits(params, kv, batch, config):
    return llama.forward(params, kv, batch, config=config)[0]


def _prefill(config, params, backend_env=None, monkeypatch=None):
    """Logits [T, V] of one prefill step of three prompts. The step compiled once per config and
    parameter structure; with `backend_env` a fresh trace under that grouped-matmul backend (read
    when the step is traced)."""
    batch, _, num_pages = prefill_batch([9, 5, 3], 4, 4, config.vocab_size, np.random.default_rng(SEED))
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    kv = llama.init_kv_cache(config, llama.KVCacheSpec(num_pages=num_pages, page_size=4), jnp.float32)
    if backend_env is None:
        return np.asarray(_forward_logits(params, kv, batch, config))
    monkeypatch.setenv("JAXSERVE_GROUPED_MATMUL_BACKEND", backend_env)
    return np.asarray(jax.jit(lambda p, k, b: llama.forward(p, k, b, config=config)[0])(params, kv, batch))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_experts_compute_the_dequantized_model(converted, fmt):
    """The CPU step with quantized experts gives the logits of the float step on the dequantized
    weights (1e-5), and differs from the float model's (the experts really are quantized)."""
    family, _, _, path = converted
    config = load_config(path)
    params = load_params(path, jnp.float32)
    quantized = quantization.quantize_params(params, fmt, config)
    for leaf in EXPERT_LEAVES:
        weight = quantized["layers"][leaf]
        assert isinstance(weight, quantization.QuantArray), leaf
        stored, asked = quantization.weight_format(weight), quantization.parse_format(fmt)
        assert (stored.bits, stored.zero_point) == (asked.bits, asked.zero_point), leaf
        assert weight.scale.shape[:2] == params["layers"][leaf].shape[:2]  # [L, E, groups, out]: per expert
    assert "router" not in quantization.params_formats(quantized)  # the router stays float
    got = _prefill(config, quantized)
    expected = _prefill(config, quantization.dequantize_params(quantized))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=f"{family} {fmt}")
    assert np.abs(got - _prefill(config, params)).max() > 1e-3


def test_an_experts_own_scales_are_the_ones_applied(converted):
    """Give expert 0 expert 1's int8 scales: the logits move (each expert multiplies its own)."""
    family, _, _, path = converted
    config = load_config(path)
    quantized = quantization.quantize_params(load_params(path, jnp.float32), "int8", config)
    layers = dict(quantized["layers"])
    down = layers["w_down_exps"]
    layers["w_down_exps"] = dataclasses.replace(down, scale=down.scale.at[:, 0].set(down.scale[:, 1]))
    swapped = {**quantized, "layers": layers}
    assert np.abs(_prefill(config, swapped) - _prefill(config, quantized)).max() > 1e-3, family


@pytest.mark.parametrize("backend", ["ragged_dot", "interpret"])
def test_the_gpu_backends_multiply_the_dequantized_experts(backend, monkeypatch, tmp_path):
    """ragged_dot and the Pallas kernel (interpret mode) take the experts dequantized to float:
    the same logits as the CPU loop over their codes."""
    make_moe_model(str(tmp_path / "hf"), "qwen2_moe", seed=SEED, **_sizes("qwen2_moe"))
    convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "converted"))
    config = load_config(str(tmp_path / "converted"))
    quantized = quantization.quantize_params(load_params(str(tmp_path / "converted"), jnp.float32), "int4", config)
    expected = _prefill(config, quantized)
    got = _prefill(config, quantized, backend, monkeypatch)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=backend)


def test_dequantize_in_input_order_undoes_act_order():
    """An act-order weight's stored rows come back in the inputs' order."""
    rng = np.random.default_rng(SEED)
    w = rng.standard_normal((3, 64, 8)).astype(np.float32)  # [E, in, out]
    perm = np.stack([rng.permutation(64) for _ in range(3)]).astype(np.int32)  # stored row i = input perm[i]
    stored = np.take_along_axis(w, perm[..., None], axis=1)
    q = quantization.quantize(jnp.asarray(stored), quantization.parse_format("int8"))
    weight = dataclasses.replace(q, perm=jnp.asarray(perm))
    expected = np.take_along_axis(np.asarray(quantization.dequantize(q)), np.argsort(perm)[..., None], axis=1)
    np.testing.assert_array_equal(np.asarray(quantization.dequantize_in_input_order(weight)), expected)
    np.testing.assert_allclose(expected, w, atol=0.05)


def test_act_order_experts_split_on_their_input_are_refused():
    from jax.sharding import PartitionSpec as P
    from jaxserve.parallel import sharding
    q = quantization.quantize(jnp.zeros((2, 4, 64, 32)), quantization.parse_format("int8_g32"))
    weight = dataclasses.replace(q, perm=jnp.zeros((2, 4, 64), jnp.int32))
    with pytest.raises(ValueError, match="enable_expert_parallel"):
        sharding.quantized_specs(P(None, None, "model", None), weight, "w_down_exps", 2)
    specs = sharding.quantized_specs(P(None, "model", None, None), weight, "w_down_exps", 2)  # expert parallel
    assert specs["perm"] == P(None, "model", None) and specs["scale"] == P(None, "model", None, None)


# ---- on fake devices ----------------------------------------------------------------------------

FAKE_FAMILY = "qwen2_moe"  # routed and shared experts
FAKE_FORMATS = ("int4", "int8")
FAKE_RUNS = {"tp2": (2, False), "ep2": (2, True)}


def _worker() -> None:
    """One device's logits and the TP 2 / EP 2 ones of a quantized Qwen2-MoE (printed as JSON)."""
    from jaxserve.config import ModelConfig
    from tests.test_moe_expert_parallel import BASE, FAMILIES as EP_FAMILIES
    config = ModelConfig.from_hf_dict({**BASE, **EP_FAMILIES[FAKE_FAMILY], **_sizes(FAKE_FAMILY)})
    params = weights.random_params(config, seed=SEED)
    results = {}
    for fmt in FAKE_FORMATS:
        quantized = quantization.quantize_params(params, fmt, config)
        results[fmt] = {"tp1": prefill_logits(config, quantized, 1)[0]}
        for name, (tp, expert_parallel) in FAKE_RUNS.items():
            results[fmt][name] = prefill_logits(config, quantized, tp, expert_parallel=expert_parallel,
                                                layout_names=EXPERT_LEAVES)[0]
    print(json.dumps(results))


@pytest.fixture(scope="module")
def fake_device_runs():
    return worker_results("tests.test_moe_quantized")


@pytest.mark.parametrize("fmt", FAKE_FORMATS)
@pytest.mark.parametrize("run", list(FAKE_RUNS))
def test_quantized_experts_split_over_devices_give_one_devices_logits(fake_device_runs, fmt, run):
    one = np.asarray(fake_device_runs[fmt]["tp1"])
    np.testing.assert_allclose(np.asarray(fake_device_runs[fmt][run]), one, rtol=1e-4, atol=1e-4 * np.abs(one).max(),
                               err_msg=f"{fmt} {run}")


# ---- conversion and the planner -----------------------------------------------------------------

def test_convert_stores_the_experts_quantized_and_generate_matches(tmp_path):
    """`jaxserve convert --quantization=int4` stores every expert quantized, and the engine on it
    gives the greedy tokens of the float conversion quantized when served (the same numbers)."""
    from jaxserve.commands import cli
    make_moe_model(str(tmp_path / "hf"), "qwen3_moe", seed=SEED, **_sizes("qwen3_moe"))
    for name, flags in (("int4", ["--quantization=int4"]), ("float", [])):
        assert cli.main(["jaxserve", "convert", f"--source={tmp_path / 'hf'}", f"--output={tmp_path / name}",
                         *flags]) == 0
    config = load_config(str(tmp_path / "int4"))
    stored = load_params(str(tmp_path / "int4"), jnp.float32)
    assert set(EXPERT_LEAVES) <= set(quantization.params_formats(stored))
    served = quantization.quantize_params(load_params(str(tmp_path / "float"), jnp.float32), "int4", config)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), stored, served)
    from jaxserve.core.request import SamplingParams
    from jaxserve.engine import Engine, EngineConfig
    prompts = [[5, 9, 13, 2, 77], [3, 1, 4, 1, 5, 9, 2, 6]]
    engine_flags = dict(max_num_batched_tokens=8, max_num_seqs=2, page_size=4, num_pages=16, max_model_len=32,
                        warmup=False, dtype="float32")
    tokens = {}
    for name, quantize in (("int4", None), ("float", "int4")):
        engine = Engine.from_model(str(tmp_path / name), EngineConfig(**engine_flags, quantization=quantize))
        results = engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
        tokens[name] = [r.token_ids for r in results]
    assert tokens["int4"] == tokens["float"] and all(len(t) == 6 for t in tokens["int4"])


def test_the_planner_counts_the_quantized_experts_stored_bytes(converted):
    """weights_bytes prices every quantized leaf (the experts included) at its stored arrays'
    bytes, and the leaves that stay float (routers, norms, embeddings) in bfloat16."""
    from jaxserve.planning import memory
    family, _, _, path = converted
    config = load_config(path)
    for fmt in ("int8", "int4"):
        quantized = quantization.quantize_params(load_params(path, jnp.float32), fmt, config)
        layers = quantized["layers"]
        stored = quantization.tree_bytes([w for w in layers.values() if isinstance(w, quantization.QuantArray)])
        floats = [w for w in jax.tree.leaves({**quantized, "layers": {k: w for k, w in layers.items()
                                                                     if not isinstance(w, quantization.QuantArray)}})]
        assert set(EXPERT_LEAVES) <= set(quantization.params_formats(quantized))
        assert memory.weights_bytes(config, fmt) == stored + 2 * sum(w.size for w in floats), f"{family} {fmt}"


def test_a_group_size_that_does_not_divide_the_experts_is_refused_by_name(tmp_path, capsys):
    """Mixtral's experts of intermediate size 48: int4's groups of 32 cannot cover w_down_exps'
    inputs; convert exits 2 naming the weight, and writes nothing."""
    from jaxserve.commands import cli
    make_moe_model(str(tmp_path / "hf"), "mixtral", seed=SEED)
    assert cli.main(["jaxserve", "convert", f"--source={tmp_path / 'hf'}", f"--output={tmp_path / 'out'}",
                     "--quantization=int4"]) == 2
    assert "w_down_exps" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
