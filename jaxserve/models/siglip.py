"""Gemma 3's vision tower: the SigLIP vision transformer (transformers' `SiglipVisionModel`, its
last hidden state) and `Gemma3MultiModalProjector`.

SigLIP: the image [3, H, W] (H = W = `image_size`) is cut into (H / P)**2 patches of P x P
pixels, each flattened in the Conv2d weight's (C, P, P) order and embedded by one matmul plus the
conv's bias; a learned position embedding per patch (row-major) is added; then pre-LN encoder
layers (LayerNorm, attention with biased q/k/v/out projections, LayerNorm, fc1-GELU(tanh)-fc2)
and a final LayerNorm. The pooling head (`vision_use_head`) is not used by Gemma 3 and not
converted. The projector average-pools the (H / P) x (H / P) grid to sqrt(mm_tokens_per_image)
per side, applies Gemma's RMSNorm (scale 1 + w, eps = the vision `layer_norm_eps`) and multiplies
by `mm_input_projection_weight` [vision hidden, text hidden].

Every image has the same shape, so a call is a batch [B, 3, H, W]; the engine compiles one per
batch-size bucket and ignores the padding images' rows. Attention is over all the
(H / P)**2 patches of an image, `QUERY_BLOCK` queries at a time.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.models import vision
from jaxserve.models.vision import VisionWeight, layer_norm, linear, rms_norm

Params = dict

# transformers 5's module paths, then the published checkpoints'
VISION_PREFIXES = ("model.vision_tower.vision_model.", "model.vision_tower.", "vision_tower.vision_model.",
                   "vision_tower.")
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")
# Queries per attention block: [B, heads, QUERY_BLOCK, num_patches] float32 logits at a time (Gemma 3:
# 16 x 1024 x 4096 = 256 MiB an image, against 1 GiB for all 4096 queries). Read when traced.
QUERY_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The fields of Gemma 3's `vision_config` (SigLIP) and of the projector that change the math."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    text_hidden_size: int
    mm_tokens_per_image: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6

    @classmethod
    def from_hf_dict(cls, config: dict) -> "VisionConfig":
        """From a Gemma 3 config.json dict ("vision_config", "text_config",
        "mm_tokens_per_image"). Raises ValueError for an activation other than gelu_pytorch_tanh
        or a patch grid the pooling does not divide."""
        v, t = config["vision_config"], config["text_config"]
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config.hidden_act={act!r} is not supported (gelu_pytorch_tanh only)")
        out = cls(hidden_size=v.get("hidden_size", 768), intermediate_size=v.get("intermediate_size", 3072),
                  num_layers=v.get("num_hidden_layers", 12), num_heads=v.get("num_attention_heads", 12),
                  image_size=v.get("image_size", 224), patch_size=v.get("patch_size", 16),
                  text_hidden_size=t["hidden_size"], mm_tokens_per_image=config.get("mm_tokens_per_image", 256),
                  num_channels=v.get("num_channels", 3), layer_norm_eps=v.get("layer_norm_eps", 1e-6))
        out.pool_kernel  # validates the grid
        return out

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.patches_per_side ** 2

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.mm_tokens_per_image)

    @property
    def pool_kernel(self) -> int:
        """The average pool's kernel and stride (patches per side of one image token)."""
        side, tokens = self.patches_per_side, self.tokens_per_side
        if tokens * tokens != self.mm_tokens_per_image or side % tokens:
            raise ValueError(f"mm_tokens_per_image={self.mm_tokens_per_image} must be a square whose side "
                             f"divides the {side} patches per side")
        return side // tokens


def weight_decls(config: VisionConfig) -> list[VisionWeight]:
    """The tower's and the projector's weights. The projector's two (`mm_norm`, `mm_proj`) are
    named under "multi_modal_projector."; the rest under the vision tower (see the prefixes)."""
    L, D, F = config.num_layers, config.hidden_size, config.intermediate_size
    lyr = "encoder.layers.{layer}."

    def layer(name, shape, hf, layout="as_is", init="normal"):
        return VisionWeight(f"layers/{name}", (L, *shape), lyr + hf, layout, init)

    return [
        VisionWeight("patch_embed", (config.num_channels * config.patch_size ** 2, D),
                     "embeddings.patch_embedding.weight", "conv"),
        VisionWeight("patch_bias", (D,), "embeddings.patch_embedding.bias"),
        VisionWeight("pos_embed", (config.num_patches, D), "embeddings.position_embedding.weight"),
        layer("ln1", (D,), "layer_norm1.weight", init="ones"),
        layer("ln1_bias", (D,), "layer_norm1.bias", init="zeros"),
        layer("wq", (D, D), "self_attn.q_proj.weight", "linear"),
        layer("bq", (D,), "self_attn.q_proj.bias"),
        layer("wk", (D, D), "self_attn.k_proj.weight", "linear"),
        layer("bk", (D,), "self_attn.k_proj.bias"),
        layer("wv", (D, D), "self_attn.v_proj.weight", "linear"),
        layer("bv", (D,), "self_attn.v_proj.bias"),
        layer("wo", (D, D), "self_attn.out_proj.weight", "linear"),
        layer("bo", (D,), "self_attn.out_proj.bias"),
        layer("ln2", (D,), "layer_norm2.weight", init="ones"),
        layer("ln2_bias", (D,), "layer_norm2.bias", init="zeros"),
        layer("fc1", (D, F), "mlp.fc1.weight", "linear"),
        layer("fc1_bias", (F,), "mlp.fc1.bias"),
        layer("fc2", (F, D), "mlp.fc2.weight", "linear"),
        layer("fc2_bias", (D,), "mlp.fc2.bias"),
        VisionWeight("post_ln", (D,), "post_layernorm.weight", init="ones"),
        VisionWeight("post_ln_bias", (D,), "post_layernorm.bias", init="zeros"),
        VisionWeight("mm_norm", (D,), "mm_soft_emb_norm.weight", init="zeros"),
        VisionWeight("mm_proj", (D, config.text_hidden_size), "mm_input_projection_weight", matrix=True),
    ]


