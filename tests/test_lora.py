"""Multi-LoRA against transformers + peft (the update's kernels: tests/test_lora_kernels.py).

A tiny random Llama (GQA) gets three random adapters made by peft itself (get_peft_model, then
random lora_B so that each adapter changes the logits: checked), of ranks 4, 8 and 16 and three
target sets (attention only; all-linear with rsLoRA; the MLP of one layer). One step of
jaxserve's forward over a batch whose sequences each use another adapter, or none, gives every
sequence the logits transformers + peft give it alone (float32). Quantized base weights (int8,
int4): the reference is peft over the dequantized weights.
"""
import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.convert import convert_checkpoint
from checkpoints.load import load_config, load_params
from checkpoints.lora_adapter import load_adapter
from jaxserve.models import cpu_layout, llama, lora, quantization
from tests.tiny_models import hf_logits, make_tiny_hf_model, prefill_batch

pytestmark = pytest.mark.slow  # torch, peft and the Pallas kernel in interpret mode in a whole step

SEED = 20261205
MAX_LORAS, MAX_RANK = 3, 16
ADAPTERS = [  # slot: (rank, alpha, LoraConfig fields)
    (8, 16, dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
    (16, 8, dict(target_modules="all-linear", use_rslora=True)),
    (4, 4, dict(target_modules=["gate_proj", "up_proj", "down_proj"], layers_to_transform=[1])),
]
SEQUENCE_SLOTS = [0, 1, 2, 3, 2, 0, 1]  # each sequence's adapter slot (0: the base model)
LENGTHS = [5, 9, 1, 12, 7, 3, 16]


def make_adapters(base, folder, seed: int) -> list:
    """peft models of `base` (deep copies), one per ADAPTERS entry, each saved under folder/<slot>."""
    import torch
    from peft import LoraConfig, get_peft_model
    models = []
    for slot, (rank, alpha, fields) in enumerate(ADAPTERS, start=1):
        torch.manual_seed(seed + slot)
        model = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=alpha, **fields)).eval()
        with torch.no_grad():  # peft starts B at zero (a no-op adapter): make it change the output
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.1 * torch.randn_like(p))
        model.save_pretrained(str(folder / str(slot)), safe_serialization=True)
        models.append(model)
    return models


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora")
    base = make_tiny_hf_model(str(folder / "hf"), seed=SEED % 1000, num_q_heads=4, num_kv_heads=2)
    convert_checkpoint(str(folder / "hf"), str(folder / "converted"))
    config = load_config(str(folder / "converted"))
    params = load_params(str(folder / "converted"), jnp.float32)
    peft_models = make_adapters(base, folder, SEED)
    slab = lora.init_slab(config, MAX_LORAS, MAX_RANK)
    shapes = lora.projection_shapes(config)
    for slot in range(1, MAX_LORAS + 1):
        adapter = load_adapter(str(folder / str(slot)), config, MAX_RANK)
        slab = lora.write_slot(slab, slot, adapter.padded(MAX_RANK, tuple(slab), shapes, config.num_layers))
    return dict(base=base, config=config, params=params, peft=peft_models, slab=slab, folder=folder)


def run_forward(params, slab, config, backend, seed):
    """jaxserve's logits of every sequence of a seeded prefill batch (each its SEQUENCE_SLOTS
    adapter) -> (logits per sequence, token ids per sequence)."""
    rng = np.random.default_rng([SEED, seed])
    batch, token_ids, num_pages = prefill_batch(LENGTHS, 8, 4, config.vocab_size, rng)
    batch["lora_slots"] = np.repeat(np.asarray(SEQUENCE_SLOTS, np.int32), LENGTHS)
    cache = llama.init_kv_cache(config, llama.KVCacheSpec(num_pages, 8), jnp.float32)
    step = jax.jit(lambda p, c, b, s: llama.forward(p, c, b, config=config, backend=backend, lora=s))
    logits, _ = step(params, cache, batch, slab)
    ends = np.cumsum(LENGTHS)
    return np.split(np.asarray(logits), ends[:-1]), token_ids


