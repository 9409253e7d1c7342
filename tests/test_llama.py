"""The Flax Llama over the paged cache against Hugging Face transformers (float32)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints.convert import convert_checkpoint
from checkpoints.load import load_config, load_params
from jaxserve.config import ModelConfig
from jaxserve.models import llama, weights
from tests.tiny_models import hf_logits, make_tiny_hf_model, prefill_batch

pytestmark = pytest.mark.slow  # the forward against transformers: out of `make test-quick`


def test_direct_mapping_equals_the_converter(tmp_path):
    """The test's own HF -> pytree mapping (below) agrees with the converter's."""
    model = make_tiny_hf_model(str(tmp_path / "hf"), num_q_heads=6, num_kv_heads=2)
    convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "converted"))
    config = load_config(str(tmp_path / "converted"))
    converted = load_params(str(tmp_path / "converted"), jnp.float32)
    jax.tree.map(np.testing.assert_array_equal, converted, hf_to_params(model, config))


def hf_to_params(model, config: ModelConfig):
    """Direct mapping of the HF state dict, independent of the converter."""
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    L = config.num_layers
    stack = lambda fmt, t=True: np.stack([sd[fmt.format(i)].T if t else sd[fmt.format(i)] for i in range(L)])
    p = "model.layers.{}."
    params = {
        "embed": sd["model.embed_tokens.weight"],
        "final_norm": sd["model.norm.weight"],
        "layers": {
            "attn_norm": stack(p + "input_layernorm.weight", False),
            "mlp_norm": stack(p + "post_attention_layernorm.weight", False),
            "wq": stack(p + "self_attn.q_proj.weight"), "wk": stack(p + "self_attn.k_proj.weight"),
            "wv": stack(p + "self_attn.v_proj.weight"), "wo": stack(p + "self_attn.o_proj.weight"),
            "w_gate": stack(p + "mlp.gate_proj.weight"), "w_up": stack(p + "mlp.up_proj.weight"),
            "w_down": stack(p + "mlp.down_proj.weight"),
        },
    }
    if not config.tie_word_embeddings:
        params["lm_head"] = sd["lm_head.weight"].T
    return jax.tree.map(jnp.asarray, params)


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("num_q_heads,num_kv_heads,tie,rope_scaling", [
    (4, 4, False, None), (6, 2, True, None), (8, 2, False, LLAMA3_SCALING)])
def test_forward_matches_transformers(tmp_path, num_q_heads, num_kv_heads, tie, rope_scaling):
    model = make_tiny_hf_model(str(tmp_path / "hf"), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                               tie=tie, rope_scaling=rope_scaling)
    convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "converted"))
    config = load_config(str(tmp_path / "converted"))
    assert config.tie_word_embeddings == tie
    assert (config.rope_scaling is not None) == (rope_scaling is not None)
    params = load_params(str(tmp_path / "converted"), jnp.float32)
    seed = 0
    rng = np.random.default_rng(seed)
    page_size, max_pages = 8, 8
    lengths = [1, 7, 8, 9, 40]
    batch, token_ids, num_pages = prefill_batch(lengths, page_size, max_pages, config.vocab_size, rng)
    cache = llama.init_kv_cache(config, llama.KVCacheSpec(num_pages, page_size), jnp.float32)
    logits, _ = jax.jit(lambda p, c, b: llama.forward(p, c, b, config=config))(params, cache, batch)
    logits = np.asarray(logits)
    start = 0
    for ids, n in zip(token_ids, lengths):
        expected = hf_logits(model, ids[None])[0]
        got = logits[start:start + n]
        start += n
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max(),
                                   err_msg=f"seed {seed}")


def test_rope_scaling_changes_frequencies():
    base = dict(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_q_heads=4,
                num_kv_heads=4, head_dim=16)
    plain = ModelConfig(**base).rope_inv_freq()
    scaled = ModelConfig(**base, rope_scaling=LLAMA3_SCALING).rope_inv_freq()
    assert scaled[0] == pytest.approx(plain[0])  # high frequencies untouched
    assert scaled[-1] == pytest.approx(plain[-1] / 8.0)  # low frequencies divided by the factor


def test_flax_module_declares_the_param_tree():
    config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=3,
                         num_q_heads=4, num_kv_heads=2, head_dim=4, tie_word_embeddings=False)
    params = weights.random_params(config)
    shapes = jax.tree.map(lambda x: tuple(x.shape), params)
    assert shapes == weights.param_shapes(config)
    layers = shapes["layers"]
    assert layers["wq"] == (3, 16, 16) and layers["wk"] == (3, 16, 8) and layers["wo"] == (3, 16, 16)
    assert layers["w_down"] == (3, 24, 16) and shapes["lm_head"] == (16, 32) and shapes["embed"] == (32, 16)
