"""Qwen2.5-VL's vision tower and Gemma 3's SigLIP + projector against transformers (float32).

Tiny random `Qwen2_5_VLForConditionalGeneration` / `Gemma3ForConditionalGeneration` models, every
weight random (norms and biases too), converted from their state dicts by the HF names. Qwen's
windows split the images (window_size 56 = 2 x 2 merge units, images of 4 x 6 and 3 x 2 units:
full and partial windows), with one full-attention block among window blocks; one image and two
images of different sizes go through one padded call, and the padding must not change the valid
rows. Mutations (a wrong window order, full attention everywhere, wrong patch order for SigLIP)
must move the result far past the tolerance.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import cpu_kernels
from jaxserve.models import qwen_vision, siglip, vision

pytestmark = pytest.mark.slow  # builds torch models

TOL = 1e-4
SEED = 1234


def randomize(model, seed):
    """Every parameter random (transformers starts norms at one and biases at zero)."""
    import torch
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "norm1" in name or "norm2" in name or "ln_q" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / max(1, p.shape[-1]) ** 0.5 if p.ndim > 1 else 0.1))
    return model


def numpy_state_dict(model) -> dict:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / max(np.max(np.abs(ref)), 1e-6))


# ---- Qwen2.5-VL -------------------------------------------------------------------------------

QWEN_VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=48,
                   fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2,
                   temporal_patch_size=2)
QWEN_TEXT = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=200,
                 rope_parameters={"rope_type": "default", "mrope_section": [2, 5, 5], "rope_theta": 10000.0})
GRID_A = (1, 8, 12)  # 4 x 6 merge units: 2 x 3 windows of 2 x 2
GRID_B = (1, 6, 4)  # 3 x 2 units: a full window and a partial one below it
# (2, 4, 4): two frames (a video's grid): windows and full attention stay within a frame


def make_qwen_model(seed=SEED):
    import transformers
    config = transformers.Qwen2_5_VLConfig(vision_config=QWEN_VISION, text_config=QWEN_TEXT)
    config.vision_config._attn_implementation = "eager"
    return randomize(transformers.Qwen2_5_VLForConditionalGeneration(config).eval(), seed)


@pytest.fixture(scope="module")
def qwen():
    model = make_qwen_model()
    config = qwen_vision.VisionConfig.from_hf_dict(model.config.to_dict())
    params = jax.tree.map(jnp.asarray, qwen_vision.params_from_state_dict(numpy_state_dict(model), config))
    return model, config, params


def qwen_reference(model, pixels, grids):
    import torch
    with torch.no_grad():
        out = model.model.visual(torch.from_numpy(pixels), grid_thw=torch.tensor(grids))
    return out.pooler_output.numpy()


def random_patches(config, grids, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((qwen_vision.num_patches(grids), config.patch_dim)).astype(np.float32)


def qwen_ours(params, config, pixels, grids, padded, pad_value=0.0, inputs=None, fn=None):
    inputs = inputs or qwen_vision.vision_inputs(grids, config, padded)
    padded_pixels = np.full((padded, config.patch_dim), pad_value, np.float32)
    padded_pixels[:len(pixels)] = pixels
    fn = fn or jax.jit(qwen_vision.forward, static_argnums=1)
    out = fn(params, config, padded_pixels, **inputs.device_arrays())
    assert out.shape == (padded // config.merge_unit, config.out_hidden_size)
    return np.asarray(out, np.float32), inputs


def test_config_and_weight_names(qwen):
    model, config, params = qwen
    assert config.window_patches == 16 and config.fullatt_block_indexes == (1,) and config.head_dim == 16
    names = set(model.state_dict())
    for d in qwen_vision.weight_decls(config):  # every declared tensor exists under transformers 5's names
        hf = [d.hf.format(layer=i) for i in range(config.depth)] if d.per_layer else [d.hf]
        assert all("model.visual." + n in names for n in hf), d
    assert jax.tree.map(lambda a: a.shape, params) == vision.param_shapes(qwen_vision.weight_decls(config))
    # the published checkpoints' names ("visual.") convert the same
    published = {k.removeprefix("model."): v for k, v in numpy_state_dict(model).items()}
    again = qwen_vision.params_from_state_dict(published, config)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), params, again)))


@pytest.mark.parametrize("grids,padded", [([GRID_A], 96), ([GRID_A], 128), ([GRID_A, GRID_B], 128),
                                          ([GRID_B, GRID_A], 160), ([GRID_B, (2, 4, 4)], 64)])
def test_qwen_matches_transformers(qwen, grids, padded):
    model, config, params = qwen
    pixels = random_patches(config, grids)
    ref = qwen_reference(model, pixels, grids)
    ours, inputs = qwen_ours(params, config, pixels, grids, padded, pad_value=3.0)
    assert inputs.num_tokens == ref.shape[0] == sum(inputs.tokens_per_image)
    err = rel_err(ours[:inputs.num_tokens], ref)
    print(f"qwen {grids} N={padded}: max rel err {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize("query_block", [24, 32])
def test_qwen_full_attention_in_query_blocks(qwen, monkeypatch, query_block):
    """The full-attention blocks a block of queries at a time (a block that divides N, and one
    that leaves padded query rows) give transformers' result."""
    model, config, params = qwen
    monkeypatch.setattr(qwen_vision, "QUERY_BLOCK", query_block)
    grids = [GRID_A, GRID_B]
    pixels = random_patches(config, grids)
    ref = qwen_reference(model, pixels, grids)
    fn = jax.jit(lambda *args, **kwargs: qwen_vision.forward(*args, **kwargs), static_argnums=1)  # a fresh trace
    ours, inputs = qwen_ours(params, config, pixels, grids, 128, fn=fn)
    err = rel_err(ours[:inputs.num_tokens], ref)
    print(f"qwen query block {query_block}: max rel err {err:.2e}")
    assert err < TOL


