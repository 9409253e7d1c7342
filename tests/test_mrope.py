"""M-RoPE (jaxserve.models.mrope) against transformers' Qwen2.5-VL: the positions and delta of
`get_rope_index` for prompts with 0, 1 and 2 images of different grids, the cos/sin tables of its
rotary embedding and their application to q and k, and the 1-D RoPE table for text positions."""
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models import llama
from jaxserve.models.mrope import mrope_tables
from jaxserve.multimodal import mrope

pytestmark = pytest.mark.slow  # builds a torch model

IMAGE, START, END = 151655, 151652, 151653  # Qwen2.5-VL's image pad, vision start and end tokens
SECTION = [2, 5, 5]  # head_dim 24: bands of unequal width
TEXT = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=200,
            rope_parameters={"rope_type": "default", "mrope_section": SECTION, "rope_theta": 10000.0})
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=48,
              spatial_merge_size=2)


@pytest.fixture(scope="module")
def model():
    import transformers
    config = transformers.Qwen2_5_VLConfig(vision_config=VISION, text_config=TEXT)
    return transformers.Qwen2_5_VLForConditionalGeneration(config).eval()


def prompt(pieces) -> list[int]:
    """Text ids (ints) and images (grid tuples) -> token ids, each image as
    <vision_start> image tokens <vision_end>."""
    ids = []
    for piece in pieces:
        if isinstance(piece, tuple):
            t, h, w = piece
            ids += [START] + [IMAGE] * (t * h * w // 4) + [END]
        else:
            ids += [5 + (piece + i) % 50 for i in range(piece)]
    return ids


PROMPTS = {
    "text only": [7],
    "one image": [3, (1, 6, 4), 5],
    "two images": [4, (1, 8, 12), 2, (1, 4, 10), 3],
    "image first": [(1, 10, 6), 6],
}


@pytest.mark.parametrize("name", PROMPTS)
def test_positions_match_get_rope_index(model, name):
    import torch
    pieces = PROMPTS[name]
    ids = prompt(pieces)
    grids = [p for p in pieces if isinstance(p, tuple)]
    input_ids = torch.tensor([ids])
    ref_pos, ref_delta = model.model.get_rope_index(
        input_ids, mm_token_type_ids=(input_ids == IMAGE).int(),
        image_grid_thw=torch.tensor(grids) if grids else None)
    config = mrope.MRopeConfig.from_hf_dict(model.config.to_dict())
    assert config.image_token_id == IMAGE and config.mrope_section == tuple(SECTION)
    pos, delta = mrope.mrope_positions(ids, grids, config)
    np.testing.assert_array_equal(pos, ref_pos[:, 0].numpy())
    assert delta == int(ref_delta[0, 0])
    if not grids:
        assert delta == 0 and (pos == np.arange(len(ids))).all()
    # tokens after the prompt
    after = mrope.decode_positions(len(ids), 3, delta)
    assert after.shape == (3, 3) and (after[:, 0] == pos.max() + 1).all()


def test_position_errors():
    config = mrope.MRopeConfig(image_token_id=IMAGE, spatial_merge_size=2, mrope_section=(2, 5, 5),
                               video_token_id=151656)
    ids = prompt([2, (1, 4, 4), 2])
    with pytest.raises(ValueError, match="more images"):
        mrope.mrope_positions(ids, [], config)
    with pytest.raises(ValueError, match="needs 6 image tokens"):
        mrope.mrope_positions(ids, [(1, 4, 6)], config)
    with pytest.raises(ValueError, match="2 grids given, 1 images"):
        mrope.mrope_positions(ids, [(1, 4, 4), (1, 4, 4)], config)
    with pytest.raises(ValueError, match="video"):
        mrope.mrope_positions(ids + [151656], [(1, 4, 4)], config)
    # two adjacent images split by their grids' token counts
    pos, _ = mrope.mrope_positions([IMAGE] * 10, [(1, 4, 4), (1, 4, 6)], config)
    assert pos[:, :4].tolist() == [[0] * 4, [0, 0, 1, 1], [0, 1, 0, 1]]
    assert pos[:, 4:].tolist() == [[2] * 6, [2, 2, 2, 3, 3, 3], [2, 3, 4, 2, 3, 4]]


def inv_freq(model):
    return model.model.language_model.rotary_emb.inv_freq.numpy()


def test_tables_match_transformers(model):
    import torch
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf
    ids = prompt(PROMPTS["two images"])
    config = mrope.MRopeConfig.from_hf_dict(model.config.to_dict())
    pos, _ = mrope.mrope_positions(ids, [(1, 8, 12), (1, 4, 10)], config)
    T = pos.shape[1]
    rotary = model.model.language_model.rotary_emb
    x = torch.zeros(1, T, 48)
    ref_cos, ref_sin = rotary(x, torch.from_numpy(pos)[:, None, :])  # [1, T, hd]
    cos, sin = mrope_tables(jnp.asarray(pos, jnp.int32), inv_freq(model), SECTION)  # [T, 1, hd/2]
    full = lambda c: np.concatenate([np.asarray(c[:, 0])] * 2, axis=-1)
    np.testing.assert_allclose(full(cos), ref_cos[0].numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(full(sin), ref_sin[0].numpy(), rtol=0, atol=1e-6)
    # the rotation of q and k as the text model's attention applies it
    rng = np.random.default_rng(0)
    q = rng.standard_normal((T, 2, 24)).astype(np.float32)  # [T, heads, hd]
    k = rng.standard_normal((T, 1, 24)).astype(np.float32)
    ref_q, ref_k = hf.apply_rotary_pos_emb(torch.from_numpy(q).transpose(0, 1)[None], torch.from_numpy(k).transpose(0, 1)[None],
                                           ref_cos, ref_sin)  # [1, heads, T, hd]
    ours_q, ours_k = llama.apply_rope(jnp.asarray(q), cos, sin), llama.apply_rope(jnp.asarray(k), cos, sin)
    err = max(np.max(np.abs(np.asarray(ours_q) - ref_q[0].transpose(0, 1).numpy())),
              np.max(np.abs(np.asarray(ours_k) - ref_k[0].transpose(0, 1).numpy())))
    print(f"M-RoPE q/k rotation: max abs err {err:.2e}")
    assert err < 1e-5
    # mutation: the bands in another order move the rotation off
    wrong_cos, wrong_sin = mrope_tables(pos, inv_freq(model), [5, 5, 2])
    assert np.max(np.abs(np.asarray(llama.apply_rope(jnp.asarray(q), wrong_cos, wrong_sin)) - np.asarray(ours_q))) > 1e-2


def test_text_positions_give_the_1d_table(model):
    positions = np.arange(37) + 5
    cos, sin = mrope_tables(np.stack([positions] * 3), inv_freq(model), SECTION)
    ref_cos, ref_sin = llama.rope_tables(jnp.asarray(positions), inv_freq(model))
    np.testing.assert_array_equal(np.asarray(cos), np.asarray(ref_cos))
    np.testing.assert_array_equal(np.asarray(sin), np.asarray(ref_sin))
    with pytest.raises(ValueError, match="sums to"):
        mrope_tables(np.stack([positions] * 3), inv_freq(model), [2, 5, 4])
