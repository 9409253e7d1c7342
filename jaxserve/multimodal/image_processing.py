"""An image -> the arrays and prompt tokens a vision-language model expects (numpy and PIL only).

Equal to transformers' PIL image processors (`Qwen2VLImageProcessor` and `Gemma3ImageProcessor`
with `use_fast=False`; tests/test_image_processing.py compares them), step by step: PIL resize of
the RGB uint8 image, rescale in float64 then float32, normalize in float32 (channels first).

- Qwen2-VL / Qwen2.5-VL: `smart_resize` to multiples of patch_size * merge_size within
  [min_pixels, max_pixels], then patches laid out as transformers does: `pixel_values`
  [grid_h * grid_w, 3 * temporal_patch_size * patch_size**2] (one image is one temporal step,
  repeated temporal_patch_size times), `grid_thw` (1, grid_h, grid_w), and
  grid_h * grid_w / merge_size**2 image tokens.
- Gemma 3: resize to the configured size, `pixel_values` [3, H, W], `mm_tokens_per_image` tokens
  (256); pan-and-scan is refused.

`expand_prompt` is the processors' prompt rule: each image placeholder the chat template wrote is
replaced by the image's tokens, in the text, before tokenizing (as transformers does, so the
tokenizer sees the same string). `load_image_processor` reads a Hugging Face model folder.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

import numpy as np
from PIL import Image

from jaxserve.multimodal.media import MediaError, to_rgb

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
BICUBIC, BILINEAR = 3, 2  # PIL's resample codes, as preprocessor_config.json writes them
QWEN_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")
GEMMA3_MODEL_TYPE = "gemma3"


@dataclasses.dataclass(frozen=True)
class ProcessedImage:
    """One image ready for the vision encoder."""
    pixel_values: np.ndarray  # float32; Qwen: [grid_t*grid_h*grid_w, C*t_patch*patch*patch], Gemma 3: [3, H, W]
    num_tokens: int  # how many placeholder tokens the image takes in the prompt
    grid_thw: tuple[int, int, int] | None = None  # Qwen's (grid_t, grid_h, grid_w); None for Gemma 3


def rescale_and_normalize(image: Image.Image, rescale_factor: float | None,
                          mean: tuple[float, ...] | None, std: tuple[float, ...] | None) -> np.ndarray:
    """An RGB image -> float32 [3, H, W]: x * rescale_factor (computed in float64, as transformers),
    then (x - mean) / std per channel in float32. None skips a step."""
    pixels = np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)  # [3, H, W]
    values = (pixels.astype(np.float64) * rescale_factor if rescale_factor is not None else pixels).astype(np.float32)
    if mean is not None:
        mean32 = np.asarray(mean, dtype=np.float32)[:, None, None]
        std32 = np.asarray(std, dtype=np.float32)[:, None, None]
        values = (values - mean32) / std32
    return values


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: both sides multiples of `factor`, the area within
    [min_pixels, max_pixels], the aspect ratio kept as closely as that allows (its rounding:
    Python's round, then floor when too large, ceil when too small)."""
    if max(height, width) / min(height, width) > 200:
        raise MediaError(f"the image's aspect ratio is over 200 ({width}x{height})")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclasses.dataclass(frozen=True)