def test_qwen_padding_and_one_compile(qwen):
    """Padding rows of any value leave the valid rows unchanged, and one compiled function serves
    different images of the same padded size."""
    model, config, params = qwen
    traces = []

    def counted(*args, **kwargs):
        traces.append(1)
        return qwen_vision.forward(*args, **kwargs)

    fn = jax.jit(counted, static_argnums=1)
    grids = [GRID_A, GRID_B]
    pixels = random_patches(config, grids, seed=1)
    a, inputs = qwen_ours(params, config, pixels, grids, 160, pad_value=0.0, fn=fn)
    b, _ = qwen_ours(params, config, pixels, grids, 160, pad_value=1e3, fn=fn)
    n = inputs.num_tokens
    np.testing.assert_allclose(a[:n], b[:n], rtol=0, atol=1e-6)
    c, _ = qwen_ours(params, config, pixels[:96], [GRID_A], 160, fn=fn)  # the first image alone
    np.testing.assert_allclose(c[:24], a[:24], rtol=0, atol=1e-5)  # images do not see each other
    assert len(traces) == 1


def test_qwen_mutations_fail(qwen):
    """A wrong window order, or full attention in every block, moves the result far off."""
    model, config, params = qwen
    grids = [GRID_A, GRID_B]
    pixels = random_patches(config, grids, seed=2)
    ref = qwen_reference(model, pixels, grids)
    good = qwen_vision.vision_inputs(grids, config, 128)
    n = good.num_tokens
    # windows in processor order (no reordering) with the same segment ids
    identity = np.arange(128, dtype=np.int32)
    wrong_order = qwen_vision.VisionInputs(**{**good.__dict__, "patch_order": identity,
                                              "unit_inverse": identity[:32].copy()})
    # every block attends over the whole frame
    no_windows = qwen_vision.VisionInputs(**{**good.__dict__, "window_segments": good.frame_segments})
    # the reordering done but not undone
    not_undone = qwen_vision.VisionInputs(**{**good.__dict__, "unit_inverse": identity[:32].copy()})
    for mutant in (wrong_order, no_windows, not_undone):
        ours, _ = qwen_ours(params, config, pixels, grids, 128, inputs=mutant)
        assert rel_err(ours[:n], ref) > 100 * TOL


