"""jaxserve.multimodal.image_processing against transformers' slow (PIL) image processors and its
processors' prompt expansion: seeded random images of many sizes; pixel values within 1e-5
(they come out bitwise equal), grids, token counts and token ids equal."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from jaxserve.multimodal import image_processing as ip
from jaxserve.multimodal.media import MediaError, decode_image

SEED = 20240611
# (height, width): tiny, odd, square, very wide, very tall, large enough to shrink
SIZES = [(1, 1), (2, 3), (13, 7), (37, 53), (224, 224), (101, 509), (8, 1500), (1200, 9), (700, 1100)]

# Published preprocessor_config.json files (Qwen/Qwen2.5-VL-7B-Instruct, google/gemma-3-4b-it).
QWEN25_VL_PREPROCESSOR = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}
GEMMA3_PREPROCESSOR = {
    "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": 256,
    "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None, "processor_class": "Gemma3Processor", "resample": 2,
    "rescale_factor": 0.00392156862745098, "size": {"height": 896, "width": 896}}


def random_image(rng: np.random.Generator, height: int, width: int, mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)  # [H, W, C]
    return Image.fromarray(pixels[..., 0] if channels == 1 else pixels, mode)


def write_folder(path, model_type, preprocessor, processor=None, config_extra=None):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type, **(config_extra or {})}))
    (path / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    if processor is not None:
        (path / "processor_config.json").write_text(json.dumps(processor))
    return path


def hf_qwen(**kwargs):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(**kwargs)


def hf_gemma3(**kwargs):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    return Gemma3ImageProcessorPil(**kwargs)


@pytest.mark.parametrize("max_pixels", [28 * 28 * 64, 28 * 28 * 1280])
def test_qwen_pixel_values_grids_and_tokens_equal_transformers(max_pixels):
    rng = np.random.default_rng(SEED)
    ours = ip.QwenVLImageProcessor(min_pixels=3136, max_pixels=max_pixels)
    theirs = hf_qwen(min_pixels=3136, max_pixels=max_pixels)
    for height, width in SIZES:
        image = random_image(rng, height, width)
        where = f"seed {SEED}, {width}x{height}, max_pixels {max_pixels}"
        ref = theirs(image, return_tensors="np")
        got = ours.process(image)
        assert got.grid_thw == tuple(ref["image_grid_thw"][0]), where
        assert got.pixel_values.shape == ref["pixel_values"].shape, where
        assert got.pixel_values.dtype == np.float32
        np.testing.assert_allclose(got.pixel_values, ref["pixel_values"], atol=1e-5, rtol=0, err_msg=where)
        expected_tokens = theirs.get_number_of_image_patches(height, width) // 4
        assert got.num_tokens == ours.num_tokens(height, width) == expected_tokens, where
        assert got.num_tokens == int(np.prod(ref["image_grid_thw"][0])) // 4, where


def test_gemma3_pixel_values_equal_transformers():
    rng = np.random.default_rng(SEED)
    ours = ip.Gemma3ImageProcessor(height=96, width=96)
    theirs = hf_gemma3(size={"height": 96, "width": 96})
    for height, width in SIZES:
        image = random_image(rng, height, width)
        ref = theirs(image, return_tensors="np")
        got = ours.process(image)
        assert ref["num_crops"][0] == 0
        assert got.pixel_values.shape == (3, 96, 96) and got.num_tokens == 256
        np.testing.assert_allclose(got.pixel_values, ref["pixel_values"][0], atol=1e-5, rtol=0,
                                   err_msg=f"seed {SEED}, {width}x{height}")


@pytest.mark.parametrize("mode", ["RGBA", "L", "P"])
def test_decoded_images_convert_to_rgb_as_transformers(mode):
    """decode_image's RGB (transparency on white) is what transformers' do_convert_rgb makes."""
    import io
    rng = np.random.default_rng(SEED)
    image = random_image(rng, 45, 61, "RGBA" if mode == "RGBA" else "L")
    if mode == "P":
        image = random_image(rng, 45, 61).convert("P")
        image.info["transparency"] = 3
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    decoded = decode_image(buffer.getvalue(), "image 1 of message 1")
    assert decoded.mode == "RGB"
    ref = hf_qwen()(Image.open(io.BytesIO(buffer.getvalue())), return_tensors="np")
    for ours in (decoded, Image.open(io.BytesIO(buffer.getvalue()))):  # decoded, or converted by process()
        np.testing.assert_allclose(ip.QwenVLImageProcessor().process(ours).pixel_values, ref["pixel_values"],
                                   atol=1e-5, rtol=0, err_msg=f"seed {SEED}, mode {mode}")


def test_model_folders_read_like_auto_image_processor(tmp_path):
    """load_image_processor on published configs equals AutoImageProcessor(use_fast=False)."""
    from transformers import AutoImageProcessor
    rng = np.random.default_rng(SEED)
    qwen = write_folder(tmp_path / "qwen", "qwen2_5_vl", QWEN25_VL_PREPROCESSOR)
    gemma = write_folder(tmp_path / "gemma", "gemma3", GEMMA3_PREPROCESSOR, {"image_seq_length": 256},
                         {"mm_tokens_per_image": 256})
    ours_qwen, ours_gemma = ip.load_image_processor(qwen), ip.load_image_processor(gemma)
    assert isinstance(ours_qwen, ip.QwenVLImageProcessor) and ours_qwen.max_pixels == 12845056
    assert isinstance(ours_gemma, ip.Gemma3ImageProcessor) and (ours_gemma.height, ours_gemma.mm_tokens_per_image) == (896, 256)
    theirs_qwen = AutoImageProcessor.from_pretrained(qwen, use_fast=False)
    theirs_gemma = AutoImageProcessor.from_pretrained(gemma, use_fast=False)
    for height, width in [(37, 53), (300, 410)]:
        image = random_image(rng, height, width)
        where = f"seed {SEED}, {width}x{height}"
        ref = theirs_qwen(image, return_tensors="np")
        got = ours_qwen.process(image)
        assert got.grid_thw == tuple(ref["image_grid_thw"][0]), where
        np.testing.assert_allclose(got.pixel_values, ref["pixel_values"], atol=1e-5, rtol=0, err_msg=where)
        np.testing.assert_allclose(ours_gemma.process(image).pixel_values, theirs_gemma(image, return_tensors="np")
                                   ["pixel_values"][0], atol=1e-5, rtol=0, err_msg=where)


def test_model_folder_refusals(tmp_path):
    with pytest.raises(ValueError, match="not model_type 'llava'"):
        ip.load_image_processor(write_folder(tmp_path / "llava", "llava", {"image_processor_type": "CLIPImageProcessor"}))
    with pytest.raises(ValueError, match="pan-and-scan"):
        ip.load_image_processor(write_folder(tmp_path / "pas", "gemma3", {**GEMMA3_PREPROCESSOR, "do_pan_and_scan": True}))
    with pytest.raises(ValueError, match="mm_tokens_per_image"):
        ip.load_image_processor(write_folder(tmp_path / "odd", "gemma3", GEMMA3_PREPROCESSOR, {"image_seq_length": 256},
                                             {"mm_tokens_per_image": 64}))
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="no preprocessor_config.json"):
        ip.load_image_processor(tmp_path / "text")


def test_qwen_refuses_an_aspect_ratio_over_200():
    with pytest.raises(MediaError, match="aspect ratio"):
        ip.QwenVLImageProcessor().process(Image.new("RGB", (201 * 2, 2)))


# ---- the prompt expansion, token for token against transformers' processors ------------------

SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
                  "<start_of_image>", "<end_of_image>", "<image_soft_token>", "<bos>"]


def tiny_tokenizer(extra_special_tokens=None):
    """A byte-level BPE trained on a few lines (so "\\n\\n" and friends merge), with the models'
    image tokens as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["user\nhello world\n\n what is in this picture?\n\n\n\n describe them\n"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, extra_special_tokens=extra_special_tokens or {})


