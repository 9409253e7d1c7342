"""Conversion and loading of the vision-language checkpoints Qwen2.5-VL and Gemma 3 (issue 53).

Tiny random `Qwen2_5_VLForConditionalGeneration` / `Gemma3ForConditionalGeneration` models (every
weight random: norms, biases and the projector too), saved by transformers with their image
processors in three tensor layouts: what `save_pretrained` writes by default (the published names:
Qwen's `model.*` + `visual.*`, Gemma's `language_model.model.*` + `vision_tower.*`), transformers
5's own (`save_original_format=False`: `model.language_model.*`, `model.visual.*`, ...), and for
Gemma the published `vision_tower.vision_model.*`. Converted by `convert_checkpoint`, then:
- text-only logits through the XLA path (llama.forward) equal transformers' logits of the VLM
  (float32, 1e-4 as tests/test_model_families.py);
- the vision params and the image processor loaded from the converted directory give
  transformers' image embeddings for one image (qwen_vision.forward / siglip.forward);
- `--quantization` quantizes the language model only; the config round-trips;
- what cannot be served is refused by name (unknown architectures, a VLM config without its
  vision section, M-RoPE fields that do not fit, a tower activation, pan-and-scan), and a video
  token in a prompt is refused by M-RoPE's positions from the converted config.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from checkpoints import ConversionError
from checkpoints.convert import convert_checkpoint
from checkpoints.load import ModelSource, load_image_processor, load_params, load_vision_params
from jaxserve.config import ConfigError, ModelConfig
from jaxserve.models import llama, qwen_vision, siglip
from jaxserve.multimodal import mrope
from tests.tiny_models import prefill_batch
from tests.tiny_vlms import randomize

pytestmark = pytest.mark.slow  # builds torch models, converts them

SEED = 1234
TOL = 1e-4
QWEN_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=48,
                   fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2,
                   temporal_patch_size=2)
QWEN_TEXT = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=200, max_position_embeddings=256, rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "default", "mrope_section": [2, 5, 5], "rope_theta": 10000.0})
SIGLIP = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=56,
              patch_size=14, vision_use_head=False)
GEMMA_TEXT = dict(hidden_size=40, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=20, vocab_size=300, max_position_embeddings=256,
                  query_pre_attn_scalar=20, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
QWEN_PROCESSOR = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 12)


def make_qwen():
    import transformers
    config = transformers.Qwen2_5_VLConfig(vision_config=QWEN_VISION, text_config=QWEN_TEXT)
    config.vision_config._attn_implementation = "eager"
    return randomize(transformers.Qwen2_5_VLForConditionalGeneration(config).eval(), gemma=False)


def make_gemma():
    import transformers
    config = transformers.Gemma3Config(vision_config=SIGLIP, text_config=GEMMA_TEXT, mm_tokens_per_image=4)
    config.vision_config._attn_implementation = "eager"
    return randomize(transformers.Gemma3ForConditionalGeneration(config).eval(), gemma=True)


def save_processor(family: str, folder) -> None:
    if family == "qwen":
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
        Qwen2VLImageProcessorPil(**QWEN_PROCESSOR).save_pretrained(folder)
    else:
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
        Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(folder)


def save_published_gemma(model, folder) -> None:
    """The layout of the published Gemma 3 checkpoints (`vision_tower.vision_model.*`), written
    from the model's state dict."""
    from safetensors.numpy import save_file
    renames = (("model.language_model.", "language_model.model."), ("model.vision_tower.vision_model.",
               "vision_tower.vision_model."), ("model.vision_tower.", "vision_tower.vision_model."),
               ("model.multi_modal_projector.", "multi_modal_projector."))
    tensors = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight":  # tied
            continue
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        tensors[name] = value.detach().float().numpy().copy()
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    model.config.save_pretrained(folder)


LAYOUTS = [("qwen", "published"), ("qwen", "transformers5"), ("gemma", "published"), ("gemma", "transformers5"),
           ("gemma", "vision_model")]


@pytest.fixture(scope="module")
def models():
    return {"qwen": make_qwen(), "gemma": make_gemma()}