def test_qwen_host_inputs():
    config = qwen_vision.VisionConfig.from_hf_dict({"vision_config": QWEN_VISION})
    inputs = qwen_vision.vision_inputs([GRID_A, GRID_B], config, 128)
    assert inputs.num_tokens == 30 and inputs.tokens_per_image == (24, 6)
    assert sorted(inputs.patch_order.tolist()) == list(range(128))  # a permutation
    assert (inputs.window_segments[120:] == -1).all() and (inputs.frame_segments[120:] == -1).all()
    # every window is one contiguous run of at most window_patches rows
    seg = inputs.window_segments[:120]
    runs = np.split(seg, np.flatnonzero(np.diff(seg)) + 1)
    assert len({int(r[0]) for r in runs}) == len(runs) and max(map(len, runs)) <= config.window_patches
    assert [len(r) for r in runs] == [16] * 6 + [16, 8]  # image A: 6 full windows; image B: full + partial
    with pytest.raises(ValueError, match="more than padded_patches"):
        qwen_vision.vision_inputs([GRID_A, GRID_B], config, 116)
    with pytest.raises(ValueError, match="multiple"):
        qwen_vision.vision_inputs([GRID_A], config, 98)


def test_qwen_bfloat16(qwen):
    """bfloat16 weights run in bfloat16 and stay near the float32 reference."""
    model, config, _ = qwen
    params = jax.tree.map(jnp.asarray, qwen_vision.params_from_state_dict(
        numpy_state_dict(model), config, dtype=ml_dtypes.bfloat16))
    assert params["layers"]["qkv"].dtype == jnp.bfloat16
    grids = [GRID_A]
    pixels = random_patches(config, grids)
    ref = qwen_reference(model, pixels, grids)
    ours, inputs = qwen_ours(params, config, pixels, grids, 96)
    err = rel_err(ours[:inputs.num_tokens], ref)
    print(f"qwen bfloat16: max rel err {err:.2e}")
    assert err < 5e-2


# ---- Gemma 3: SigLIP + projector -------------------------------------------------------------

SIGLIP = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=56,
              patch_size=14, vision_use_head=False)
GEMMA_TEXT = dict(hidden_size=40, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=20, vocab_size=300)


@pytest.fixture(scope="module")
def gemma():
    import transformers
    config = transformers.Gemma3Config(vision_config=SIGLIP, text_config=GEMMA_TEXT, mm_tokens_per_image=4)
    config.vision_config._attn_implementation = "eager"
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    import torch
    torch.manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name or "multi_modal_projector" in name:
                scale = 0.5 / max(1, p.shape[-1]) ** 0.5 if p.ndim > 1 else 0.2
                p.copy_(torch.randn_like(p) * scale + (1.0 if "layer_norm" in name and name.endswith("weight")
                                                       or "post_layernorm.weight" in name else 0.0))
    vconfig = siglip.VisionConfig.from_hf_dict(config.to_dict())
    params = jax.tree.map(jnp.asarray, siglip.params_from_state_dict(numpy_state_dict(model), vconfig))
    return model, vconfig, params


def gemma_reference(model, pixels):
    import torch
    with torch.no_grad():
        out = model.model.get_image_features(torch.from_numpy(pixels))
    return out.last_hidden_state.numpy(), out.pooler_output.numpy()