@pytest.fixture
def no_processor_class_check(monkeypatch):
    """transformers' processors check their parts' classes through registries that want
    torchvision's video processor; the image side does not need it."""
    from transformers.processing_utils import ProcessorMixin
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)


def test_qwen_prompt_expansion_equals_qwen2_5_vl_processor(no_processor_class_check):
    from transformers import Qwen2_5_VLProcessor
    tokenizer = tiny_tokenizer()
    rng = np.random.default_rng(SEED)
    images = [random_image(rng, h, w) for h, w in [(37, 53), (8, 1500), (224, 224)]]
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    text = f"user\n{image}hello world\n\n{image}{image} what is in this picture?\n"
    processor = Qwen2_5_VLProcessor(image_processor=hf_qwen(max_pixels=28 * 28 * 64), tokenizer=tokenizer)
    ref = processor(text=[text], images=images, return_tensors="np")
    ours = ip.QwenVLImageProcessor(max_pixels=28 * 28 * 64)
    processed = [ours.process(im) for im in images]
    expanded = ip.expand_prompt(text, ours, [p.num_tokens for p in processed])
    assert tokenizer(expanded)["input_ids"] == ref["input_ids"][0].tolist(), f"seed {SEED}"
    np.testing.assert_allclose(np.concatenate([p.pixel_values for p in processed]), ref["pixel_values"], atol=1e-5, rtol=0)
    assert [p.grid_thw for p in processed] == [tuple(g) for g in ref["image_grid_thw"]]


