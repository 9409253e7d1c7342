"""The vision side of a vision-language model's step: its encoder and the image arrays of a batch.

`VisionEncoder` owns the tower's params and the image-embedding pool, [num_rows, hidden] on the
device (row 0: the null row text tokens point at), which the step's forward reads as
params["image_embeddings"] (jaxserve.models.llama.forward). Before a step's forward, the images
the scheduler gave rows to (`ScheduledBatch.encode`, jaxserve.core.encoder_cache) run through the
tower and projector, one call per image, and their embeddings are scattered into their rows.

Fixed shapes: Gemma 3's SigLIP takes one size; Qwen2.5-VL's tower takes an image's patches padded
to a bucket (64, 128, 256, ... patches up to the largest image one step can hold), with the
host-side index arrays of jaxserve.models.qwen_vision.vision_inputs. Each shape is one compiled
program, compiled at warm-up (`lower`) or on first use.

`add_image_arrays` / `fill_image_arrays` put a batch's image inputs into the step's arrays:
embed_rows int32[T] (each token's pool row), mrope_positions int32[3, T] (Qwen2.5-VL),
prefill_key_limit int32[prefill tokens] (Gemma 3's bidirectional image spans).
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.step import Bucket, EncodeJob, ScheduledBatch
from jaxserve.models import qwen_vision, vision


class VisionEncoder:
    """A vision-language model's tower (module qwen_vision or siglip, its config and params) and
    the image-embedding pool of `num_rows` rows of the language model's `hidden_size` in `dtype`.
    `cpu_kernels`: the tower runs on one CPU device with the C++ kernels built (its float32
    matrices then multiply in cpu_kernels.f32_matmul)."""

    def __init__(self, module, vision_config, params, *, hidden_size: int, num_rows: int, dtype,
                 max_image_tokens: int, cpu_kernels: bool = False):
        self.module, self.config, self.params = module, vision_config, params
        if cpu_kernels:  # float32 matrices in the C++ kernel's strips (vision.cpu_strips)
            self.params = vision.cpu_strips(params, module.weight_decls(vision_config))
        self.qwen = module is qwen_vision
        self.new_pool = functools.partial(jnp.zeros, (num_rows, hidden_size), dtype)
        self.pool = self.new_pool()  # [rows, D]
        self.patch_buckets = ()  # Qwen: padded patch counts of one image
        if self.qwen:
            self.patch_buckets = qwen_vision.patch_buckets(max_image_tokens, vision_config)
        self.jitted = jax.jit(functools.partial(_encode, module=module, config=vision_config))
        self._write = jax.jit(_write_rows, donate_argnums=(0,))

    def shapes(self) -> list[int]:
        """The encoder's compiled shapes: Qwen's patch buckets, or [1] (SigLIP's one size)."""
        return list(self.patch_buckets) or [1]

    def _inputs(self, image, size: int) -> dict[str, np.ndarray]:
        """The encoder's arrays for one image in the shape `size` (Qwen: padded patches)."""
        if not self.qwen:
            return {"pixels": np.asarray(image.pixel_values, np.float32)[None]}  # [1, 3, H, W]
        patches = np.zeros((size, image.pixel_values.shape[1]), np.float32)  # [N, C*T*P*P]
        patches[:len(image.pixel_values)] = image.pixel_values
        return {"patches": patches, **qwen_vision.vision_inputs([image.grid_thw], self.config, size).device_arrays()}

    def _size(self, image) -> int:
        if not self.qwen:
            return 1
        patches = len(image.pixel_values)
        return next(b for b in self.patch_buckets if b >= patches)

    def lower(self, size: int):
        """The encoder of shape `size`, lowered for the warm-up to compile."""
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.example(size))
        return self.jitted.lower(self.params, shapes)

    def example(self, size: int) -> dict[str, np.ndarray]:
        """Inputs of the shape `size` (zeros; Qwen: a grid of that many patches)."""
        if not self.qwen:
            side = self.config.image_size
            return {"pixels": np.zeros((1, 3, side, side), np.float32)}
        merge = self.config.spatial_merge_size
        grid = (1, merge, size // merge)  # any image of `size` patches has this program
        return {"patches": np.zeros((size, self.config.patch_dim), np.float32),
                **qwen_vision.vision_inputs([grid], self.config, size).device_arrays()}

    def run(self, jobs: Sequence[EncodeJob], compiled=lambda size: None) -> jax.Array:
        """Encodes each job's image into its pool rows; returns the new pool. `compiled(size)`:
        the warm-up's executable of that shape, if any (else the jitted function compiles)."""
        for job in jobs:
            size = self._size(job.image)
            encode = compiled(size) or self.jitted
            embeddings = encode(self.params, self._inputs(job.image, size))  # [rows >= tokens, D]
            rows = np.zeros(embeddings.shape[0], np.int32)  # padding rows write the null row
            rows[:len(job.rows)] = job.rows
            self.pool = self._write(self.pool, rows, embeddings)
        return self.pool


def _encode(params, inputs, *, module, config):
    """One image's token embeddings [tokens (padded), out hidden]."""
    if module is qwen_vision:
        arrays = dict(inputs)
        return module.forward(params, config, arrays.pop("patches"), **arrays)
    return module.forward(params, config, inputs["pixels"])[0]


def _write_rows(pool, rows, values):
    """pool [R, D] with rows[i] set to values[i] (padding rows go to the null row 0)."""
    return pool.at[rows].set(values.astype(pool.dtype))


def add_image_arrays(arrays: dict[str, np.ndarray], bucket: Bucket, mrope: bool, bidirectional: bool) -> None:
    """The image inputs of an all-padding batch of `bucket` (every token its own embedding)."""
    T = len(arrays["token_ids"])
    arrays["embed_rows"] = np.zeros(T, np.int32)  # [T]
    if mrope:
        arrays["mrope_positions"] = np.zeros((3, T), np.int32)  # [3, T]
    if bidirectional:
        arrays["prefill_key_limit"] = np.zeros(bucket.num_prefill_tokens, np.int32)  # [prefill tokens]


def fill_image_arrays(arrays: dict[str, np.ndarray], batch: ScheduledBatch, num_decode: int) -> None:
    """Writes the batch's image inputs (ScheduledRow.image_rows, mrope_positions, key_limits) into
    the arrays of `add_image_arrays`; decode rows at 0.., prefill tokens from `num_decode`. Rows
    without them keep their text defaults (M-RoPE: the position on all three axes)."""
    positions = arrays["positions"]
    if "mrope_positions" in arrays:
        arrays["mrope_positions"][:] = positions[None, :]
    if "prefill_key_limit" in arrays:
        arrays["prefill_key_limit"][:] = positions[num_decode:]
    spans = [(i, row) for i, row in enumerate(batch.decode)]
    offset = num_decode
    for row in batch.prefill:
        spans.append((offset, row))
        offset += len(row.token_ids)
    for t0, row in spans:
        n = len(row.token_ids)
        if row.image_rows is not None:
            arrays["embed_rows"][t0:t0 + n] = row.image_rows
        if row.mrope_positions is not None and "mrope_positions" in arrays:
            arrays["mrope_positions"][:, t0:t0 + n] = row.mrope_positions
        if row.key_limits is not None and "prefill_key_limit" in arrays and t0 >= num_decode:
            arrays["prefill_key_limit"][t0 - num_decode:t0 - num_decode + n] = row.key_limits
