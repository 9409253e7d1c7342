"""PEFT LoRA adapters read and checked (checkpoints.lora_adapter), and the device slab they are
written into (jaxserve.models.lora). Adapters here are written by hand (numpy + safetensors, as
PEFT lays them out), so that each refusal is met by exactly the file that should cause it;
tests/test_lora.py loads adapters that peft itself wrote.
"""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from checkpoints import lora_adapter
from checkpoints.lora_adapter import LoRAError, load_adapter
from jaxserve.config import ModelConfig
from jaxserve.models import lora

SEED = 20261205
CONFIG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_q_heads=4,
                     num_kv_heads=2, head_dim=8)  # GQA: k and v have 16 outputs, q 32
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def tensor_name(layer: int, module: str, side: str) -> str:
    return f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}.lora_{side}.weight"


def write_adapter(folder, *, r=4, alpha=8, targets=("q_proj", "v_proj"), layers=None, seed=0, config=None,
                  tensors=None, **settings) -> dict[str, np.ndarray]:
    """An adapter folder as PEFT writes one; returns its tensors ({name: array})."""
    config = config or CONFIG
    shapes = lora_adapter.weight_shapes(config)
    rng = np.random.default_rng([SEED, seed])
    if tensors is None:
        tensors = {}
        for layer in range(config.num_layers) if layers is None else layers:
            for module in targets:
                d_in, d_out = shapes[lora_adapter.PROJECTIONS[module][0]]
                tensors[tensor_name(layer, module, "A")] = rng.standard_normal((r, d_in)).astype(np.float32)
                tensors[tensor_name(layer, module, "B")] = rng.standard_normal((d_out, r)).astype(np.float32)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, lora_adapter.WEIGHTS_FILE))
    target_modules = targets if isinstance(targets, str) else list(targets)
    config_json = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": target_modules,
                   "layers_to_transform": layers, "bias": "none", "use_dora": False, "use_rslora": False,
                   "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, **settings}
    with open(os.path.join(folder, lora_adapter.CONFIG_FILE), "w") as f:
        json.dump(config_json, f)
    return tensors


def test_the_loader_shapes_are_the_weights_declaration():
    """The jax-free loader's table of projection shapes is the models' (jaxserve.models.weights)."""
    assert lora_adapter.weight_shapes(CONFIG) == lora.projection_shapes(CONFIG)
    assert lora_adapter.WEIGHT_NAMES == lora.NAMES


@pytest.mark.parametrize("rslora", [False, True])
def test_layout_and_scaling(tmp_path, rslora):
    tensors = write_adapter(tmp_path, r=4, alpha=8, targets=("q_proj", "k_proj", "down_proj"), layers=[0, 2],
                            use_rslora=rslora)
    adapter = load_adapter(str(tmp_path), CONFIG, max_rank=8)
    scaling = 8 / math.sqrt(4) if rslora else 8 / 4
    assert adapter.rank == 4 and adapter.scaling == pytest.approx(scaling) and adapter.layers == (0, 2)
    assert adapter.targets == ("wq", "wk", "w_down")
    a, b = adapter.weights["wk"]
    assert a.shape == (3, 32, 4) and b.shape == (3, 4, 16)  # [L, in, r], [L, r, out]: k has 2 heads x 8
    for layer in (0, 2):
        np.testing.assert_array_equal(a[layer], tensors[tensor_name(layer, "k_proj", "A")].T)
        np.testing.assert_allclose(b[layer], scaling * tensors[tensor_name(layer, "k_proj", "B")].T, rtol=1e-6)
    assert not a[1].any() and not b[1].any(), "a layer the adapter does not adapt holds zeros"
    padded = adapter.padded(8, lora.NAMES, lora.projection_shapes(CONFIG), CONFIG.num_layers)
    assert padded["wq"]["a"].shape == (3, 32, 8) and padded["w_up"]["b"].shape == (3, 8, 48)
    assert not padded["w_up"]["a"].any() and not padded["wk"]["a"][:, :, 4:].any()
    np.testing.assert_array_equal(padded["wk"]["b"][:, :4], b)


def test_all_linear_regex_and_exclude(tmp_path):
    every = list(MODULES)
    write_adapter(tmp_path / "all", targets=every, target_modules="all-linear")
    assert load_adapter(str(tmp_path / "all"), CONFIG, 4).targets == lora.NAMES
    write_adapter(tmp_path / "regex", targets=("q_proj", "o_proj"), target_modules=r".*\.(q|o)_proj")
    assert load_adapter(str(tmp_path / "regex"), CONFIG, 4).targets == ("wq", "wo")
    write_adapter(tmp_path / "excluded", targets=("q_proj",), layers=[0, 1], target_modules=["q_proj"],
                  exclude_modules=["model.layers.2.self_attn.q_proj"])
    assert load_adapter(str(tmp_path / "excluded"), CONFIG, 4).layers == (0, 1)


