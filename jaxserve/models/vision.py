"""What the vision towers share: their weight declarations, the Hugging Face state-dict mapping,
and the small layers both use.

The towers themselves are `jaxserve.models.qwen_vision` (Qwen2.5-VL's windowed ViT and patch
merger) and `jaxserve.models.siglip` (Gemma 3's SigLIP encoder and multimodal projector).

A tower's weights are declared once, as a list of `VisionWeight`s: the path in the params pytree,
the shape, the Hugging Face tensor name (per-layer: with "{layer}" where the block index goes)
and how the file's tensor becomes ours (`layout`). Per-layer weights are stacked on a leading
layer axis under "layers/" (the towers run their blocks under `jax.lax.scan`, so compile time
stays flat in the depth). From the declaration come the shapes (`param_shapes`), random weights
(`random_params`) and the conversion (`params_from_state_dict`).

Layouts:
  "linear"  a torch Linear's [out, in], stored transposed as [in, out] for `x @ W`
  "conv"    a Conv2d/Conv3d weight with stride == kernel [D, C, (T,) P, P], stored as the matrix
            [C*(T*)P*P, D] that multiplies a patch flattened in (C, (T,) P, P) order
  "as_is"   stored as the file has it (norm weights, biases, position tables, Gemma 3's
            `mm_input_projection_weight`, which is already [in, out])
"""
from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Mapping, Sequence

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import cpu_kernels

Params = dict


@dataclasses.dataclass(frozen=True)
class VisionWeight:
    """One declared vision weight (see the module docstring)."""

    path: str  # "patch_embed" or "layers/<name>"
    shape: tuple[int, ...]  # ours; per-layer weights: (depth, ...)
    hf: str  # the tensor name after the tower's prefix; per-layer: with "{layer}"
    layout: str = "as_is"  # "linear", "conv" or "as_is"
    init: str = "normal"  # random_params: "normal", "ones" or "zeros"
    matrix: bool = False  # an "as_is" weight that multiplies as x @ w (Gemma 3's projection)

    @property
    def is_matrix(self) -> bool:
        """Whether the tower multiplies by it (x @ w, through `linear`)."""
        return self.matrix or self.layout in ("linear", "conv")

    @property
    def per_layer(self) -> bool:
        return self.path.startswith("layers/")

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StripWeight:
    """A tower's matrix [..., in, out] in the CPU kernel's float32 strips (cpu_kernels.pack_f32),
    which `linear` multiplies by in the kernel (`cpu_strips`; scanned per layer like the array)."""
    packed: Any  # float32 [..., S, in, STRIP]
    out_features: int = dataclasses.field(metadata=dict(static=True), default=0)

    @property
    def dtype(self):
        return self.packed.dtype


def linear(x: jax.Array, w) -> jax.Array:
    """x [..., in] @ w [in, out] -> x's dtype: a StripWeight through cpu_kernels.f32_matmul; a
    bfloat16 matrix summed in float32 (as transformers' bfloat16 matmuls, and XLA's fast bfloat16
    dot on CPUs that have one); any other plainly."""
    if isinstance(w, StripWeight):
        return cpu_kernels.f32_matmul(x, w.packed, w.out_features).astype(x.dtype)
    if w.dtype == jnp.bfloat16:
        return jnp.matmul(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32).astype(x.dtype)
    return x @ w


def cpu_strips(params: Params, decls: Sequence[VisionWeight]) -> Params:
    """`params` with every float32 matrix of `decls` as a StripWeight (the tower on one CPU device
    with the C++ kernels built: cpu_kernels.available())."""
    pack = jax.jit(cpu_kernels.pack_f32)
    out = {"layers": dict(params.get("layers", {})), **{k: v for k, v in params.items() if k != "layers"}}
    for d in decls:
        holder = out["layers"] if d.per_layer else out
        if d.is_matrix and holder[d.name].dtype == jnp.float32:
            holder[d.name] = StripWeight(pack(holder[d.name]), holder[d.name].shape[-1])
    return out if "layers" in params else {k: v for k, v in out.items() if k != "layers"}


TOWERS = {"Qwen2_5_VLForConditionalGeneration": "qwen_vision", "Gemma3ForConditionalGeneration": "siglip"}


def tower(config):
    """(module, vision config) of the tower of a vision-language ModelConfig: `qwen_vision`
    (Qwen2.5-VL) or `siglip` (Gemma 3, its projector included), the module's VisionConfig read from
    the config's vision section (KeyError, TypeError or ValueError for one it cannot compute)."""
    module = importlib.import_module(f"jaxserve.models.{TOWERS[config.multimodal_architecture]}")
    # the flat config.json of ModelConfig, and the text hidden size where SigLIP's projector reads it
    hf = {**config.to_hf_dict(), "text_config": {"hidden_size": config.hidden_size}}
    return module, module.VisionConfig.from_hf_dict(hf)


