"""The vision tower of Qwen2.5-VL (transformers' `Qwen2_5_VisionTransformerPretrainedModel`), in
fixed shapes.

The computation: each patch the image processor cut ([C*T*P*P] values, flattened in the
Conv3d weight's (C, T, P, P) order, so the stride == kernel Conv3d is one matmul) is embedded to
`hidden_size`; 2-D rotary positions (the patch's row and column in its image) rotate q and k in
every block; the blocks (RMSNorm, attention with a fused qkv, RMSNorm, gated SiLU MLP, all with
biases) attend within windows of `window_size` pixels, except the `fullatt_block_indexes` blocks,
which attend over the whole image (frame); the patch merger (RMSNorm, then `spatial_merge_size**2`
neighbouring patches concatenated, Linear-GELU-Linear) maps every merge unit to one
`out_hidden_size` row, the embedding of one image token of the language model.

transformers reorders the sequence so that each window's patches are contiguous (its
`window_index`, a permutation of merge units), runs every block in that order and undoes the
permutation after the merger. Here all of that geometry is computed on the host, in numpy, from
`grid_thw` (`vision_inputs`) and passed to the device as index arrays of a fixed length:
  - `patch_order` [N]: the input row each position of the window-ordered sequence takes;
  - `positions` [N, 2]: the (row, column) rotary positions of that sequence;
  - `window_segments` / `frame_segments` [N]: which window / which image frame each row is in
    (the attention of window blocks / full blocks stays within a segment);
  - `unit_inverse` [N / merge**2]: the merged row each output row takes (the inverse permutation).
Pixel patches of several images are concatenated (the processor's `pixel_values` of a batch) and
padded with rows of anything to a static N (a multiple of merge**2); padding rows form their own
segment (-1), so one compiled `forward` serves any images whose patches fit N. The output is
[N / merge**2, out_hidden_size]: the first `VisionInputs.num_tokens` rows are the image tokens'
embeddings, image after image in the order of `grid_thw`; the rest is padding.

Window attention is computed in blocks: after the reordering a window is at most
`window_patches` = (window_size // patch_size)**2 contiguous rows, so a query block of that many
rows only meets keys in its own block and the two neighbours; each window block costs
O(N * 3 * window_patches) rather than O(N**2). The full-attention blocks attend over all N rows
with the frame mask, `QUERY_BLOCK` queries at a time (their float32 logits [heads, QUERY_BLOCK, N]). The blocks run under `jax.lax.scan`, which picks
the attention of each block with `jax.lax.cond` on the block's kind.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import vision
from jaxserve.models.vision import VisionWeight, attention, rms_norm

Params = dict

HF_PREFIXES = ("model.visual.", "visual.")  # transformers 5's module path, the published checkpoints'
NORM_EPS = 1e-6  # fixed in transformers' Qwen2.5-VL vision RMSNorms
# Queries per block of the full-attention blocks: [heads, QUERY_BLOCK, N] float32 logits at a time
# (16 heads x 1024 x 16384 patches: 1 GiB). Read when `forward` is traced.
QUERY_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The fields of Qwen2.5-VL's `vision_config` that change the math."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    in_channels: int = 3
    rope_theta: float = 10000.0

    @classmethod
    def from_hf_dict(cls, config: dict) -> "VisionConfig":
        """From a Qwen2.5-VL config.json dict (its "vision_config") or the vision config itself.
        Raises ValueError for an activation other than silu."""
        v = config.get("vision_config", config)
        act = v.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"vision_config.hidden_act={act!r} is not supported (silu only)")
        theta = (v.get("rope_parameters") or {}).get("rope_theta", v.get("rope_theta", 10000.0))
        return cls(depth=v["depth"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                   num_heads=v["num_heads"], out_hidden_size=v["out_hidden_size"],
                   patch_size=v.get("patch_size", 14), temporal_patch_size=v.get("temporal_patch_size", 2),
                   spatial_merge_size=v.get("spatial_merge_size", 2), window_size=v.get("window_size", 112),
                   fullatt_block_indexes=tuple(v.get("fullatt_block_indexes", (7, 15, 23, 31))),
                   in_channels=v.get("in_channels", v.get("in_chans", 3)),  # published configs: in_chans
                   rope_theta=float(theta))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merge_unit(self) -> int:
        """Patches merged into one output row."""
        return self.spatial_merge_size ** 2

    @property
    def patch_dim(self) -> int:
        """Values of one processor patch: C * T * P * P."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def window_units(self) -> int:
        """A window's side in merge units (transformers' `vit_merger_window_size`)."""
        return max(1, self.window_size // self.spatial_merge_size // self.patch_size)

    @property
    def window_patches(self) -> int:
        """The most patches one window holds."""
        return (self.window_units * self.spatial_merge_size) ** 2


def weight_decls(config: VisionConfig) -> list[VisionWeight]:
    """The tower's weights (see jaxserve.models.vision for the fields). HF names are relative to
    "model.visual." (transformers 5) or "visual." (published checkpoints)."""
    L, D, F, U = config.depth, config.hidden_size, config.intermediate_size, config.merge_unit
    blk = "blocks.{layer}."

    def layer(name, shape, hf, layout="as_is", init="normal"):
        return VisionWeight(f"layers/{name}", (L, *shape), blk + hf, layout, init)

    return [
        VisionWeight("patch_embed", (config.patch_dim, D), "patch_embed.proj.weight", "conv"),
        layer("norm1", (D,), "norm1.weight", init="ones"),
        layer("qkv", (D, 3 * D), "attn.qkv.weight", "linear"),
        layer("qkv_bias", (3 * D,), "attn.qkv.bias"),
        layer("proj", (D, D), "attn.proj.weight", "linear"),
        layer("proj_bias", (D,), "attn.proj.bias"),
        layer("norm2", (D,), "norm2.weight", init="ones"),
        layer("gate", (D, F), "mlp.gate_proj.weight", "linear"),
        layer("gate_bias", (F,), "mlp.gate_proj.bias"),
        layer("up", (D, F), "mlp.up_proj.weight", "linear"),
        layer("up_bias", (F,), "mlp.up_proj.bias"),
        layer("down", (F, D), "mlp.down_proj.weight", "linear"),
        layer("down_bias", (D,), "mlp.down_proj.bias"),
        VisionWeight("merger_norm", (D,), "merger.ln_q.weight", init="ones"),
        VisionWeight("merger_fc1", (U * D, U * D), "merger.mlp.0.weight", "linear"),
        VisionWeight("merger_fc1_bias", (U * D,), "merger.mlp.0.bias"),
        VisionWeight("merger_fc2", (U * D, config.out_hidden_size), "merger.mlp.2.weight", "linear"),
        VisionWeight("merger_fc2_bias", (config.out_hidden_size,), "merger.mlp.2.bias"),
    ]


# ---- host side ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class VisionInputs:
    """The geometry of one call, computed on the host by `vision_inputs` (numpy, fixed shapes).
    N is the padded patch count, U = spatial_merge_size**2."""

    patch_order: np.ndarray  # [N] int32: input row of each position of the window-ordered sequence
    positions: np.ndarray  # [N, 2] int32: (row, column) of each position's patch in its image
    window_segments: np.ndarray  # [N] int32: window id (-1: padding)
    frame_segments: np.ndarray  # [N] int32: image frame id (-1: padding)
    unit_inverse: np.ndarray  # [N / U] int32: merged (window-ordered) row of each output row
    num_tokens: int  # valid output rows: sum over images of t*h*w / U
    tokens_per_image: tuple[int, ...]  # output rows of each image, in grid_thw order

    def device_arrays(self) -> dict[str, np.ndarray]:
        """The arrays `forward` takes (everything but the counts)."""
        return {"patch_order": self.patch_order, "positions": self.positions,
                "window_segments": self.window_segments, "frame_segments": self.frame_segments,
                "unit_inverse": self.unit_inverse}


MIN_PATCH_ROWS = 64  # the smallest padded patch count the engine compiles the tower for


def patch_buckets(max_image_tokens: int, config: VisionConfig) -> tuple[int, ...]:
    """The padded patch counts of one image the engine compiles the tower for: 64, 128, ... up to
    the patches of an image of `max_image_tokens` tokens."""
    from jaxserve.core.step import geometric_buckets  # host code
    return geometric_buckets(MIN_PATCH_ROWS, max(max_image_tokens * config.merge_unit, MIN_PATCH_ROWS))


def num_patches(grid_thw) -> int:
    """Input rows (processor patches) of the images of `grid_thw` [num_images, 3]."""
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    return int(np.prod(grid, axis=1).sum())


def vision_inputs(grid_thw, config: VisionConfig, padded_patches: int) -> VisionInputs:
    """The index arrays of one `forward` call over the images of `grid_thw` [num_images, 3]
    (temporal, height, width in patches, as the image processor returns `image_grid_thw`), whose
    patches are the first `num_patches(grid_thw)` rows of the call's `padded_patches` rows.

    Window order as transformers' `get_vision_window_index`: image after image, frame after
    frame, windows of `window_units` x `window_units` merge units in row-major order (partial
    windows at the right and bottom edges), merge units row-major inside a window, the U patches
    of a unit kept together."""
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    m, U, wu = config.spatial_merge_size, config.merge_unit, config.window_units
    total = num_patches(grid)
    if padded_patches % U:
        raise ValueError(f"padded_patches={padded_patches} must be a multiple of spatial_merge_size**2={U}")
    if total > padded_patches:
        raise ValueError(f"the images have {total} patches, more than padded_patches={padded_patches}")
    unit_order, unit_window, unit_frame, unit_positions = [], [], [], []
    unit_base = window_base = frame_base = 0
    for t, h, w in grid.tolist():
        if h % m or w % m:
            raise ValueError(f"grid {(t, h, w)}: height and width must be multiples of spatial_merge_size={m}")
        hu, wu_ = h // m, w // m
        f, i, j = np.meshgrid(np.arange(t), np.arange(hu), np.arange(wu_), indexing="ij")  # [t, hu, wu_] each
        f, i, j = f.ravel(), i.ravel(), j.ravel()  # units in processor order (frame, row, column)
        wins_w = -(-wu_ // wu)
        window = (f * (-(-hu // wu)) + i // wu) * wins_w + j // wu  # window id within this image
        order = np.lexsort((j % wu, i % wu, window))  # window, then row, column inside it
        unit_order.append(order + unit_base)
        unit_window.append(window[order] + window_base)
        unit_frame.append(f[order] + frame_base)
        # (row, column) of the U patches of each unit, in the processor's order within the unit
        di, dj = np.divmod(np.arange(U), m)
        rows = i[order][:, None] * m + di[None, :]  # [units, U]
        cols = j[order][:, None] * m + dj[None, :]
        unit_positions.append(np.stack([rows, cols], axis=-1))  # [units, U, 2]
        unit_base += t * hu * wu_
        window_base += int(window.max()) + 1 if window.size else 0
        frame_base += t
    n_units, pad_units = unit_base, padded_patches // U - unit_base
    unit_order = np.concatenate(unit_order + [np.arange(n_units, n_units + pad_units)])  # [N/U]
    patch_order = (unit_order[:, None] * U + np.arange(U)[None, :]).reshape(-1)  # [N]
    positions = np.zeros((padded_patches, 2), np.int32)
    if n_units:
        positions[:total] = np.concatenate(unit_positions).reshape(-1, 2)
    pad = np.full(pad_units * U, -1, np.int64)
    window_segments = np.concatenate([np.repeat(np.concatenate(unit_window or [pad[:0]]), U), pad])
    frame_segments = np.concatenate([np.repeat(np.concatenate(unit_frame or [pad[:0]]), U), pad])
    return VisionInputs(patch_order=patch_order.astype(np.int32), positions=positions,
                        window_segments=window_segments.astype(np.int32),
                        frame_segments=frame_segments.astype(np.int32),
                        unit_inverse=np.argsort(unit_order, kind="stable").astype(np.int32),
                        num_tokens=n_units, tokens_per_image=tuple(int(t * h * w) // U for t, h, w in grid))


# ---- device side ----------------------------------------------------------------------------

def rotary_tables(positions: jax.Array, config: VisionConfig) -> tuple[jax.Array, jax.Array]:
    """cos, sin [N, 1, head_dim // 2] (float32) of the axial 2-D RoPE: head_dim // 4 frequencies
    over the patch's row, the same frequencies over its column (the rotation is half-split over the
    whole head_dim)."""
    spatial = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, spatial, 2, dtype=np.float32) / spatial))  # [hd/4]
    pos = positions.astype(jnp.float32)  # [N, 2]
    angles = jnp.concatenate([pos[:, :1] * inv_freq, pos[:, 1:] * inv_freq], axis=-1)  # [N, hd/2]
    return jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Half-split rotary of x [N, H, hd] in float32, cast back."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _full_attention(q, k, v, segments, scale):
    """Attention within segments (frames) over the whole sequence, QUERY_BLOCK queries at a time:
    q, k, v [N, H, hd], segments [N]."""
    return vision.blocked_attention(q, k, v, segments, scale, QUERY_BLOCK)


def _window_attention(q, k, v, segments, scale, block: int):
    """Attention within segments that are contiguous runs of at most `block` rows: query block b
    meets key blocks b-1, b, b+1 only. q, k, v [N, H, hd], segments [N] -> [N, H, hd]."""
    N, H, hd = q.shape
    nb = -(-N // block)
    extra = nb * block - N
    pad = lambda x, value: jnp.pad(x, [(0, extra)] + [(0, 0)] * (x.ndim - 1), constant_values=value)
    q, k, v, seg = pad(q, 0), pad(k, 0), pad(v, 0), pad(segments, -2)  # tail rows: segment -2, alone

    def neighbours(x, value):  # [nb * block, ...] -> [nb, 3 * block, ...]: blocks b-1, b, b+1
        xb = x.reshape(nb, block, *x.shape[1:])
        xp = jnp.pad(xb, [(1, 1)] + [(0, 0)] * (xb.ndim - 1), constant_values=value)
        return jnp.concatenate([xp[:-2], xp[1:-1], xp[2:]], axis=1)

    kb, vb, segk = neighbours(k, 0), neighbours(v, 0), neighbours(seg, -3)  # [nb, 3B, ...]
    segq = seg.reshape(nb, block)
    mask = (segq[:, :, None] == segk[:, None, :])[:, None]  # [nb, 1, B, 3B]
    out = attention(q.reshape(nb, block, H, hd), kb, vb, mask, scale)  # [nb, B, H, hd]
    return out.reshape(nb * block, H, hd)[:N]


def forward(params: Params, config: VisionConfig, patches: jax.Array, patch_order: jax.Array,
            positions: jax.Array, window_segments: jax.Array, frame_segments: jax.Array,
            unit_inverse: jax.Array) -> jax.Array:
    """The image-token embeddings of the images in `patches`.

    patches [N, C*T*P*P]: the processor's `pixel_values` of the call's images, concatenated and
    padded to N rows; the index arrays from `vision_inputs(grid_thw, config, N).device_arrays()`.
    Computes in the params' dtype (norms, rotary and softmax in float32).
    Returns [N / merge**2, out_hidden_size]; rows past `VisionInputs.num_tokens` are padding."""
    dtype = params["patch_embed"].dtype
    N, D, H, hd, U = patches.shape[0], config.hidden_size, config.num_heads, config.head_dim, config.merge_unit
    scale = hd ** -0.5
    x = vision.linear(patches[patch_order].astype(dtype), params["patch_embed"])  # [N, D], window order
    cos, sin = rotary_tables(positions, config)  # [N, 1, hd/2]
    full = np.isin(np.arange(config.depth), config.fullatt_block_indexes)  # [depth] bool (static)

    def block(x, layer):
        lp, is_full = layer
        h = rms_norm(x, lp["norm1"], NORM_EPS)
        qkv = (vision.linear(h, lp["qkv"]) + lp["qkv_bias"]).reshape(N, 3, H, hd)
        q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]  # [N, H, hd]
        out = jax.lax.cond(is_full,
                           lambda: _full_attention(q, k, v, frame_segments, scale),
                           lambda: _window_attention(q, k, v, window_segments, scale, config.window_patches))
        x = x + (vision.linear(out.reshape(N, D), lp["proj"]) + lp["proj_bias"])
        h = rms_norm(x, lp["norm2"], NORM_EPS)
        gated = jax.nn.silu(vision.linear(h, lp["gate"]) + lp["gate_bias"]) * (vision.linear(h, lp["up"]) + lp["up_bias"])  # [N, F]
        return x + (vision.linear(gated, lp["down"]) + lp["down_bias"]), None

    x, _ = jax.lax.scan(block, x, (params["layers"], jnp.asarray(full)))
    h = rms_norm(x, params["merger_norm"], NORM_EPS).reshape(N // U, U * D)  # one row per merge unit
    h = jax.nn.gelu(vision.linear(h, params["merger_fc1"]) + params["merger_fc1_bias"], approximate=False)
    merged = vision.linear(h, params["merger_fc2"]) + params["merger_fc2_bias"]  # [N/U, out], window order
    return merged[unit_inverse]


def params_from_state_dict(state_dict, config: VisionConfig, dtype=np.float32) -> Params:
    """The tower's params (numpy, `dtype`) from a Qwen2_5_VLForConditionalGeneration state dict
    (tensors under "model.visual." or "visual."; the rest is ignored)."""
    return vision.params_from_state_dict(weight_decls(config), state_dict, HF_PREFIXES, dtype)
