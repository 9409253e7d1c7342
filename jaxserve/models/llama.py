"""Flax (NNX) Llama over a paged KV cache.

The `Llama` module declares the weights (shapes, dtype, random init); the computation is the pure
function `forward`, which the engine jits once per shape bucket. Layer weights are stacked on a
leading layer axis and run under `jax.lax.scan`, so compile time stays flat as models get deeper.

KV cache layout: per cache, `[num_layers * num_pages, page_size, num_kv_heads, head_dim]`; layer
`l` owns pages `l * num_pages .. (l + 1) * num_pages - 1`, so a block table entry `p` of layer `l`
reads page `l * num_pages + p`. Page 0 of each layer is the null page that padding points at. The
flat layout lets the per-layer attention kernels read the one big buffer without slicing (and so
without copying) a layer out of it.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxserve import sharding
from jaxserve.config import ModelConfig
from jaxserve.quantization import linear
from pallas_kernels import dispatch, kv_quant, reference

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    num_pages: int  # per layer, null page included
    page_size: int

    def shape(self, config: ModelConfig) -> tuple[int, int, int, int]:
        return (config.num_layers * self.num_pages, self.page_size, config.num_kv_heads, config.head_dim)


def init_kv_cache(config: ModelConfig, spec: KVCacheSpec, dtype, sharding=None) -> dict[str, jax.Array]:
    """Zeroed K and V caches: [num_layers * num_pages, page_size, num_kv_heads, head_dim] each
    (dtype int8: {"pages", "scales"} dicts, see pallas_kernels.kv_quant)."""
    shape = spec.shape(config)
    make = jax.jit(lambda: kv_quant.zeros(shape, dtype), out_shardings=sharding)
    return {"k": make(), "v": make()}


class Llama(nnx.Module):
    """Llama / Mistral / Qwen2 decoder: weights as stacked `nnx.Param`s, compute in `forward`."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.config = config
        shapes = config.param_shapes()

        def make(name: str, shape: tuple[int, ...]) -> nnx.Param:
            if name.endswith("norm"):
                return nnx.Param(jnp.ones(shape, dtype))
            if name.startswith("b"):
                return nnx.Param(jnp.zeros(shape, dtype))
            fan_in = shape[-2] if len(shape) >= 2 and name != "embed" else shape[-1]
            std = 1.0 / math.sqrt(fan_in)
            return nnx.Param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype))

        self.embed = make("embed", shapes["embed"])
        self.final_norm = make("final_norm", shapes["final_norm"])
        self.layers = nnx.Dict({name: make(name, shape) for name, shape in shapes["layers"].items()})
        if "lm_head" in shapes:
            self.lm_head = make("lm_head", shapes["lm_head"])

    def params(self) -> Params:
        """The weights as a plain nested dict of arrays (the checkpoint and step-function format)."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))

    def __call__(self, kv_cache, batch, *, backend: str = "reference"):
        return forward(self.params(), kv_cache, batch, config=self.config, backend=backend)


def random_params(config: ModelConfig, dtype=jnp.float32, seed: int = 0) -> Params:
    """Random weights for tests and benchmarks (a random-weight model of any shape)."""
    return Llama(config, dtype=dtype, rngs=nnx.Rngs(seed)).params()


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse rotary frequencies [head_dim // 2], with Llama 3 scaling when the config asks for it."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling
    if scaling:
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """x: [num_tokens, num_heads, head_dim] (half-split rotary, as in HF Llama); positions: [num_tokens]."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, head_dim // 2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def forward(params: Params, kv_cache: dict[str, jax.Array], batch: dict[str, jax.Array], *,
            config: ModelConfig, backend: str = "reference",
            mesh: jax.sharding.Mesh | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One model step over a batch of decode tokens followed by prefill chunks.

    With a `mesh` (tensor parallel, see jaxserve.sharding), the KV write and attention run per
    device under shard_map over its "model" axis; XLA partitions the rest from the weights.

    batch (all int32):
      token_ids, positions, slot_mapping: [num_tokens]; the first `num_decode` tokens are decode
        tokens (one per decode row), the rest belong to prefill chunks. Padding: slot 0 (null page).
      decode_block_table: [num_decode, max_pages_per_seq]; decode_seq_lens: [num_decode] (0 = padding)
      prefill_block_table: [num_prefill_seqs, max_pages_per_seq]; prefill_seq_lens: [num_prefill_seqs];
      prefill_query_start_loc: [num_prefill_seqs + 1] (offsets into the prefill tokens)
      logits_indices: [num_rows] tokens whose logits are returned
    Returns (logits [num_rows, vocab] float32, updated kv_cache).
    """
    num_decode = batch["decode_seq_lens"].shape[0]
    num_prefill_seqs = batch["prefill_seq_lens"].shape[0]
    num_tokens = batch["token_ids"].shape[0]
    num_pages = kv_quant.values(kv_cache["k"]).shape[0] // config.num_layers
    page_size = kv_quant.values(kv_cache["k"]).shape[1]
    T, Hq, Hkv, hd = num_tokens, config.num_q_heads, config.num_kv_heads, config.head_dim
    inv_freq = rope_inv_freq(config)
    positions = batch["positions"]

    def attend(q, k, v, k_cache, v_cache, slot_mapping, decode_block_table, decode_seq_lens,
               prefill_block_table, prefill_seq_lens, prefill_query_start_loc):
        k_cache, v_cache = reference.write_kv(k_cache, v_cache, k, v, slot_mapping)
        parts = []
        if num_decode:
            parts.append(dispatch.decode_attention(
                backend, q[:num_decode], k_cache, v_cache, decode_block_table, decode_seq_lens))
        if num_prefill_seqs:
            parts.append(dispatch.ragged_attention(
                backend, q[num_decode:], k_cache, v_cache, prefill_block_table, prefill_seq_lens,
                prefill_query_start_loc))
        attn = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)  # [T, heads, hd]
        return attn, k_cache, v_cache

    if mesh is not None:
        attend = sharding.shard_attention(attend, mesh)

    def layer(carry, lp):
        x, k_cache, v_cache, layer_idx = carry  # x: [T, D]
        page_offset = layer_idx * num_pages
        h = rms_norm(x, lp["attn_norm"], config.rms_norm_eps)
        q, k, v = linear(h, lp["wq"]), linear(h, lp["wk"]), linear(h, lp["wv"])
        if config.attention_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
        q = apply_rope(q.reshape(T, Hq, hd), positions, inv_freq)  # [T, Hq, hd]
        k = apply_rope(k.reshape(T, Hkv, hd), positions, inv_freq)  # [T, Hkv, hd]
        v = v.reshape(T, Hkv, hd)
        attn, k_cache, v_cache = attend(  # attn: [T, Hq, hd]
            q, k, v, k_cache, v_cache, batch["slot_mapping"] + page_offset * page_size,
            batch["decode_block_table"] + page_offset, batch["decode_seq_lens"],
            batch["prefill_block_table"] + page_offset, batch["prefill_seq_lens"],
            batch["prefill_query_start_loc"])
        x = x + linear(attn.reshape(T, Hq * hd), lp["wo"])
        h = rms_norm(x, lp["mlp_norm"], config.rms_norm_eps)
        x = x + linear(jax.nn.silu(linear(h, lp["w_gate"])) * linear(h, lp["w_up"]), lp["w_down"])
        return (x, k_cache, v_cache, layer_idx + 1), None

    x = params["embed"][batch["token_ids"]]  # [T, D]
    carry = (x, kv_cache["k"], kv_cache["v"], jnp.int32(0))
    (x, k_cache, v_cache, _), _ = jax.lax.scan(layer, carry, params["layers"])
    x = rms_norm(x[batch["logits_indices"]], params["final_norm"], config.rms_norm_eps)  # [R, D]
    lm_head = params["lm_head"] if "lm_head" in params else params["embed"].T
    logits = jnp.dot(x, lm_head, preferred_element_type=jnp.float32)  # [R, V]
    return logits, {"k": k_cache, "v": v_cache}