def test_gemma_matches_transformers(gemma):
    model, config, params = gemma
    assert config.num_patches == 16 and config.pool_kernel == 2 and config.text_hidden_size == 40
    pixels = np.random.default_rng(0).standard_normal((2, 3, 56, 56)).astype(np.float32)
    ref_hidden, ref_tokens = gemma_reference(model, pixels)
    hidden = jax.jit(siglip.encode, static_argnums=1)(params, config, pixels)
    tokens = jax.jit(siglip.forward, static_argnums=1)(params, config, pixels)
    assert tokens.shape == (2, 4, 40) == ref_tokens.shape
    err_h, err_t = rel_err(hidden, ref_hidden), rel_err(tokens, ref_tokens)
    print(f"siglip hidden: max rel err {err_h:.2e}; gemma3 image tokens: {err_t:.2e}")
    assert err_h < TOL and err_t < TOL
    # each image on its own gives the same rows (a batch bucket's padding images change nothing)
    one = jax.jit(siglip.forward, static_argnums=1)(params, config, pixels[1:])
    np.testing.assert_allclose(np.asarray(one[0]), np.asarray(tokens[1]), rtol=0, atol=1e-5)
    # mutation: the patches read column-major
    wrong = jax.jit(siglip.forward, static_argnums=1)(params, config, np.ascontiguousarray(pixels.transpose(0, 1, 3, 2)))
    assert rel_err(wrong, ref_tokens) > 100 * TOL


def test_gemma_attention_in_query_blocks(gemma, monkeypatch):
    model, config, params = gemma
    monkeypatch.setattr(siglip, "QUERY_BLOCK", 6)  # 16 patches: 3 blocks, the last one padded
    pixels = np.random.default_rng(3).standard_normal((2, 3, 56, 56)).astype(np.float32)
    _, ref_tokens = gemma_reference(model, pixels)
    tokens = jax.jit(lambda p, x: siglip.forward(p, config, x))(params, pixels)
    err = rel_err(tokens, ref_tokens)
    print(f"gemma3 query block 6: max rel err {err:.2e}")
    assert err < TOL


def test_gemma_weight_names(gemma):
    model, config, params = gemma
    state = numpy_state_dict(model)
    # transformers 5 names -> the published checkpoints' names
    published = {}
    for k, v in state.items():
        if k.startswith("model.vision_tower."):
            published["vision_tower.vision_model." + k.removeprefix("model.vision_tower.")] = v
        elif k.startswith("model.multi_modal_projector."):
            published[k.removeprefix("model.")] = v
    again = siglip.params_from_state_dict(published, config)
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), params, again)))
    del published["multi_modal_projector.mm_input_projection_weight"]
    with pytest.raises(KeyError, match="mm_input_projection_weight"):
        siglip.params_from_state_dict(published, config)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels are not built here")
def test_both_towers_in_the_cpu_kernels_strips_match_transformers(qwen, gemma):
    """vision.cpu_strips (the engine's towers on one CPU device): every matrix a StripWeight,
    multiplied in cpu_kernels.f32_matmul, the outputs transformers' to the same tolerance."""
    model, config, params = qwen
    strips = vision.cpu_strips(params, qwen_vision.weight_decls(config))
    matrices = [d for d in qwen_vision.weight_decls(config) if d.is_matrix]
    assert len(matrices) == 8 and all(isinstance((strips["layers"] if d.per_layer else strips)[d.name],
                                                 vision.StripWeight) for d in matrices)
    pixels = random_patches(config, [GRID_A, GRID_B])
    ours, inputs = qwen_ours(strips, config, pixels, [GRID_A, GRID_B], 128)
    assert rel_err(ours[:inputs.num_tokens], qwen_reference(model, pixels, [GRID_A, GRID_B])) < TOL
    model, config, params = gemma
    strips = vision.cpu_strips(params, siglip.weight_decls(config))
    assert isinstance(strips["mm_proj"], vision.StripWeight) and not isinstance(strips["mm_norm"], vision.StripWeight)
    pixels = np.random.default_rng(1).standard_normal((1, 3, 56, 56)).astype(np.float32)
    tokens = jax.jit(siglip.forward, static_argnums=1)(strips, config, pixels)
    assert rel_err(tokens, gemma_reference(model, pixels)[1]) < TOL
