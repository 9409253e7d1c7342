"""Mixture-of-experts models whose MLP layers are not all sparse (Qwen3-MoE and Qwen2-MoE's
`decoder_sparse_step` and `mlp_only_layers`), against transformers (float32).

Each case is a tiny random model built and saved by transformers, converted by jaxserve: its
logits must match transformers' within 1e-4, and the comparison must see the layers' kinds and
rows (swapping two dense layers' weights, or two sparse layers', moves the logits far past the
tolerance; a checkpoint whose layers do not have the kinds its config says is refused by name).
One case's greedy tokens must match through `jaxserve convert` + `jaxserve generate`.
"""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.convert import convert_checkpoint
from checkpoints.load import load_config, load_params
from jaxserve.config import ModelConfig
from jaxserve.models import cpu_layout, llama, weights
from tests.test_moe import SEED, greedy_through_the_cli, make_moe_model
from tests.tiny_models import hf_logits, prefill_batch

pytestmark = pytest.mark.slow  # models against transformers, subprocesses: out of `make test-quick`

CASES = {  # name: (family, extra config fields, the dense layers transformers builds)
    "qwen3_moe-step2": ("qwen3_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2}, (0, 2)),
    "qwen3_moe-mlp_only0": ("qwen3_moe", {"num_hidden_layers": 3, "mlp_only_layers": [0]}, (0,)),
    "qwen2_moe-step2": ("qwen2_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2}, (0, 2)),
    "qwen2_moe-mlp_only0": ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [0]}, (0,)),
}


@pytest.fixture(scope="module", params=list(CASES))
def mixed_model(request, tmp_path_factory):
    """(case, torch model, converted directory)."""
    family, extra, dense = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    model = make_moe_model(str(root / "hf"), family, **extra)
    # transformers' own layers have the kinds the case says (its rule, not ours)
    built = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate_proj"))
    assert built == dense, request.param
    convert_checkpoint(str(root / "hf"), str(root / "converted"))
    return request.param, model, str(root / "converted")


def _step(config):
    return jax.jit(lambda p, k, b: llama.forward(p, k, b, config=config)[0])


def _batch(config):
    batch, token_ids, num_pages = prefill_batch([11, 6, 3], 4, 4, config.vocab_size, np.random.default_rng(SEED))
    kv = llama.init_kv_cache(config, llama.KVCacheSpec(num_pages=num_pages, page_size=4), jnp.float32)
    return {k: jnp.asarray(v) for k, v in batch.items()}, token_ids, kv


def test_forward_matches_transformers_and_sees_each_layers_weights(mixed_model):
    case, model, converted = mixed_model
    config = load_config(converted)
    assert config.mlp_only_layers == CASES[case][2]
    params = load_params(converted, jnp.float32)
    assert params["layers"]["dense_w_gate"].shape[0] == len(config.mlp_only_layers)
    assert params["layers"]["w_gate_exps"].shape[0] == len(config.sparse_layers)
    batch, token_ids, kv = _batch(config)
    step = _step(config)
    logits = np.asarray(step(params, kv, batch))
    expected = np.concatenate([hf_logits(model, ids[None])[0] for ids in token_ids])
    atol = 1e-4 * np.abs(expected).max()
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=atol, err_msg=f"{case}, seed {SEED}")
    # What the comparison sees: a layer reading another layer's row of its kind's weights.
    for leaf in ("dense_w_gate", "w_gate_exps", "router"):
        stack = params["layers"][leaf]
        if stack.shape[0] < 2:
            continue
        swapped = {**params, "layers": {**params["layers"], leaf: stack[::-1]}}
        assert np.abs(np.asarray(step(swapped, kv, batch)) - expected).max() > 100 * atol, (case, leaf)