REFUSALS = {  # name: (adapter_config.json fields over rank-4 weights of q_proj and v_proj, words of the error)
    "dora": (dict(use_dora=True), "DoRA"),
    "modules-to-save": (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    "lm-head-target": (dict(target_modules=["q_proj", "v_proj", "lm_head"]), "lm_head LoRA"),
    "embedding-regex": (dict(target_modules=r".*(embed_tokens|q_proj|v_proj)"), "embedding or lm_head"),
    "unknown-target": (dict(target_modules=["q_proj", "v_proj", "fc1"]), "not supported"),
    "rank-over-max": (dict(r=16), "over the maximum LoRA rank 8"),
    "rank-pattern": (dict(rank_pattern={"q_proj": 2}), "rank_pattern"),
    "bias": (dict(bias="lora_only"), "biases"),
    "not-lora": (dict(peft_type="IA3"), "only LoRA"),
    "config-rank-lies": (dict(r=2), r"needs \[2, 32\]"),
    "config-targets-lie": (dict(target_modules=["q_proj"]), "does not target"),
    "config-layers-lie": (dict(layers_to_transform=[0]), "does not target"),
    "targets-without-weights": (dict(target_modules=["q_proj", "v_proj", "o_proj"]), "has no LoRA weights"),
    "bad-rank": (dict(r=0), "no valid rank"),
    "bad-alpha": (dict(lora_alpha="16"), "no valid lora_alpha"),
    "no-targets": (dict(target_modules=None), "no valid target_modules"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_unsupported_or_inconsistent_adapters_are_refused(tmp_path, case):
    fields, words = REFUSALS[case]
    write_adapter(tmp_path, r=4, targets=("q_proj", "v_proj"))
    with open(tmp_path / lora_adapter.CONFIG_FILE) as f:
        config_json = json.load(f)
    with open(tmp_path / lora_adapter.CONFIG_FILE, "w") as f:
        json.dump({**config_json, **fields}, f)
    with pytest.raises(LoRAError, match=words) as error:
        load_adapter(str(tmp_path), CONFIG, max_rank=8)
    assert str(tmp_path) in str(error.value)


def test_tensors_that_do_not_fit_the_base_model_are_refused(tmp_path):
    wide = ModelConfig(**{**CONFIG.__dict__, "hidden_size": 40})  # an adapter of another base model
    write_adapter(tmp_path, config=wide)
    with pytest.raises(LoRAError, match=r"q_proj of layer 0 has lora_A \[4, 40\].*needs \[4, 32\]"):
        load_adapter(str(tmp_path), CONFIG, 8)
    deeper = ModelConfig(**{**CONFIG.__dict__, "num_layers": 5})
    write_adapter(tmp_path / "deep", config=deeper, layers=[4])
    with pytest.raises(LoRAError, match=r"layers_to_transform \[4\] is not a list of layers of a 3-layer model"):
        load_adapter(str(tmp_path / "deep"), CONFIG, 8)


def test_weights_the_loader_cannot_use_are_refused(tmp_path):
    tensors = write_adapter(tmp_path / "half")
    del tensors[tensor_name(1, "v_proj", "B")]
    write_adapter(tmp_path / "half", tensors=tensors)
    with pytest.raises(LoRAError, match="not both lora_A and lora_B"):
        load_adapter(str(tmp_path / "half"), CONFIG, 8)

    tensors = write_adapter(tmp_path / "nan")
    tensors[tensor_name(2, "q_proj", "A")][0, 3] = np.nan
    write_adapter(tmp_path / "nan", tensors=tensors)
    with pytest.raises(LoRAError, match="non-finite"):
        load_adapter(str(tmp_path / "nan"), CONFIG, 8)

    tensors = write_adapter(tmp_path / "head")
    tensors["base_model.model.lm_head.lora_A.weight"] = np.zeros((4, 32), np.float32)
    write_adapter(tmp_path / "head", tensors=tensors)
    with pytest.raises(LoRAError, match="lm_head LoRA"):
        load_adapter(str(tmp_path / "head"), CONFIG, 8)

    tensors = write_adapter(tmp_path / "dora")
    tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"] = np.ones(32, np.float32)
    write_adapter(tmp_path / "dora", tensors=tensors)
    with pytest.raises(LoRAError, match="DoRA"):
        load_adapter(str(tmp_path / "dora"), CONFIG, 8)


def test_bad_paths_and_corrupt_files_are_refused(tmp_path):
    with pytest.raises(LoRAError, match="no such adapter folder"):
        load_adapter(str(tmp_path / "missing"), CONFIG, 8)
    (tmp_path / "file").write_text("x")
    with pytest.raises(LoRAError, match="not a folder"):
        load_adapter(str(tmp_path / "file"), CONFIG, 8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        load_adapter(str(tmp_path / "empty"), CONFIG, 8)

    write_adapter(tmp_path / "pickle")
    os.rename(tmp_path / "pickle" / lora_adapter.WEIGHTS_FILE, tmp_path / "pickle" / lora_adapter.PICKLE_FILE)
    with pytest.raises(LoRAError, match="adapter_model.bin is a pickle.*safe_serialization=True"):
        load_adapter(str(tmp_path / "pickle"), CONFIG, 8)

    write_adapter(tmp_path / "garbage")
    (tmp_path / "garbage" / lora_adapter.WEIGHTS_FILE).write_bytes(b"\xff" * 64)
    with pytest.raises(LoRAError, match="cannot be read.*(corrupt|truncated)"):
        load_adapter(str(tmp_path / "garbage"), CONFIG, 8)

    write_adapter(tmp_path / "truncated")
    weights = tmp_path / "truncated" / lora_adapter.WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(LoRAError, match="truncated"):
        load_adapter(str(tmp_path / "truncated"), CONFIG, 8)

    write_adapter(tmp_path / "bad-json")
    (tmp_path / "bad-json" / lora_adapter.CONFIG_FILE).write_text("{not json")
    with pytest.raises(LoRAError, match="cannot be read"):
        load_adapter(str(tmp_path / "bad-json"), CONFIG, 8)


def test_a_mixture_of_experts_model_takes_attention_adapters_only(tmp_path):
    moe = ModelConfig(**{**CONFIG.__dict__, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16})
    write_adapter(tmp_path / "mlp", targets=("q_proj", "gate_proj"), config=moe)
    with pytest.raises(LoRAError, match="mixture-of-experts"):
        load_adapter(str(tmp_path / "mlp"), moe, 8)
    write_adapter(tmp_path / "attention", targets=("q_proj", "o_proj"), config=moe)
    assert load_adapter(str(tmp_path / "attention"), moe, 8).targets == ("wq", "wo")
    assert lora.adaptable_names(moe) == ("wq", "wk", "wv", "wo")


def test_slots_are_written_and_cleared_without_recompiling(tmp_path):
    max_loras, max_rank = 3, 8
    slab = lora.init_slab(CONFIG, max_loras, max_rank)
    assert lora.num_slots(slab) == 4 and slab["wq"]["a"].shape == (3, 4, 32, 8)
    assert lora.slab_bytes(CONFIG, max_loras, max_rank) == sum(x.nbytes for x in jax.tree.leaves(slab))
    shapes, names = lora.projection_shapes(CONFIG), tuple(slab)
    adapters = []
    for i, (r, targets) in enumerate([(4, ("q_proj", "v_proj")), (8, ("up_proj", "down_proj", "o_proj"))]):
        write_adapter(tmp_path / str(i), r=r, targets=targets, seed=i)
        adapters.append(load_adapter(str(tmp_path / str(i)), CONFIG, max_rank).padded(max_rank, names, shapes, 3))
    slab = lora.write_slot(slab, 2, adapters[0])
    compiled = lora._write._cache_size()
    slab = lora.write_slot(slab, 3, adapters[1])
    slab = lora.write_slot(slab, 1, adapters[1])
    slab = lora.clear_slot(slab, 1)
    assert lora._write._cache_size() == compiled, "writing another slot must not compile again"
    for name in names:
        for side in ("a", "b"):
            got = np.asarray(slab[name][side])  # [L, S, ...]
            assert not got[:, 0].any() and not got[:, 1].any(), "slot 0 and the cleared slot hold zeros"
            np.testing.assert_array_equal(got[:, 2], adapters[0][name][side])
            np.testing.assert_array_equal(got[:, 3], adapters[1][name][side])
    with pytest.raises(ValueError, match="slot 0 is the zero adapter"):
        lora.write_slot(slab, 0, adapters[0])
    with pytest.raises(ValueError, match="1..3"):
        lora.clear_slot(slab, 4)
    with pytest.raises(ValueError, match="do not fit"):
        lora.write_slot(slab, 1, {**adapters[0], "wq": {"a": np.zeros((3, 32, 4)), "b": np.zeros((3, 4, 32))}})
    assert slab["wq"]["a"].dtype == jnp.float32
