"""A prompt's images as the engine takes them: where each image's tokens are, what the encoder
reads, and what the language model's positions and attention need (host side, numpy only).

The server and `jaxserve generate` preprocess images (jaxserve.multimodal.image_processing),
expand the prompt's placeholders and tokenize it; `prompt_images` then finds each image's run of
image tokens in the token ids and builds the request's `MultimodalInputs`:
- `ImageInput`s: the span [offset, offset + num_tokens) of the prompt the image's embeddings
  replace, the encoder's inputs, and a content hash (the encoder cache's key, and what the prefix
  cache folds into the keys of the pages holding the image: two prompts that differ only in an
  image share no page from that image on);
- Qwen2.5-VL: the prompt's M-RoPE positions [3, T] and delta (jaxserve.models.mrope);
- Gemma 3: `bidirectional`: an image's tokens attend to each other both ways (the attention's
  key_limit operand).
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Sequence

import numpy as np

from jaxserve.multimodal import mrope

QWEN_ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"
GEMMA3_ARCHITECTURE = "Gemma3ForConditionalGeneration"


@dataclasses.dataclass(frozen=True, eq=False)
class ImageInput:
    """One image of a prompt: its tokens are prompt positions offset .. offset + num_tokens - 1."""
    content_hash: bytes  # 16 bytes: the processed pixels, their shape and grid
    offset: int
    num_tokens: int
    pixel_values: np.ndarray  # float32, the image processor's (ProcessedImage.pixel_values)
    grid_thw: tuple[int, int, int] | None = None  # Qwen's patch grid; None for Gemma 3

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    @property
    def hash_value(self) -> int:
        """The hash as a negative int64 (what the prefix cache's page keys hold at the image's
        positions in place of the placeholder token ids, which are never negative)."""
        return -1 - (int.from_bytes(self.content_hash[:8], "little") >> 1)


@dataclasses.dataclass(frozen=True, eq=False)
class MultimodalInputs:
    """A request's images, in prompt order (spans disjoint and increasing)."""
    images: tuple[ImageInput, ...]
    mrope_positions: np.ndarray | None = None  # int32 [3, prompt tokens] (Qwen2.5-VL), else None
    mrope_delta: int = 0  # a token at index i >= prompt tokens has position i + delta on every axis
    bidirectional: bool = False  # Gemma 3: an image's tokens see each other both ways

    @property
    def num_image_tokens(self) -> int:
        return sum(image.num_tokens for image in self.images)

    def span_at(self, position: int) -> ImageInput | None:
        """The image whose span holds prompt position `position`, or None."""
        return next((image for image in self.images if image.offset <= position < image.end), None)

    def prefix_key_ids(self, token_ids: Sequence[int]) -> list[int]:
        """`token_ids` (the request's, from position 0) with every image position holding its
        image's hash value: the ids the prefix cache hashes into page keys."""
        ids = list(token_ids)
        for image in self.images:
            if image.offset >= len(ids):
                break
            ids[image.offset:min(image.end, len(ids))] = [image.hash_value] * (min(image.end, len(ids)) - image.offset)
        return ids


def content_hash(pixel_values: np.ndarray, grid_thw: tuple[int, int, int] | None) -> bytes:
    """16-byte blake2b of the processed pixels (dtype, shape, bytes) and the grid."""
    values = np.ascontiguousarray(pixel_values)
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{values.dtype.str}{values.shape}{grid_thw}".encode())
    digest.update(values.tobytes())
    return digest.digest()


def image_spans(token_ids: Sequence[int], image_token_id: int, token_counts: Sequence[int]) -> list[int]:
    """The offsets of the images' token runs in `token_ids`: image i takes `token_counts[i]`
    consecutive image tokens, the runs in order (adjacent images split by their counts).
    ValueError when the image tokens and the counts disagree."""
    ids = np.asarray(token_ids, np.int64)
    positions = np.flatnonzero(ids == image_token_id)
    if len(positions) != sum(token_counts):
        raise ValueError(f"the prompt has {len(positions)} image tokens where its {len(token_counts)} image(s) "
                         f"need {sum(token_counts)}: image tokens may not be written in the text")
    offsets, used = [], 0
    for count in token_counts:
        run = positions[used:used + count]
        if count and run[-1] - run[0] != count - 1:
            raise ValueError("an image's tokens are not one consecutive run: image tokens may not be written "
                             "in the text")
        offsets.append(int(run[0]) if count else 0)
        used += count
    return offsets


def prompt_images(token_ids: Sequence[int], images: Sequence, config) -> MultimodalInputs:
    """The `MultimodalInputs` of a tokenized prompt whose images are `images`
    (image_processing.ProcessedImage, in prompt order) for the model of `config` (a ModelConfig
    with multimodal_architecture). ValueError when the prompt's image tokens do not match them."""
    if not config.multimodal_architecture:
        raise ValueError(f"{config.architecture} is a text model: it takes no images")
    counts = [image.num_tokens for image in images]
    offsets = image_spans(token_ids, config.image_token_id, counts)
    inputs = tuple(ImageInput(content_hash(image.pixel_values, image.grid_thw), offset, image.num_tokens,
                              image.pixel_values, image.grid_thw) for image, offset in zip(images, offsets))
    if config.multimodal_architecture == QWEN_ARCHITECTURE:
        rope = mrope.MRopeConfig(image_token_id=config.image_token_id,
                                 spatial_merge_size=int(config.vision_config.get("spatial_merge_size", 2)),
                                 mrope_section=tuple(config.mrope_section), video_token_id=config.video_token_id)
        positions, delta = mrope.mrope_positions(token_ids, [image.grid_thw for image in images], rope)
        return MultimodalInputs(inputs, positions.astype(np.int32), delta)
    return MultimodalInputs(inputs, bidirectional=config.multimodal_architecture == GEMMA3_ARCHITECTURE)


def text_positions(inputs: MultimodalInputs | None, start: int, stop: int) -> np.ndarray | None:
    """M-RoPE positions [3, stop - start] of sequence indices start .. stop - 1 (prompt positions
    from the prompt's table, later ones index + delta), or None without M-RoPE."""
    if inputs is None or inputs.mrope_positions is None:
        return None
    prompt = inputs.mrope_positions
    num_prompt = prompt.shape[1]
    head = prompt[:, start:min(stop, num_prompt)]
    if stop <= num_prompt:
        return head
    tail = mrope.decode_positions(max(start, num_prompt), stop - max(start, num_prompt), inputs.mrope_delta)
    return np.concatenate([head, tail.astype(np.int32)], axis=1)