@pytest.fixture(scope="module", params=LAYOUTS, ids=["-".join(p) for p in LAYOUTS])
def converted(request, models, tmp_path_factory):
    """(family, torch model, converted directory) of each layout."""
    family, layout = request.param
    model = models[family]
    root = tmp_path_factory.mktemp(f"{family}-{layout}")
    hf = root / "hf"
    if layout == "vision_model":
        save_published_gemma(model, hf)
    else:
        model.save_pretrained(hf, save_original_format=layout == "published")
    save_processor(family, hf)
    names = json.loads((hf / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (hf / "model.safetensors").read_bytes()[:8], "little")])
    expected_prefix = {("qwen", "published"): "visual.", ("qwen", "transformers5"): "model.visual.",
                       ("gemma", "published"): "vision_tower.", ("gemma", "transformers5"): "model.vision_tower.",
                       ("gemma", "vision_model"): "vision_tower.vision_model."}[request.param]
    assert any(n.startswith(expected_prefix) for n in names), sorted(names)[:8]  # the layout under test
    config = convert_checkpoint(str(hf), str(root / "converted"))
    return family, model, str(root / "converted"), config


def test_converted_folder_and_config(converted):
    family, model, out, config = converted
    assert set(os.listdir(out)) - {"generation_config.json"} == {
        "config.json", "jaxserve.json", "params", "preprocessor_config.json", "vision"}
    source = ModelSource.open(out)
    assert source.config == config == ModelConfig.from_hf_dict(json.loads(json.dumps(config.to_hf_dict())))
    assert source.marker["vision"] == {"architecture": type(model).__name__, "dtype": "float32",
                                       "has_image_processor": True}
    if family == "qwen":
        assert config.architecture == "Qwen2ForCausalLM" and config.attention_bias
        assert config.mrope_section == (2, 5, 5)
        assert (config.image_token_id, config.image_start_token_id, config.image_end_token_id,
                config.video_token_id) == (151655, 151652, 151653, 151656)
        assert config.mm_tokens_per_image is None
    else:
        assert config.architecture == "Gemma3ForCausalLM" and config.tie_word_embeddings
        assert config.mrope_section is None and config.layer_windows() == [4, 0]
        assert (config.image_token_id, config.image_start_token_id, config.image_end_token_id) == (
            262144, 255999, 256000)
        assert config.mm_tokens_per_image == 4
    assert config.vision_config["hidden_size"] == 32


def test_text_only_logits_match_transformers(converted):
    import torch
    family, model, out, _ = converted
    config = ModelSource.open(out).config
    params = load_params(out, jnp.float32)
    rng = np.random.default_rng(SEED)
    page_size, max_pages = 4, 4
    batch, token_ids, num_pages = prefill_batch([7, 5], page_size, max_pages, 150, rng)
    kv = llama.init_kv_cache(config, llama.KVCacheSpec(num_pages=num_pages, page_size=page_size), jnp.float32)
    logits, _ = jax.jit(lambda p, k, b: llama.forward(p, k, b, config=config, backend="xla"))(
        params, kv, {k: jnp.asarray(v) for k, v in batch.items()})
    logits, start = np.asarray(logits), 0
    for ids in token_ids:
        with torch.no_grad():
            expected = model(input_ids=torch.as_tensor(ids[None], dtype=torch.long)).logits[0].float().numpy()
        got = logits[start:start + len(ids)]
        start += len(ids)
        np.testing.assert_allclose(got, expected, rtol=TOL, atol=TOL * np.abs(expected).max(),
                                   err_msg=f"{family}, seed {SEED}")


def rel_err(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / max(np.max(np.abs(ref)), 1e-6))