def param_shapes(decls: Sequence[VisionWeight]) -> Params:
    """The params pytree of shapes (tuples) of a tower's declaration."""
    return _tree(decls, lambda d: d.shape)


def random_params(decls: Sequence[VisionWeight], dtype=jnp.float32, seed: int = 0) -> Params:
    """Random weights of a declaration (tests and benchmarks)."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), len(decls)))

    def leaf(d: VisionWeight):
        key = next(keys)
        if d.init == "ones":
            return jnp.ones(d.shape, dtype)
        if d.init == "zeros":
            return jnp.zeros(d.shape, dtype)
        fan_in = d.shape[-2] if d.layout in ("linear", "conv") else d.shape[-1]
        return (jax.random.normal(key, d.shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)

    return _tree(decls, leaf)


def params_from_state_dict(decls: Sequence[VisionWeight], state_dict: Mapping[str, np.ndarray],
                           prefixes: Sequence[str], dtype=np.float32) -> Params:
    """The params pytree of numpy arrays in `dtype` (np.float32 or ml_dtypes.bfloat16) from a
    Hugging Face state dict {name: array-like}. A declared tensor is looked up under each of
    `prefixes` in turn (transformers 5 names it "model.visual.blocks.0...", the published
    checkpoints "visual.blocks.0..."); tensors the declaration does not name are ignored. Raises
    KeyError naming a missing tensor, ValueError naming one of the wrong shape."""

    def find(name: str) -> np.ndarray:
        for prefix in prefixes:
            if prefix + name in state_dict:
                return np.asarray(state_dict[prefix + name])
        raise KeyError(f"no tensor {name!r} under any of the prefixes {list(prefixes)}")

    def ours(d: VisionWeight, array: np.ndarray, hf_name: str) -> np.ndarray:
        expected = d.shape[1:] if d.per_layer else d.shape
        if d.layout == "linear":
            array = array.T
        elif d.layout == "conv":
            array = array.reshape(array.shape[0], -1).T
        if tuple(array.shape) != tuple(expected):
            raise ValueError(f"{hf_name}: shape {tuple(array.shape)} after its layout {d.layout!r}, "
                             f"declared {tuple(expected)}")
        return array.astype(np.float32).astype(dtype)

    def leaf(d: VisionWeight):
        if not d.per_layer:
            return ours(d, find(d.hf), d.hf)
        rows = [ours(d, find(d.hf.format(layer=i)), d.hf.format(layer=i)) for i in range(d.shape[0])]
        return np.stack(rows)

    return _tree(decls, leaf)


def _tree(decls: Sequence[VisionWeight], leaf) -> Params:
    tree: Params = {}
    for d in decls:
        node = tree.setdefault("layers", {}) if d.per_layer else tree
        node[d.name] = leaf(d)
    return tree


# ---- layers ---------------------------------------------------------------------------------

def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm over the last axis, normalised in float32. offset 0 (Qwen): the normalised x is
    cast back to x's dtype, then scaled by `weight`; offset 1 (Gemma): scaled by (1 + weight) in
    float32, then cast."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis (mean and variance in float32)."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    normed = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (normed * weight.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, scale: float) -> jax.Array:
    """Bidirectional attention, softmax in float32. q, k, v [..., S, H, hd]; mask broadcastable
    to [..., H, S_q, S_k] (True: attend), or None. Every query row must see at least one key.
    Returns [..., S_q, H, hd] in q's dtype."""
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k, preferred_element_type=jnp.float32) * scale
    if mask is not None:
        logits = jnp.where(mask, logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(q.dtype)  # [..., H, S_q, S_k]
    return jnp.einsum("...hqk,...khd->...qhd", probs, v)


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, segments: jax.Array | None, scale: float,
                      query_block: int) -> jax.Array:
    """Attention of one sequence within segments, a block of `query_block` queries at a time
    against every key (`jax.lax.map`), so the float32 logits held at once are
    [H, query_block, S] rather than [H, S, S]. q, k, v [S, H, hd]; segments [S] (None: every
    query sees every key). Returns [S, H, hd]."""
    S, H, hd = q.shape

    def one_block(q_rows, q_segments):
        mask = None if segments is None else (q_segments[:, None] == segments[None, :])[None]  # [1, Bq, S]
        return attention(q_rows, k, v, mask, scale)

    if S <= query_block:
        return one_block(q, segments)
    nb = -(-S // query_block)
    extra = nb * query_block - S
    q_pad = jnp.pad(q, [(0, extra), (0, 0), (0, 0)]).reshape(nb, query_block, H, hd)
    # padded query rows repeat the last row's segment, so that they see a key (their rows are dropped)
    seg = jnp.zeros((S,), jnp.int32) if segments is None else segments
    seg_pad = jnp.pad(seg, (0, extra), mode="edge").reshape(nb, query_block)
    out = jax.lax.map(lambda xs: one_block(*xs), (q_pad, seg_pad))  # [nb, Bq, H, hd]
    return out.reshape(nb * query_block, H, hd)[:S]
