"""The step of a Llama-family decoder over a paged KV cache.

`forward` is the computation of every supported family (Llama, Mistral, Qwen2/3, Gemma 2/3, and
the mixture-of-experts Mixtral and Qwen2/3-MoE, whose MLP is jaxserve.models.moe's: the
differences are switches of `ModelConfig`); the weights it reads are declared once, in
`jaxserve.models.weights`. The engine jits `forward` once per shape bucket. Layer weights are
stacked on a leading layer axis and run under `jax.lax.scan`, so compile time stays flat as models
get deeper. Every matrix is multiplied through `quantization.linear`, float or quantized alike;
on one CPU device the layers may come in the layouts of `jaxserve.models.cpu_layout.layer_views`,
which the scan reads through `cpu_layout.LayerWeights` (as it reads a model whose dense and sparse
MLP layers are mixed: `jaxserve.models.weights.LayerKinds`).

KV cache layout: per cache, `[num_layers * num_pages, page_size, num_kv_heads, head_dim]`; layer
`l` owns pages `l * num_pages .. (l + 1) * num_pages - 1`, so a block table entry `p` of layer `l`
reads page `l * num_pages + p`. Page 0 of each layer is the null page that padding points at. The
flat layout lets the per-layer attention kernels read the one big buffer without slicing (and so
without copying) a layer out of it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.models import cpu_layout, lora as lora_slab, moe, mrope, quantization
from jaxserve.models.weights import layer_kinds
from jaxserve.models.quantization import linear
from jaxserve.parallel import sharding
from pallas_kernels import dispatch, kv_quant

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


def rope_tables(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos and sin [num_tokens, 1, head_dim // 2] of `positions` [num_tokens] (float32)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, head_dim // 2]
    return jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [num_tokens, num_heads, head_dim] (half-split rotary, as in HF Llama); cos, sin from rope_tables."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm over the last axis. Llama scales the normalized x (cast back to x's dtype) by
    `weight`; Gemma (offset 1) scales by (1 + weight) in float32, then casts, as transformers does."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if offset:
        return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def final_logits(params: Params, x: jax.Array, config: ModelConfig) -> jax.Array:
    """Residual-stream rows [R, D] -> logits [R, vocab] float32: final norm, lm_head (or the
    embedding tied to it), soft cap."""
    with jax.named_scope("final_logits"):
        x = rms_norm(x, params["final_norm"], config.rms_norm_eps, config.norm_weight_offset)
        if "lm_head" in params:
            logits = linear(x, params["lm_head"], out_dtype=jnp.float32)  # [R, V]
        else:
            logits = quantization.embedding_logits(x, params["embed"])
        return soft_cap(logits, config.final_logit_softcap)


def embed(params: Params, token_ids: jax.Array, config: ModelConfig) -> jax.Array:
    """The embedding rows of `token_ids` [T] -> [T, D] (in the norms' dtype when quantized),
    scaled by the family's embedding multiplier."""
    with jax.named_scope("embed"):
        x = quantization.embedding_rows(params["embed"], token_ids, params["final_norm"].dtype)
        if config.embedding_multiplier != 1.0:
            x = x * jnp.asarray(config.embedding_multiplier, x.dtype)
        return x


def qkv_projection(lp: Params, x: jax.Array, config: ModelConfig,
                   lora: lora_slab.LayerLoRA | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [T, D] -> q [T, Hq, hd], k and v [T, Hkv, hd] (before RoPE) on one layer's weights (and
    its part of a LoRA slab: each projection through `lora_slab.project`)."""
    T, Hq, Hkv, hd = x.shape[0], config.num_q_heads, config.num_kv_heads, config.head_dim
    eps, offset = config.rms_norm_eps, config.norm_weight_offset
    with jax.named_scope("qkv"):
        h = rms_norm(x, lp["attn_norm"], eps, offset)
        q, k, v = lora_slab.project_group(h, lp, ("wq", "wk", "wv"), lora)
        if config.attention_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
        q, k, v = q.reshape(T, Hq, hd), k.reshape(T, Hkv, hd), v.reshape(T, Hkv, hd)
        if config.qk_norm:
            q, k = rms_norm(q, lp["q_norm"], eps, offset), rms_norm(k, lp["k_norm"], eps, offset)
        return q, k, v


def attention_output(lp: Params, x: jax.Array, attn: jax.Array, config: ModelConfig,
                     lora: lora_slab.LayerLoRA | None = None) -> jax.Array:
    """The residual stream x [T, D] plus the output projection of attn [T, Hq, hd]."""
    with jax.named_scope("attention_output"):
        out = lora_slab.project(attn.reshape(x.shape[0], config.num_q_heads * config.head_dim), lp, "wo", lora)
        if config.sandwich_norms:
            out = rms_norm(out, lp["attn_post_norm"], config.rms_norm_eps, config.norm_weight_offset)
        return x + out


def mlp_block(lp: Params, x: jax.Array, config: ModelConfig, mesh: jax.sharding.Mesh | None = None,
              lora: lora_slab.LayerLoRA | None = None) -> jax.Array:
    """The residual stream x [T, D] plus the gated MLP of its normed rows (a mixture-of-experts
    layer's: jaxserve.models.moe, its routed experts split over `mesh`'s "model" axis when given).
    A layer is sparse when its weights have a router: every layer of a mixture-of-experts model
    but its dense ones (ModelConfig.mlp_only_layers; see weights.LayerKinds)."""
    eps, offset = config.rms_norm_eps, config.norm_weight_offset
    activation = _ACTIVATIONS[config.hidden_act]
    with jax.named_scope("mlp"):
        h = rms_norm(x, lp["mlp_norm"], eps, offset)
        if "router" in lp:
            return x + moe.sparse_mlp(lp, h, config, mesh)
        gate, up = lora_slab.project_group(h, lp, ("w_gate", "w_up"), lora)
        out = lora_slab.project(activation(gate) * up, lp, "w_down", lora)
        if config.sandwich_norms:
            out = rms_norm(out, lp["mlp_post_norm"], eps, offset)
        return x + out


def after_attention(lp: Params, x: jax.Array, attn: jax.Array, config: ModelConfig,
                    mesh: jax.sharding.Mesh | None = None, lora: lora_slab.LayerLoRA | None = None) -> jax.Array:
    """The rest of the layer once attention has run: output projection, then the MLP -> [T, D]."""
    return mlp_block(lp, attention_output(lp, x, attn, config, lora), config, mesh, lora)


def attention_fn(config: ModelConfig, backend: str, num_decode: int, num_prefill_seqs: int,
                 max_query_len: int | None, bf16_products: bool = False) -> Callable:
    """The KV write and attention of one layer of a step with `num_decode` decode rows and
    `num_prefill_seqs` prefill chunks: attend(q, k, v, k_cache, v_cache, window, slot_mapping,
    decode_block_table, decode_seq_lens, prefill_block_table, prefill_seq_lens,
    prefill_query_start_loc) -> (attn [T, Hq, hd], k_cache, v_cache), page tables already
    offset to the layer's pages; `key_limit` (int32[prefill tokens], optional): each prefill
    token's highest visible key position (bidirectional image spans: dispatch.ragged_attention).
    Attention options: only what the family uses, so a plain Llama step is the one it always was;
    `bf16_products`: the prefill attention's products in bfloat16 (the CPU kernel's)."""
    options: dict[str, Any] = {}
    if config.query_pre_attn_scalar is not None:
        options["scale"] = config.attention_scale
    if config.attn_logit_softcap is not None:
        options["logit_soft_cap"] = config.attn_logit_softcap
    windowed = any(config.layer_windows())

    def attend(q, k, v, k_cache, v_cache, window, slot_mapping, decode_block_table, decode_seq_lens,
               prefill_block_table, prefill_seq_lens, prefill_query_start_loc, key_limit=None):
        k_cache, v_cache = dispatch.write_kv(k_cache, v_cache, k, v, slot_mapping)
        layer_options = {**options, "sliding_window": window} if windowed else options
        parts = []
        if num_decode:
            parts.append(dispatch.decode_attention(
                backend, q[:num_decode], k_cache, v_cache, decode_block_table, decode_seq_lens, **layer_options))
        if num_prefill_seqs:
            parts.append(dispatch.ragged_attention(
                backend, q[num_decode:], k_cache, v_cache, prefill_block_table, prefill_seq_lens,
                prefill_query_start_loc, max_query_len=max_query_len, key_limit=key_limit, **layer_options,
                **({"bf16_products": True} if bf16_products else {})))
        attn = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)  # [T, heads, hd]
        return attn, k_cache, v_cache

    return attend


def decoder_layers(layers, x: jax.Array, kv_cache: dict[str, jax.Array], batch: dict[str, jax.Array],
                   config: ModelConfig, attend: Callable, mesh: jax.sharding.Mesh | None = None,
                   lora: lora_slab.Slab | None = None,
                   backend: str = "reference") -> tuple[jax.Array, dict[str, jax.Array]]:
    """x [T, D] through every layer under `jax.lax.scan` (stacked weights, or any layout of
    cpu_layout.layer_views), each layer writing its K/V into its own pages of the caches.
    `mesh` (tensor parallel): where a mixture-of-experts model's routed experts run split.
    A model with dense and sparse MLP layers mixed (weights.LayerKinds) runs the same scan: the
    part after attention goes under a switch on the layer's kind, which reads its own weights.
    `lora`: a LoRA slab (jaxserve.models.lora), each layer reading its slices, with each token's
    slot in batch["lora_slots"]; its update runs through `backend`'s implementation.
    Returns the residual stream [T, D] after the last layer and the updated caches."""
    num_pages = kv_quant.values(kv_cache["k"]).shape[0] // config.num_layers
    page_size = kv_quant.values(kv_cache["k"]).shape[1]
    # RoPE tables once per step; Gemma 3's sliding layers have their own base; Qwen2.5-VL's M-RoPE
    # reads each frequency band's axis of its three positions.
    if "mrope_positions" in batch:
        cos, sin = mrope.mrope_tables(batch["mrope_positions"], config.rope_inv_freq(), config.mrope_section)
    else:
        cos, sin = rope_tables(batch["positions"], config.rope_inv_freq())  # [T, 1, hd // 2] each
    # Gemma 3's image tokens see their whole image: the prefill tokens' key limits, when given
    limits = {"key_limit": batch["prefill_key_limit"]} if "prefill_key_limit" in batch else {}
    local_rope = config.rope_local_theta is not None
    if local_rope:
        local_cos, local_sin = rope_tables(batch["positions"], config.rope_inv_freq(sliding=True))
    weights = cpu_layout.LayerWeights.of(layers, layer_kinds(config))

    def layer(carry, scanned):
        x, k_cache, v_cache, layer_idx = carry  # x: [T, D]
        lp, window = scanned  # this layer's slice of the stacked weights (None: per-layer weights);
        #                       its sliding window (int32 scalar, 0: none)
        layer_lora = None if lora is None else lora_slab.LayerLoRA(lora, layer_idx, batch["lora_slots"], backend)
        projection = functools.partial(qkv_projection, config=config, lora=layer_lora)
        rest_of_layer = functools.partial(after_attention, config=config, mesh=mesh, lora=layer_lora)
        page_offset = layer_idx * num_pages
        q, k, v = weights.apply(projection, lp, layer_idx, x, own_weights=False)
        layer_cos, layer_sin = cos, sin
        if local_rope:
            layer_cos, layer_sin = jnp.where(window > 0, local_cos, cos), jnp.where(window > 0, local_sin, sin)
        q, k = apply_rope(q, layer_cos, layer_sin), apply_rope(k, layer_cos, layer_sin)  # [T, heads, hd]
        with jax.named_scope("attention"):
            attn, k_cache, v_cache = attend(  # attn: [T, Hq, hd]
                q, k, v, k_cache, v_cache, window, batch["slot_mapping"] + page_offset * page_size,
                batch["decode_block_table"] + page_offset, batch["decode_seq_lens"],
                batch["prefill_block_table"] + page_offset, batch["prefill_seq_lens"],
                batch["prefill_query_start_loc"], **limits)
        x = weights.apply(rest_of_layer, lp, layer_idx, x, attn)
        return (x, k_cache, v_cache, layer_idx + 1), None

    carry = (x, kv_cache["k"], kv_cache["v"], jnp.int32(0))
    scanned = (weights.scanned, jnp.asarray(config.layer_windows(), jnp.int32))
    (x, k_cache, v_cache, _), _ = jax.lax.scan(layer, carry, scanned)
    return x, {"k": k_cache, "v": v_cache}


def forward(params: Params, kv_cache: dict[str, jax.Array], batch: dict[str, jax.Array], *,
            config: ModelConfig, backend: str = "reference", mesh: jax.sharding.Mesh | None = None,
            prefill_hidden_rows: int = 0, max_query_len: int | None = None,
            lora: lora_slab.Slab | None = None) -> tuple[jax.Array, ...]:
    """One model step over a batch of decode tokens followed by prefill chunks.

    With a `mesh` (tensor parallel, see jaxserve.parallel.sharding), the KV write and attention run per
    device under shard_map over its "model" axis, as do a mixture-of-experts model's routed experts;
    XLA partitions the rest from the weights.

    batch (all int32):
      token_ids, positions, slot_mapping: [num_tokens]; the first `num_decode` tokens are decode
        tokens (one per decode row), the rest belong to prefill chunks. Padding: slot 0 (null page).
      decode_block_table: [num_decode, max_pages_per_seq]; decode_seq_lens: [num_decode] (0 = padding)
      prefill_block_table: [num_prefill_seqs, max_pages_per_seq]; prefill_seq_lens: [num_prefill_seqs];
      prefill_query_start_loc: [num_prefill_seqs + 1] (offsets into the prefill tokens)
      logits_indices: [num_rows] tokens whose logits are returned
      lora_slots: [num_tokens], with a `lora` slab only: each token's adapter slot (0: the base model)
      A vision-language model's (jaxserve.executor.vision_encoder), with params["image_embeddings"]
      [pool rows, D], the encoded images: embed_rows [num_tokens], each token's pool row (0: its own
      embedding); mrope_positions [3, num_tokens] (M-RoPE); prefill_key_limit [prefill tokens]
      (bidirectional image spans).
    Returns (logits [num_rows, vocab] float32, updated kv_cache); with `prefill_hidden_rows` > 0
    a third output, the prefill tokens' last residual-stream rows (before the final norm, see
    `final_logits`) zero-padded to [prefill_hidden_rows, D] ([0, D] in a step without prefill):
    what the prompt logprobs are computed from, on device.
    `max_query_len`: no prefill chunk has more tokens (a hint for the attention's blocking;
    speculative verification steps pass K + 1).
    `lora`: a slab of LoRA adapters (jaxserve.models.lora); without one the step is the base model's,
    its graph unchanged.
    """
    num_decode = batch["decode_seq_lens"].shape[0]
    num_prefill_seqs = batch["prefill_seq_lens"].shape[0]
    attend = attention_fn(config, backend, num_decode, num_prefill_seqs, max_query_len,
                          cpu_layout.bf16_prompt_attention(params["layers"], batch["token_ids"].shape[0]))
    if mesh is not None:
        attend = sharding.shard_attention(attend, mesh)
    x = embed(params, batch["token_ids"], config)  # [T, D]
    if "image_embeddings" in params:  # image tokens take their image's embeddings (unscaled, as transformers)
        rows = batch["embed_rows"]  # [T]
        x = jnp.where((rows > 0)[:, None], params["image_embeddings"][rows].astype(x.dtype), x)
    x, kv_cache = decoder_layers(params["layers"], x, kv_cache, batch, config, attend, mesh, lora, backend)
    logits = final_logits(params, x[batch["logits_indices"]], config)  # [R, V]
    if not prefill_hidden_rows:
        return logits, kv_cache
    prefill = x[num_decode:num_decode + prefill_hidden_rows] if num_prefill_seqs else x[:0]
    if num_prefill_seqs and prefill.shape[0] < prefill_hidden_rows:
        prefill = jnp.pad(prefill, ((0, prefill_hidden_rows - prefill.shape[0]), (0, 0)))
    return logits, kv_cache, prefill