PROJECTOR_WEIGHTS = ("mm_norm", "mm_proj")


def patchify(pixels: jax.Array, patch_size: int) -> jax.Array:
    """[B, C, H, W] -> [B, (H/P)*(W/P), C*P*P]: patches row-major, each flattened (C, P, P)."""
    B, C, Hp, Wp = pixels.shape
    P = patch_size
    x = pixels.reshape(B, C, Hp // P, P, Wp // P, P)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(B, (Hp // P) * (Wp // P), C * P * P)


def encode(params: Params, config: VisionConfig, pixels: jax.Array) -> jax.Array:
    """SigLIP's last hidden state: pixels [B, 3, image_size, image_size] (the processor's
    `pixel_values`) -> [B, num_patches, hidden] in the params' dtype (LayerNorms and softmax in
    float32)."""
    dtype = params["patch_embed"].dtype
    B, n, D, H, hd = pixels.shape[0], config.num_patches, config.hidden_size, config.num_heads, config.head_dim
    eps = config.layer_norm_eps
    x = linear(patchify(pixels.astype(dtype), config.patch_size), params["patch_embed"])  # [B, n, D]
    x = x + params["patch_bias"] + params["pos_embed"]

    def layer(x, lp):
        h = layer_norm(x, lp["ln1"], lp["ln1_bias"], eps)
        q, k, v = ((linear(h, lp[w]) + lp[b]).reshape(B, n, H, hd) for w, b in (("wq", "bq"), ("wk", "bk"), ("wv", "bv")))
        attend = lambda q, k, v: vision.blocked_attention(q, k, v, None, hd ** -0.5, QUERY_BLOCK)
        out = jax.vmap(attend)(q, k, v).reshape(B, n, D)  # [B, n, D]
        x = x + (linear(out, lp["wo"]) + lp["bo"])
        h = layer_norm(x, lp["ln2"], lp["ln2_bias"], eps)
        h = jax.nn.gelu(linear(h, lp["fc1"]) + lp["fc1_bias"], approximate=True)
        return x + (linear(h, lp["fc2"]) + lp["fc2_bias"]), None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    return layer_norm(x, params["post_ln"], params["post_ln_bias"], eps)


def project(params: Params, config: VisionConfig, hidden: jax.Array) -> jax.Array:
    """Gemma3MultiModalProjector: [B, num_patches, hidden] -> [B, mm_tokens_per_image, text hidden]."""
    B, D = hidden.shape[0], hidden.shape[-1]
    tokens, k = config.tokens_per_side, config.pool_kernel
    grid = hidden.reshape(B, tokens, k, tokens, k, D).astype(jnp.float32)  # rows, columns of the patch grid
    pooled = jnp.mean(grid, axis=(2, 4)).astype(hidden.dtype).reshape(B, tokens * tokens, D)
    normed = rms_norm(pooled, params["mm_norm"], config.layer_norm_eps, offset=1.0)
    return linear(normed, params["mm_proj"]).astype(hidden.dtype)


def forward(params: Params, config: VisionConfig, pixels: jax.Array) -> jax.Array:
    """Gemma 3's image-token embeddings: pixels [B, 3, image_size, image_size] ->
    [B, mm_tokens_per_image, text_hidden_size] (the params' dtype)."""
    return project(params, config, encode(params, config, pixels))


def params_from_state_dict(state_dict, config: VisionConfig, dtype=np.float32) -> Params:
    """Tower and projector params (numpy, `dtype`) from a Gemma3ForConditionalGeneration state
    dict (the language model's tensors and SigLIP's pooling head are ignored)."""
    decls = weight_decls(config)
    tower = [d for d in decls if d.name not in PROJECTOR_WEIGHTS]
    projector = [d for d in decls if d.name in PROJECTOR_WEIGHTS]
    return {**vision.params_from_state_dict(tower, state_dict, VISION_PREFIXES, dtype),
            **vision.params_from_state_dict(projector, state_dict, PROJECTOR_PREFIXES, dtype)}