def check_against_peft(got, token_ids, base, peft_models, seed, atol_scale=1e-4):
    for i, (logits, ids, slot) in enumerate(zip(got, token_ids, SEQUENCE_SLOTS)):
        expected = hf_logits(base if slot == 0 else peft_models[slot - 1], ids[None])[0]
        np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=atol_scale * np.abs(expected).max(),
                                   err_msg=f"sequence {i} (slot {slot}), seed {seed}")


def test_every_adapter_changes_the_output(setup):
    ids = np.random.default_rng([SEED, 1]).integers(0, setup["config"].vocab_size, (1, 12))
    base = hf_logits(setup["base"], ids)
    for slot, model in enumerate(setup["peft"], start=1):
        assert np.abs(hf_logits(model, ids) - base).max() > 1e-2, f"adapter {slot} is a no-op (seed {SEED})"


@pytest.mark.parametrize("backend", ["xla", "reference", "interpret"])
def test_mixed_adapters_in_one_batch_match_peft(setup, backend):
    seed = 2
    got, token_ids = run_forward(setup["params"], setup["slab"], setup["config"], backend, seed)
    check_against_peft(got, token_ids, setup["base"], setup["peft"], seed)


def test_a_step_of_base_rows_only_is_the_base_models(setup):
    """Every row on slot 0 (the update skipped on the CPU): the logits of the step without a slab."""
    config, params = setup["config"], setup["params"]
    batch, _, num_pages = prefill_batch(LENGTHS, 8, 4, config.vocab_size, np.random.default_rng([SEED, 5]))
    cache = llama.init_kv_cache(config, llama.KVCacheSpec(num_pages, 8), jnp.float32)
    base, _ = jax.jit(lambda p, c, b: llama.forward(p, c, b, config=config, backend="xla"))(params, cache, batch)
    batch["lora_slots"] = np.zeros(sum(LENGTHS), np.int32)
    step = jax.jit(lambda p, c, b, s: llama.forward(p, c, b, config=config, backend="xla", lora=s))
    with_slab, _ = step(params, cache, batch, setup["slab"])
    np.testing.assert_array_equal(np.asarray(with_slab), np.asarray(base), err_msg=f"seed {SEED}")


def test_the_cpu_layer_views_read_the_slab_too(setup):
    """On one CPU device the step reads float32 layers in the C++ kernel's strips, at the layer index."""
    views = cpu_layout.layer_views(setup["params"], int8_activations=False)
    assert isinstance(views["layers"]["wq"], quantization.StripMatrix), "expected the kernel's strips on the CPU"
    got, token_ids = run_forward(views, setup["slab"], setup["config"], "xla", 3)
    check_against_peft(got, token_ids, setup["base"], setup["peft"], 3)


def dequantized_hf_models(setup, quantized):
    """The base model over the dequantized weights of `quantized`, and peft's adapters (loaded
    from their folders) over copies of it."""
    import torch
    from peft import PeftModel
    layers = quantization.dequantize_params(quantized)["layers"]
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    base = copy.deepcopy(setup["base"])
    with torch.no_grad():
        for name, module in names.items():
            for layer in range(setup["config"].num_layers):
                weight = np.asarray(layers[name][layer], np.float32).T  # [out, in] as torch stores it
                base.get_parameter(f"model.layers.{layer}.{module}.weight").copy_(torch.from_numpy(weight.copy()))
    adapters = [PeftModel.from_pretrained(copy.deepcopy(base), str(setup["folder"] / str(slot))).eval()
                for slot in range(1, MAX_LORAS + 1)]
    return base, adapters


@pytest.mark.parametrize("views", [False, True], ids=["stacked", "cpu-views"])
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_base_weights(setup, quant, views):
    """The LoRA arrays stay float over quantized base weights: stacked, or in the CPU step's
    per-layer views (cpu_layout.layer_views with float activations: exact dequantization)."""
    quantized = quantization.quantize_params(setup["params"], quant, setup["config"])
    base, peft_models = dequantized_hf_models(setup, quantized)
    seed = 4
    params = cpu_layout.layer_views(quantized, int8_activations=False) if views else quantized
    got, token_ids = run_forward(params, setup["slab"], setup["config"], "xla", seed)
    check_against_peft(got, token_ids, base, peft_models, seed)