def test_transformers_5_fused_experts_of_a_mixed_model_convert_to_the_same_weights(mixed_model, tmp_path):
    """save_pretrained(save_original_format=False): the sparse layers' fused experts fill their
    rows of the experts' stacks, the dense layers' MLP theirs, as the per-expert files do."""
    from safetensors import safe_open
    case, model, converted = mixed_model
    model.save_pretrained(str(tmp_path / "fused"), save_original_format=False)
    with safe_open(str(tmp_path / "fused" / "model.safetensors"), "np") as f:
        assert "model.layers.1.mlp.experts.gate_up_proj" in f.keys() and "model.layers.0.mlp.gate_proj.weight" in f.keys()
    convert_checkpoint(str(tmp_path / "fused"), str(tmp_path / "converted"))
    expected, got = load_params(converted, jnp.float32), load_params(str(tmp_path / "converted"), jnp.float32)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=case), expected, got)


def test_a_checkpoint_with_other_layer_kinds_is_refused_by_name(tmp_path):
    """Saved with layer 0 dense, read with a config that says layer 0 is sparse: the converter
    names the tensor that does not belong, rather than filling a layer of the wrong kind."""
    from checkpoints import ConversionError
    make_moe_model(str(tmp_path / "hf"), "qwen3_moe", num_hidden_layers=3, mlp_only_layers=[0])
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "mlp_only_layers": [1]}))
    with pytest.raises(ConversionError, match=r"model\.layers\.[01]\.mlp\..*MLP is"):
        convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "out"))