def test_image_embeddings_match_transformers(converted):
    """One image through the converted image processor and vision params equals transformers' image
    features of the same pixel values."""
    import torch
    from PIL import Image
    family, model, out, _ = converted
    source = ModelSource.open(out)
    module, vision_config = source.vision_tower()
    params = load_vision_params(out)
    assert jax.tree.leaves(params)[0].dtype == jnp.float32
    processor = load_image_processor(out)
    image = Image.fromarray(np.random.default_rng(SEED).integers(0, 256, (70, 100, 3), dtype=np.uint8))
    processed = processor.process(image)
    if family == "qwen":
        assert module is qwen_vision
        grid = [processed.grid_thw]
        n = qwen_vision.num_patches(grid)
        padded = -(-n // vision_config.merge_unit) * vision_config.merge_unit + vision_config.merge_unit
        pixels = np.zeros((padded, vision_config.patch_dim), np.float32)
        pixels[:n] = processed.pixel_values
        inputs = qwen_vision.vision_inputs(grid, vision_config, padded)
        ours = jax.jit(qwen_vision.forward, static_argnums=1)(params, vision_config, pixels, **inputs.device_arrays())
        ours = np.asarray(ours)[:inputs.num_tokens]
        assert inputs.num_tokens == processed.num_tokens
        with torch.no_grad():
            ref = model.model.visual(torch.from_numpy(processed.pixel_values), grid_thw=torch.tensor(grid))
        ref = ref.pooler_output.numpy()
    else:
        assert module is siglip and vision_config.mm_tokens_per_image == processed.num_tokens == 4
        pixels = processed.pixel_values[None]
        ours = np.asarray(jax.jit(siglip.forward, static_argnums=1)(params, vision_config, pixels))
        with torch.no_grad():
            ref = model.model.get_image_features(torch.from_numpy(pixels)).pooler_output.numpy()
    assert ours.shape == ref.shape
    err = rel_err(ours, ref)
    print(f"{family}: image embeddings max rel err {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize("family", ["qwen", "gemma"])
def test_quantization_applies_to_the_language_model_only(family, models, tmp_path):
    model = models[family]
    model.save_pretrained(tmp_path / "hf")
    save_processor(family, tmp_path / "hf")
    convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "q"), quantization="int8")
    convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "f"))
    quantized, floating = ModelSource.open(str(tmp_path / "q")), ModelSource.open(str(tmp_path / "f"))
    assert quantized.quantization and "wq" in quantized.quantization
    assert quantized.marker["vision"]["dtype"] == "float32"
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))),
                        quantized.load_vision_params(), floating.load_vision_params())
    assert all(jax.tree.leaves(same))


def test_bfloat16_conversion_keeps_the_vision_params_in_bfloat16(models, tmp_path):
    models["gemma"].save_pretrained(tmp_path / "hf")
    save_processor("gemma", tmp_path / "hf")
    convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "out"), dtype="bfloat16")
    params = load_vision_params(str(tmp_path / "out"))
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    assert load_vision_params(str(tmp_path / "out"), jnp.float32)["mm_proj"].dtype == jnp.float32


# ---- refusals ----------------------------------------------------------------------------------

def qwen_config_dict() -> dict:
    import transformers
    config = transformers.Qwen2_5_VLConfig(vision_config=QWEN_VISION, text_config=QWEN_TEXT).to_dict()
    return {**json.loads(json.dumps(config)), "architectures": ["Qwen2_5_VLForConditionalGeneration"]}


@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(architectures=["Qwen2VLForConditionalGeneration"]), "unsupported architecture"),
    (lambda c: c.update(architectures=["LlavaForConditionalGeneration"]), "unsupported architecture"),
    (lambda c: c.update(architectures=["Qwen3VLForConditionalGeneration"]), "unsupported architecture"),
    (lambda c: c.pop("vision_config"), "without a vision_config"),
    (lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[2, 5, 6]), "mrope_section"),
    (lambda c: c["text_config"]["rope_parameters"].pop("mrope_section"), "mrope_section"),
    (lambda c: c["text_config"]["rope_parameters"].update(mrope_interleaved=True), "mrope_interleaved"),
    (lambda c: c["text_config"]["rope_parameters"].update(rope_type="yarn", factor=4.0), "yarn"),
    (lambda c: c["text_config"].update(partial_rotary_factor=0.5), "partial_rotary_factor"),
])
def test_config_fields_that_cannot_be_served_are_refused(edit, message):
    config = qwen_config_dict()
    ModelConfig.from_hf_dict(config)  # as made: accepted
    edit(config)
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(config)