def test_gemma3_prompt_expansion_equals_gemma3_processor(no_processor_class_check):
    from transformers import Gemma3Processor
    tokenizer = tiny_tokenizer({"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                "image_token": "<image_soft_token>"})
    rng = np.random.default_rng(SEED)
    images = [random_image(rng, h, w) for h, w in [(37, 53), (64, 64)]]
    text = "<bos>user\n<start_of_image>\n\nhello world<start_of_image> describe them\n"
    processor = Gemma3Processor(image_processor=hf_gemma3(size={"height": 32, "width": 32}), tokenizer=tokenizer,
                                image_seq_length=256)
    ref = processor(text=[text], images=[images], return_tensors="np")
    ours = ip.Gemma3ImageProcessor(height=32, width=32)
    expanded = ip.expand_prompt(text, ours, [256, 256])
    assert expanded.count("<image_soft_token>") == 512
    assert tokenizer(expanded)["input_ids"] == ref["input_ids"][0].tolist()
    np.testing.assert_allclose(np.stack([ours.process(im).pixel_values for im in images]), ref["pixel_values"],
                               atol=1e-5, rtol=0, err_msg=f"seed {SEED}")


def test_expand_prompt_refuses_a_placeholder_count_that_is_not_the_image_count():
    with pytest.raises(MediaError, match="2 image placeholder"):
        ip.expand_prompt("<|image_pad|> and <|image_pad|>", ip.QwenVLImageProcessor(), [4])


def test_a_folder_saved_by_transformers_processor_reads_the_same(tmp_path, no_processor_class_check):
    """transformers 5 saves the image processor's settings inside processor_config.json."""
    from transformers import Gemma3Processor
    gemma_tokenizer = tiny_tokenizer({"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                      "image_token": "<image_soft_token>"})
    Gemma3Processor(image_processor=hf_gemma3(size={"height": 48, "width": 64}, resample=3), tokenizer=gemma_tokenizer,
                    image_seq_length=16).save_pretrained(tmp_path / "gemma")
    hf_qwen(min_pixels=1000, max_pixels=50_000).save_pretrained(tmp_path / "qwen")  # its processor wants a video one
    for name, model_type in [("gemma", "gemma3"), ("qwen", "qwen2_5_vl")]:
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": model_type}))
    gemma = ip.load_image_processor(tmp_path / "gemma")
    assert (gemma.height, gemma.width, gemma.resample, gemma.mm_tokens_per_image) == (48, 64, 3, 16)
    qwen = ip.load_image_processor(tmp_path / "qwen")
    assert (qwen.min_pixels, qwen.max_pixels, qwen.resample, qwen.image_mean) == (1000, 50_000, 3, ip.OPENAI_CLIP_MEAN)
