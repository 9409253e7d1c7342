"""Qwen2.5-VL's multimodal RoPE (M-RoPE) positions: three position ids per token (temporal,
height, width), on the host (numpy, no jax).

`mrope_positions` gives a prompt's positions [3, T] and its
`mrope_position_delta`, as transformers' `Qwen2_5_VLModel.get_rope_index` does for text and
images (videos are not handled: a video token is refused). Text tokens take the next integer on
all three axes. The tokens of one image (t x h x w patches merged to t x h/m x w/m tokens, m =
`spatial_merge_size`) take start + (frame, row, column) on the three axes, where start is the
position the token after the preceding text would have had; the text after the image resumes at
start + max(h, w) / m. The delta is max(position) + 1 - T: a token generated at sequence index
i (>= T) has position i + delta on all three axes (`decode_positions`).

The device side, the rotary tables of these positions, is jaxserve.models.mrope.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class MRopeConfig:
    """What M-RoPE reads from a Qwen2.5-VL config."""

    image_token_id: int
    spatial_merge_size: int
    mrope_section: tuple[int, int, int]
    video_token_id: int | None = None

    @classmethod
    def from_hf_dict(cls, config: dict) -> "MRopeConfig":
        """From a Qwen2.5-VL config.json dict: `image_token_id`, `video_token_id`,
        `vision_config.spatial_merge_size`, and `mrope_section` from the text config's
        `rope_parameters` (transformers 5) or `rope_scaling` (published checkpoints), at the top
        level or under "text_config"."""
        text = config.get("text_config", {})
        section = None
        for holder in (text, config):
            for key in ("rope_parameters", "rope_scaling"):
                section = section or (holder.get(key) or {}).get("mrope_section")
        if section is None:
            raise ValueError("no mrope_section in rope_parameters / rope_scaling")
        return cls(image_token_id=config.get("image_token_id", 151655),
                   spatial_merge_size=config.get("vision_config", {}).get("spatial_merge_size", 2),
                   mrope_section=tuple(int(s) for s in section),
                   video_token_id=config.get("video_token_id", 151656))


def mrope_positions(token_ids, image_grid_thw, config: MRopeConfig) -> tuple[np.ndarray, int]:
    """Positions [3, T] (int64) of a prompt `token_ids` [T] whose images have the grids
    `image_grid_thw` [num_images, 3] (in patches, as the image processor returns them), and the
    prompt's mrope_position_delta.

    An image is a run of t*h*w / m**2 image tokens; consecutive runs of image tokens take the
    grids in order (transformers reads one run as one image; adjacent images without a token in
    between are split here by their grids' token counts). Raises ValueError when the image
    tokens and the grids disagree, or for a video token."""
    ids = np.asarray(token_ids, np.int64).reshape(-1)
    grids = np.asarray(image_grid_thw if image_grid_thw is not None else np.zeros((0, 3)), np.int64).reshape(-1, 3)
    m = config.spatial_merge_size
    if config.video_token_id is not None and np.any(ids == config.video_token_id):
        raise ValueError("video tokens are not supported by mrope_positions")
    is_image = ids == config.image_token_id
    T = ids.shape[0]
    out = np.zeros((3, T), np.int64)
    i = image = 0
    current = 0  # the position the next text token takes
    while i < T:
        if not is_image[i]:
            j = i
            while j < T and not is_image[j]:
                j += 1
            out[:, i:j] = current + np.arange(j - i)
            current += j - i
            i = j
            continue
        if image >= len(grids):
            raise ValueError(f"more images in the prompt than the {len(grids)} grids given")
        t, h, w = grids[image].tolist()
        n = t * (h // m) * (w // m)
        if i + n > T or not is_image[i:i + n].all():
            raise ValueError(f"image {image} (grid {(t, h, w)}) needs {n} image tokens at index {i}")
        f, r, c = np.meshgrid(np.arange(t), np.arange(h // m), np.arange(w // m), indexing="ij")
        out[:, i:i + n] = current + np.stack([f.ravel(), r.ravel(), c.ravel()])
        current += max(h, w) // m
        i += n
        image += 1
    if image != len(grids):
        raise ValueError(f"{len(grids)} grids given, {image} images in the prompt")
    delta = int(out.max()) + 1 - T if T else 0
    return out, delta


def decode_positions(start: int, count: int, delta: int) -> np.ndarray:
    """Positions [3, count] of the tokens at sequence indices start .. start + count - 1 past the
    prompt (generated tokens, or text appended to a cached prompt): index + delta on all axes."""
    return np.broadcast_to(np.arange(start, start + count, dtype=np.int64) + delta, (3, count)).copy()


def section_of_frequency(mrope_section, half_dim: int) -> np.ndarray:
    """[half_dim] int: which position axis (0 temporal, 1 height, 2 width) each rotary frequency
    reads (band i of `mrope_section` reads axis i % 3)."""
    section = [int(s) for s in mrope_section]
    if sum(section) != half_dim:
        raise ValueError(f"mrope_section {section} sums to {sum(section)}, not head_dim // 2 = {half_dim}")
    return np.concatenate([np.full(s, i % 3) for i, s in enumerate(section)]).astype(np.int32)