def test_mrope_section_on_a_text_model_is_refused():
    text = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 32, "hidden_size": 24, "intermediate_size": 24,
            "num_hidden_layers": 1, "num_attention_heads": 1, "rope_scaling": {"type": "mrope",
                                                                               "mrope_section": [4, 4, 4]}}
    with pytest.raises(ConfigError, match="mrope_section is not supported for Qwen2ForCausalLM"):
        ModelConfig.from_hf_dict(text)


def test_published_flat_qwen_config_reads_as_transformers_5s():
    """The published Qwen2.5-VL config.json: the language model's fields at the top level and
    rope_scaling {"type": "mrope", ...}; the same config as transformers 5's nested form."""
    nested = qwen_config_dict()
    flat = {**{k: v for k, v in nested.items() if k != "text_config"}, **nested["text_config"],
            "architectures": nested["architectures"], "model_type": "qwen2_5_vl",
            "rope_scaling": {"type": "mrope", "mrope_section": [2, 5, 5]}, "rope_theta": 10000.0}
    flat.pop("rope_parameters")
    assert ModelConfig.from_hf_dict(flat) == ModelConfig.from_hf_dict(nested)


@pytest.mark.parametrize("family,edit,message", [
    ("qwen", lambda c: c["vision_config"].update(hidden_act="gelu"), "hidden_act"),
    ("gemma", lambda c: c["vision_config"].update(hidden_act="relu"), "hidden_act"),
    ("gemma", lambda c: c.update(mm_tokens_per_image=9), "mm_tokens_per_image"),
    ("qwen", lambda c: c["vision_config"].update(out_hidden_size=40), "out_hidden_size|output size"),
])
def test_conversion_refuses_a_vision_config_the_tower_cannot_compute(family, edit, message, models, tmp_path):
    models[family].save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))
    with pytest.raises((ConversionError, ConfigError), match=message):
        convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_conversion_refuses_pan_and_scan_and_stray_vision_tensors(models, tmp_path):
    from safetensors.numpy import load_file, save_file
    models["gemma"].save_pretrained(tmp_path / "hf")
    save_processor("gemma", tmp_path / "hf")
    path = tmp_path / "hf" / "preprocessor_config.json"
    processor = json.loads(path.read_text())
    path.write_text(json.dumps({**processor, "do_pan_and_scan": True}))
    with pytest.raises(ConversionError, match="pan-and-scan"):
        convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "out"))
    path.write_text(json.dumps(processor))
    weights = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({**tensors, "vision_tower.encoder.layers.7.mlp.fc1.weight": np.zeros((2, 2), np.float32)},
              str(weights))
    with pytest.raises(ConversionError, match="unexpected tensor 'vision_tower.encoder.layers.7"):
        convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_a_video_token_is_refused_from_the_converted_config(models, tmp_path):
    """Videos are not supported: the converted config keeps Qwen's video token id, so M-RoPE's
    positions refuse a prompt holding one rather than reading it as text."""
    models["qwen"].save_pretrained(tmp_path / "hf")
    config = convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "out"))
    assert not ModelSource.open(str(tmp_path / "out")).marker["vision"]["has_image_processor"]
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    rope = mrope.MRopeConfig.from_hf_dict(hf)
    assert rope.mrope_section == config.mrope_section and rope.video_token_id == config.video_token_id
    positions, _ = mrope.mrope_positions([5, 6, 7], None, rope)
    assert positions.tolist() == [[0, 1, 2]] * 3
    with pytest.raises(ValueError, match="video"):
        mrope.mrope_positions([5, config.video_token_id, 7], None, rope)
    with pytest.raises(ConversionError, match="image processor"):
        load_image_processor(str(tmp_path / "out"))


def test_a_text_model_has_no_vision(tmp_path):
    from tests.tiny_models import make_tiny_hf_model
    make_tiny_hf_model(str(tmp_path / "hf"))
    convert_checkpoint(str(tmp_path / "hf"), str(tmp_path / "out"))
    source = ModelSource.open(str(tmp_path / "out"))
    assert source.config.multimodal_architecture is None and "vision" not in source.marker
    assert "vision_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    with pytest.raises(ConversionError, match="text model"):
        source.load_vision_params()
    with pytest.raises(ConversionError, match="text model"):
        source.load_image_processor()