def test_each_layer_reads_its_own_row_of_its_kinds_weights():
    """LayerWeights under the kinds switch: layer i of kind k gets row row_of[i] of kind k's
    stacks, under the uniform layer's names, and the weights every layer has at row i."""
    config = ModelConfig.from_hf_dict({
        "architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 16, "hidden_size": 8, "intermediate_size": 12,
        "num_hidden_layers": 5, "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts": 2,
        "num_experts_per_tok": 1, "moe_intermediate_size": 4, "shared_expert_intermediate_size": 6,
        "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert config.mlp_only_layers == (0, 2, 3, 4) and config.sparse_layers == (1,)
    kinds = weights.layer_kinds(config)
    shapes = weights.param_shapes(config)["layers"]
    # every array holds, at row r, the model layer that row stands for (negative: a dense stack's)
    layers = {}
    for name, shape in shapes.items():
        rows = weights.stack_layers(config, weights.weight_infos(config)[f"layers/{name}"].axes[0])
        sign = -1.0 if name.startswith("dense_") else 1.0
        layers[name] = jnp.broadcast_to(sign * jnp.asarray(rows, jnp.float32).reshape(-1, *[1] * (len(shape) - 1)),
                                        shape)
    lw = cpu_layout.LayerWeights.of(layers, kinds)

    def run(scanned_rows):
        def body(carry, lp):
            layer_idx = carry
            kind_probe = lw.apply(lambda w, x: jnp.stack([w["attn_norm"][0], w["w_gate"].reshape(-1)[0],
                                                          jnp.float32("router" in w)]), lp, layer_idx, 0.0)
            return layer_idx + 1, kind_probe
        return jax.lax.scan(body, jnp.int32(0), scanned_rows)[1]

    got = np.asarray(jax.jit(run)(lw.scanned))
    # layer, its w_gate (a dense layer's dense_w_gate: minus its layer; layer 1: the shared expert's), sparse?
    np.testing.assert_array_equal(got, [[0, 0, 0], [1, 1, 1], [2, -2, 0], [3, -3, 0], [4, -4, 0]])


@pytest.mark.parametrize("family", ["qwen2_moe"])
def test_greedy_tokens_through_convert_and_generate(tmp_path, family):
    """`jaxserve convert` + `jaxserve generate` (chunked prefill, then decode) give transformers'
    greedy tokens for a Qwen2-MoE model with decoder_sparse_step 2."""
    got, expected = greedy_through_the_cli(tmp_path, family, "Every other layer routes each token to two of four experts.",
                                           num_hidden_layers=4, decoder_sparse_step=2)
    assert got == expected


# ---- tensor parallelism, on fake CPU devices (one subprocess, as tests/test_moe_sharding.py) ----
TP_CONFIG = {"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 128, "hidden_size": 32, "intermediate_size": 48,
             "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
             "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
             "shared_expert_intermediate_size": 40, "mlp_only_layers": [1]}


def _tensor_parallel_worker() -> None:
    """Prints {tp: {"logits", "layout"}} of one prefill step of a mixed Qwen2-MoE at TP 1 and 2."""
    from jaxserve.parallel import sharding
    config = ModelConfig.from_hf_dict(TP_CONFIG)
    params = weights.random_params(config, seed=3)
    batch, _, kv_pages = _batch(config)
    out = {}
    for tp in (1, 2):
        mesh = sharding.make_mesh(config, tp) if tp > 1 else None
        shardings = sharding.ModelShardings.create(config, mesh) if mesh else None
        run_config = shardings.model_config if shardings else config
        kv = llama.init_kv_cache(run_config, llama.KVCacheSpec(num_pages=kv_pages["k"].shape[0] // config.num_layers,
                                                               page_size=4), jnp.float32,
                                 shardings.kv_cache if shardings else None)
        placed = shardings.place(params) if shardings else params
        step = jax.jit(lambda p, k, b: llama.forward(p, k, b, config=run_config, mesh=mesh)[0])
        layout = {name: sorted({tuple(s.data.shape) for s in placed["layers"][name].addressable_shards})
                  for name in ("dense_w_gate", "dense_w_down", "w_gate_exps", "router")}
        out[tp] = {"logits": np.asarray(step(placed, kv, batch)).tolist(), "layout": layout}
    print(json.dumps(out))


def test_tensor_parallel_mixed_layers_match_one_device():
    """At TP 2 a mixed model's logits are one device's (the step is llama.forward's, whose KV-head
    replication at TP 4 tests/test_moe_sharding.py covers);
    the dense layers' MLP is split on intermediate_size, the experts on theirs, the router replicated."""
    import os
    import subprocess
    import sys
    from tests.test_sharding import FAKE_DEVICES_ENV, REPO
    code = "from tests.test_moe_mixed_layers import _tensor_parallel_worker; _tensor_parallel_worker()"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **FAKE_DEVICES_ENV})
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = np.asarray(runs["1"]["logits"])
    for tp in (2,):
        np.testing.assert_allclose(np.asarray(runs[str(tp)]["logits"]), expected, rtol=1e-5,
                                   atol=1e-5 * np.abs(expected).max(), err_msg=f"tp {tp}")
        layout = runs[str(tp)]["layout"]
        assert layout["dense_w_gate"] == [[1, 32, 48 // tp]] and layout["dense_w_down"] == [[1, 48 // tp, 32]]
        assert layout["w_gate_exps"] == [[2, 4, 32, 24 // tp]] and layout["router"] == [[2, 32, 4]]


def test_a_tensor_parallel_split_the_dense_layers_do_not_divide_is_refused():
    import dataclasses
    from jaxserve.parallel import sharding
    config = ModelConfig.from_hf_dict(TP_CONFIG)
    assert sharding.tensor_parallel_problem(config, 4) is None
    with pytest.raises(ValueError, match="intermediate_size"):
        sharding.check_tensor_parallel(dataclasses.replace(config, intermediate_size=50), 4)
    all_sparse = dataclasses.replace(config, intermediate_size=50, mlp_only_layers=())
    assert sharding.tensor_parallel_problem(all_sparse, 4) is None  # no weight of intermediate_size


def test_the_planner_counts_each_kinds_layers_only():
    """A mixed model's bytes: the dense MLP of its dense layers, the experts, router and shared
    expert of its sparse ones, each once (the planner reads the one declaration)."""
    from jaxserve.planning import memory
    config = ModelConfig.from_hf_dict(TP_CONFIG)  # layer 1 dense, layers 0 and 2 sparse
    D, F, E, Fe, S, L = 32, 48, 4, 24, 40, 3
    attention = L * (2 * D * 32 + 2 * D * 16)
    counts = memory.count_params(config)
    assert counts["experts"] == 2 * E * 3 * D * Fe
    assert counts["routers"] == 2 * (D * E + D)
    assert counts["linear"] == attention + 1 * 3 * D * F + 2 * 3 * D * S
    assert sum(counts.values()) == weights.num_params(config)
    assert memory.weights_bytes(config, "float32") == 4 * weights.num_params(config)
    assert memory.weights_bytes(config, "bfloat16", 2) < memory.weights_bytes(config, "bfloat16", 1)