class QwenVLImageProcessor:
    """Qwen2-VL / Qwen2.5-VL's image processor (transformers' Qwen2VLImageProcessor, PIL backend)."""
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: int = BICUBIC
    do_resize: bool = True
    rescale_factor: float | None = 1 / 255  # None: do_rescale off
    image_mean: tuple[float, ...] | None = OPENAI_CLIP_MEAN  # None: do_normalize off
    image_std: tuple[float, ...] | None = OPENAI_CLIP_STD
    image_placeholder: str = "<|image_pad|>"  # what the chat template writes, and each token repeats

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after resizing."""
        if not self.do_resize:
            return height, width
        return smart_resize(height, width, self.patch_size * self.merge_size, self.min_pixels, self.max_pixels)

    def num_tokens(self, height: int, width: int) -> int:
        """Image tokens for an image of this size, without processing it."""
        h, w = self.target_size(height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size ** 2

    def process(self, image: Image.Image) -> ProcessedImage:
        """A PIL image (converted to RGB first, as transformers' do_convert_rgb) -> its patches,
        grid and token count."""
        image = image if image.mode == "RGB" else to_rgb(image)
        height, width = image.height, image.width
        h, w = self.target_size(height, width)
        factor = self.patch_size * self.merge_size
        if h % factor or w % factor:
            raise MediaError(f"the image is {width}x{height}, not a multiple of {factor} (resizing is off)")
        if (h, w) != (height, width):
            image = image.resize((w, h), resample=self.resample)
        values = rescale_and_normalize(image, self.rescale_factor, self.image_mean, self.image_std)  # [C, h, w]
        patches = self.patchify(values)
        grid = (1, h // self.patch_size, w // self.patch_size)
        return ProcessedImage(patches, grid[1] * grid[2] // self.merge_size ** 2, grid)

    def patchify(self, values: np.ndarray) -> np.ndarray:
        """[C, H, W] -> [gh*gw, C*t*p*p]: rows ordered by merge block (block row, block column),
        then position inside the block; each row is (channel, temporal copy, patch row, column)."""
        c, height, width = values.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = height // p, width // p
        blocks = values.reshape(c, gh // m, m, p, gw // m, m, p)  # [C, bh, mh, ph, bw, mw, pw]
        blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)  # [bh, bw, mh, mw, C, ph, pw]
        repeated = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))  # [.., C, t, ph, pw]
        return np.ascontiguousarray(repeated.reshape(gh * gw, c * t * p * p), dtype=np.float32)


@dataclasses.dataclass(frozen=True)
class Gemma3ImageProcessor:
    """Gemma 3's image processor (transformers' Gemma3ImageProcessor, PIL backend), no pan-and-scan."""
    height: int = 224
    width: int = 224
    resample: int = BILINEAR
    do_resize: bool = True
    rescale_factor: float | None = 1 / 255
    image_mean: tuple[float, ...] | None = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] | None = (0.5, 0.5, 0.5)
    mm_tokens_per_image: int = 256
    image_placeholder: str = "<start_of_image>"  # the chat template's boi token
    image_token: str = "<image_soft_token>"
    end_of_image: str = "<end_of_image>"

    def num_tokens(self, height: int, width: int) -> int:
        return self.mm_tokens_per_image

    def process(self, image: Image.Image) -> ProcessedImage:
        """A PIL image (converted to RGB first) -> pixel_values [3, height, width] float32."""
        image = image if image.mode == "RGB" else to_rgb(image)
        if self.do_resize and (image.height, image.width) != (self.height, self.width):
            image = image.resize((self.width, self.height), resample=self.resample)
        return ProcessedImage(rescale_and_normalize(image, self.rescale_factor, self.image_mean, self.image_std),
                              self.mm_tokens_per_image)


ImageProcessor = QwenVLImageProcessor | Gemma3ImageProcessor


def image_replacement(processor: ImageProcessor, num_tokens: int) -> str:
    """What one image placeholder of the chat-templated text becomes (transformers' processors):
    Qwen: `<|image_pad|>` * num_tokens (the template's <|vision_start|> and <|vision_end|> stay
    around it); Gemma 3: "\\n\\n<start_of_image>" + "<image_soft_token>" * num_tokens +
    "<end_of_image>\\n\\n"."""
    if isinstance(processor, QwenVLImageProcessor):
        return processor.image_placeholder * num_tokens
    return (f"\n\n{processor.image_placeholder}{processor.image_token * num_tokens}"
            f"{processor.end_of_image}\n\n")


def expand_prompt(text: str, processor: ImageProcessor, token_counts: list[int]) -> str:
    """The chat-templated prompt with its i-th image placeholder replaced by image i's tokens.
    The placeholders must be exactly one per image (a user's text holding a placeholder string
    counts too, and is refused by this check)."""
    pieces = text.split(processor.image_placeholder)
    if len(pieces) - 1 != len(token_counts):
        raise MediaError(f"the prompt has {len(pieces) - 1} image placeholder(s) "
                         f"({processor.image_placeholder}) for {len(token_counts)} image(s)")
    out = [pieces[0]]
    for count, piece in zip(token_counts, pieces[1:]):
        out += [image_replacement(processor, count), piece]
    return "".join(out)


def image_token_counts(sizes: list[tuple[int, int]], labels: list[str], processor: ImageProcessor) -> list[int]:
    """How many prompt tokens each image of these (width, height) will take (media.image_size reads
    them from the header): a request's length checked before any image is decoded."""
    return [_labelled(label, processor.num_tokens, height, width) for (width, height), label in zip(sizes, labels)]


def process_images(images: list[Image.Image], labels: list[str], processor: ImageProcessor) -> list[ProcessedImage]:
    """Each image through `processor`; a refusal names its image ("image 2 of message 1: ...")."""
    return [_labelled(label, processor.process, image) for image, label in zip(images, labels)]


def _labelled(label: str, function, *args):
    try:
        return function(*args)
    except MediaError as e:
        raise MediaError(f"{label}: {e}") from None


# ---- reading a model folder ----------------------------------------------------------------------

def load_image_processor(model_dir: str | pathlib.Path) -> ImageProcessor:
    """The image processor of a Hugging Face model folder: the model type from config.json
    (model_type, else preprocessor_config.json's image_processor_type), the settings from
    preprocessor_config.json and processor_config.json. Raises ValueError for a model type
    without image support here, or a setting this code does not implement."""
    folder = pathlib.Path(model_dir)
    config = _read_json(folder / "config.json")
    processor_config = _read_json(folder / "processor_config.json")
    image_config = _read_json(folder / "preprocessor_config.json") or processor_config.get("image_processor") or {}
    if not image_config:
        raise ValueError(f"{folder}: no preprocessor_config.json: not a vision-language model folder")
    image_config = {k: v for k, v in image_config.items() if v is not None}  # null: the default
    model_type = config.get("model_type") or _type_from_processor(image_config.get("image_processor_type", ""))
    if model_type in QWEN_MODEL_TYPES:
        return qwen_vl_processor(image_config)
    if model_type == GEMMA3_MODEL_TYPE:
        return gemma3_processor(image_config, processor_config, config)
    raise ValueError(f"{folder}: image input is supported for {', '.join(QWEN_MODEL_TYPES + (GEMMA3_MODEL_TYPE,))}, "
                     f"not model_type {model_type!r}")


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    value = json.loads(path.read_text())
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object")
    return value


def _type_from_processor(name: str) -> str | None:
    return {"Qwen2VLImageProcessor": "qwen2_vl", "Qwen2VLImageProcessorPil": "qwen2_vl",
            "Gemma3ImageProcessor": "gemma3", "Gemma3ImageProcessorPil": "gemma3"}.get(name)


def _common(c: dict[str, Any], default_mean, default_std, default_resample: int) -> dict[str, Any]:
    """The settings both processors share; do_convert_rgb is always on here (decode_image)."""
    mean = tuple(c.get("image_mean", default_mean))
    std = tuple(c.get("image_std", default_std))
    return {"resample": int(c.get("resample", default_resample)),
            "do_resize": bool(c.get("do_resize", True)),
            "rescale_factor": float(c.get("rescale_factor", 1 / 255)) if c.get("do_rescale", True) else None,
            "image_mean": mean if c.get("do_normalize", True) else None,
            "image_std": std if c.get("do_normalize", True) else None}


def qwen_vl_processor(c: dict[str, Any]) -> QwenVLImageProcessor:
    """From preprocessor_config.json's fields (min_pixels / max_pixels override size's
    shortest_edge / longest_edge, as transformers)."""
    size = dict(c.get("size") or {})
    min_pixels = c.get("min_pixels", size.get("shortest_edge", 56 * 56))
    max_pixels = c.get("max_pixels", size.get("longest_edge", 28 * 28 * 1280))
    return QwenVLImageProcessor(min_pixels=int(min_pixels), max_pixels=int(max_pixels),
                                patch_size=int(c.get("patch_size", 14)),
                                temporal_patch_size=int(c.get("temporal_patch_size", 2)),
                                merge_size=int(c.get("merge_size", 2)),
                                **_common(c, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, BICUBIC))


def gemma3_processor(c: dict[str, Any], processor_config: dict[str, Any],
                     config: dict[str, Any]) -> Gemma3ImageProcessor:
    """From preprocessor_config.json, with the tokens per image from processor_config.json's
    image_seq_length or config.json's mm_tokens_per_image (which must agree when both are there)."""
    if c.get("do_pan_and_scan"):
        raise ValueError("Gemma 3's pan-and-scan (do_pan_and_scan) is not supported")
    size = c.get("size") or {"height": 224, "width": 224}
    if "height" not in size or "width" not in size:
        raise ValueError(f"Gemma 3's image size must be {{'height': H, 'width': W}}, not {size}")
    seq = processor_config.get("image_seq_length", c.get("image_seq_length"))
    per_image = config.get("mm_tokens_per_image")
    if seq is not None and per_image is not None and int(seq) != int(per_image):
        raise ValueError(f"image_seq_length {seq} (processor config) differs from mm_tokens_per_image "
                         f"{per_image} (config.json)")
    tokens = int(seq if seq is not None else per_image if per_image is not None else 256)
    return Gemma3ImageProcessor(height=int(size["height"]), width=int(size["width"]), mm_tokens_per_image=tokens,
                                **_common(c, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), BILINEAR))
