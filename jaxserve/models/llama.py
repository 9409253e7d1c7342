"""The step of a Llama-family decoder over a paged KV cache.

`forward` is the computation of every supported family (Llama, Mistral, Qwen2/3, Gemma 2/3: the
differences are switches of `ModelConfig`); the weights it reads are declared once, in
`jaxserve.models.weights`. The engine jits `forward` once per shape bucket. Layer weights are
stacked on a leading layer axis and run under `jax.lax.scan`, so compile time stays flat as models
get deeper.

KV cache layout: per cache, `[num_layers * num_pages, page_size, num_kv_heads, head_dim]`; layer
`l` owns pages `l * num_pages .. (l + 1) * num_pages - 1`, so a block table entry `p` of layer `l`
reads page `l * num_pages + p`. Page 0 of each layer is the null page that padding points at. The
flat layout lets the per-layer attention kernels read the one big buffer without slicing (and so
without copying) a layer out of it.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import cpu_kernels
from jaxserve.config import ModelConfig
from jaxserve.models import quantization
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


def layer_views(params: Params, int8_activations: bool = True) -> Params:
    """`params` as the CPU step reads its weights in place, without a copy of a layer's slice.

    Under the layer scan, XLA materializes each layer's slice of a stacked weight before a dot
    reads it (a dynamic-slice of an operand is a copy): for a step of few rows that copy costs
    more than the matmul itself. Two ways around it, on one CPU device:
    * every weight matrix quantized in a format the CPU kernel takes, with `int8_activations`
      (EngineConfig.cpu_int8_activations): "layers" stays stacked, each matrix with the kernel's
      layout added (`quantization.with_kernel_layout`: the codes once more, at their size, the
      one cost in memory); `forward` passes those arrays whole with the layer index, which the
      kernel reads at (an int8 embedding's tied lm_head gets the layout too). A step's
      arguments stay few: each is a cost of every call (1325 arrays of SmolLM2 per layer took
      2.4 ms of a 7.3 ms int4 step to pass, 49 take 0.25 ms);
    * else "layers" becomes a tuple of per-layer dicts whose arrays are views of the stacked
      arrays' layer slices (a jax array can alias host memory: no copy), which `forward` reads
      under a switch on the layer index; quantized weights also get the layout a single row
      reads (`quantization.transposed`, a copy, whose dequantization XLA fuses into the matmul;
      int4 codes at a byte each, float32 scales), or the kernel's when some other matrix keeps
      the views.
    Anywhere else (an accelerator, sharded weights, a slice jax would not alias), `params` is
    returned unchanged and the scan slices the stacked arrays."""
    def on_one_cpu(leaf):
        devices = leaf.devices() if isinstance(leaf, jax.Array) else ()
        return len(devices) == 1 and next(iter(devices)).platform == "cpu"

    if not jax.tree.leaves(params["layers"]) or not all(map(on_one_cpu, jax.tree.leaves(params["layers"]))):
        return params
    if int8_activations and _kernel_takes_every_matrix(params["layers"]):
        views = {**params, "layers": {name: _with_kernel_layout(w) if quantization.is_quantized(w) else w
                                      for name, w in params["layers"].items()}}
        return _with_lm_head_kernel_layout(views)
    layers = {name: _cpu_layout(w, int8_activations) for name, w in params["layers"].items()}
    leaves, treedef = jax.tree.flatten(layers)
    num_layers = leaves[0].shape[0]
    per_layer = [[] for _ in range(num_layers)]
    for leaf in leaves:
        if leaf.shape[0] != num_layers:
            return params
        (device,) = leaf.devices()
        host = np.asarray(leaf)  # the device buffer itself on the CPU
        if host.__array_interface__["data"][0] != leaf.unsafe_buffer_pointer():
            return params
        for layer, view in enumerate(host):
            array = jax.device_put(view, device)
            if array.unsafe_buffer_pointer() != view.__array_interface__["data"][0]:
                return params  # jax copied it (alignment): keep the stacked weights
            per_layer[layer].append(array)
    views = {**params, "layers": tuple(jax.tree.unflatten(treedef, arrays) for arrays in per_layer)}
    return _with_lm_head_kernel_layout(views) if int8_activations else views


def layer_views_bytes(params: Params, int8_activations: bool = True) -> int:
    """Bytes `layer_views` adds beside `params` (arrays or abstract arrays) on one CPU device:
    the kernel's or the transposed layout of the quantized weights, and of an int8 embedding's
    tied lm_head. Views themselves cost nothing. For the memory planner."""
    added = []
    for weight in params["layers"].values():
        if quantization.is_quantized(weight):
            layout = jax.eval_shape(functools.partial(_cpu_layout, int8_activations=int8_activations), weight)
            added += _only_added(layout, weight).values()
    if int8_activations and _lm_head_takes_kernel(params):
        embed = params["embed"]
        added += _only_added(jax.eval_shape(quantization.embedding_with_kernel_layout, embed), embed).values()
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in added)


def _kernel_takes_every_matrix(layers: Params) -> bool:
    """Whether every weight matrix of the layers is quantized in a format the CPU kernel takes
    (and the kernel is built): then the layers stay stacked, with the kernel's layout beside
    the stored one, and no matrix is sliced out of its stack in the step."""
    for weight in layers.values():
        if quantization.is_quantized(weight):
            if not cpu_kernels.supports(weight):
                return False
        elif weight.ndim > 2:  # a float matrix [L, in, out] (norms and biases are [L, n])
            return False
    return cpu_kernels.available()


def _lm_head_takes_kernel(params: Params) -> bool:
    """Whether the model's lm_head is an int8 embedding's tied one that the CPU kernel takes."""
    embed = params["embed"]
    return quantization.is_quantized(embed) and "lm_head" not in params \
        and cpu_kernels.supports(jax.eval_shape(quantization.lm_head_kernel_weight, embed)) and cpu_kernels.available()


def _with_lm_head_kernel_layout(params: Params) -> Params:
    """An int8 embedding's tied lm_head in the CPU kernel's layout too, when the kernel takes it."""
    if not _lm_head_takes_kernel(params):
        return params
    embed = params["embed"]
    return {**params, "embed": {**embed, **_only_added(_embedding_kernel_layout_jit(embed), embed)}}


def _cpu_layout(weight, int8_activations: bool):
    """A stacked weight with what the CPU step's few-row matmuls read besides its stored layout."""
    if int8_activations and cpu_kernels.supports(weight) and cpu_kernels.available():
        return _with_kernel_layout(weight)
    if quantization.transposable(weight):
        return {**weight, **_transposed_jit(weight)}
    return weight


def _with_kernel_layout(weight: dict) -> dict:
    """`weight`'s arrays as they are, with the kernel's layout of them added (a copy of that only)."""
    return {**weight, **_only_added(_kernel_layout_jit(weight), weight)}


def _only_added(result: dict, weight: dict) -> dict:
    return {key: array for key, array in result.items() if key not in weight}


_transposed_jit = jax.jit(quantization.transposed)
_kernel_layout_jit = jax.jit(quantization.with_kernel_layout)
_embedding_kernel_layout_jit = jax.jit(quantization.embedding_with_kernel_layout)


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
    """Residual-stream rows [R, D] -> logits [R, vocab] float32: final norm, lm_head, soft cap."""
    x = rms_norm(x, params["final_norm"], config.rms_norm_eps, config.norm_weight_offset)
    if "lm_head" in params:
        logits = linear(x, params["lm_head"]).astype(jnp.float32) if quantization.is_quantized(params["lm_head"]) \
            else jnp.dot(x, params["lm_head"], preferred_element_type=jnp.float32)  # [R, V]
    elif quantization.is_quantized(params["embed"]):  # tied, quantized: see quantization.quantize_embedding
        logits = quantization.embedding_logits(x, params["embed"])
    else:
        logits = jnp.dot(x, params["embed"].T, preferred_element_type=jnp.float32)
    return soft_cap(logits, config.final_logit_softcap)


def embed_tokens(params: Params, token_ids: jax.Array) -> jax.Array:
    """The embedding rows of `token_ids` [T] -> [T, D] (in the norms' dtype when quantized)."""
    embed = params["embed"]
    if not quantization.is_quantized(embed):
        return embed[token_ids]
    return quantization.embedding_rows(embed, token_ids).astype(params["final_norm"].dtype)


def forward(params: Params, kv_cache: dict[str, jax.Array], batch: dict[str, jax.Array], *,
            config: ModelConfig, backend: str = "reference", mesh: jax.sharding.Mesh | None = None,
            prefill_hidden_rows: int = 0, max_query_len: int | None = None) -> tuple[jax.Array, ...]:
    """One model step over a batch of decode tokens followed by prefill chunks.

    With a `mesh` (tensor parallel, see jaxserve.parallel.sharding), the KV write and attention run per
    device under shard_map over its "model" axis; XLA partitions the rest from the weights.

    batch (all int32):
      token_ids, positions, slot_mapping: [num_tokens]; the first `num_decode` tokens are decode
        tokens (one per decode row), the rest belong to prefill chunks. Padding: slot 0 (null page).
      decode_block_table: [num_decode, max_pages_per_seq]; decode_seq_lens: [num_decode] (0 = padding)
      prefill_block_table: [num_prefill_seqs, max_pages_per_seq]; prefill_seq_lens: [num_prefill_seqs];
      prefill_query_start_loc: [num_prefill_seqs + 1] (offsets into the prefill tokens)
      logits_indices: [num_rows] tokens whose logits are returned
    Returns (logits [num_rows, vocab] float32, updated kv_cache); with `prefill_hidden_rows` > 0
    a third output, the prefill tokens' last residual-stream rows (before the final norm, see
    `final_logits`) zero-padded to [prefill_hidden_rows, D] ([0, D] in a step without prefill):
    what the prompt logprobs are computed from, on device.
    `max_query_len`: no prefill chunk has more tokens (a hint for the attention's blocking;
    speculative verification steps pass K + 1).
    """
    num_decode = batch["decode_seq_lens"].shape[0]
    num_prefill_seqs = batch["prefill_seq_lens"].shape[0]
    num_tokens = batch["token_ids"].shape[0]
    num_pages = kv_quant.values(kv_cache["k"]).shape[0] // config.num_layers
    page_size = kv_quant.values(kv_cache["k"]).shape[1]
    T, Hq, Hkv, hd = num_tokens, config.num_q_heads, config.num_kv_heads, config.head_dim
    eps, offset = config.rms_norm_eps, config.norm_weight_offset
    activation = _ACTIVATIONS[config.hidden_act]
    windows = config.layer_windows()  # per layer; 0: full attention
    windowed = any(windows)
    # Attention options: only what the family uses, so a plain Llama step is the one it always was.
    options: dict[str, Any] = {}
    if config.query_pre_attn_scalar is not None:
        options["scale"] = config.attention_scale
    if config.attn_logit_softcap is not None:
        options["logit_soft_cap"] = config.attn_logit_softcap
    # RoPE tables once per step; Gemma 3's sliding layers have their own base.
    cos, sin = rope_tables(batch["positions"], config.rope_inv_freq())  # [T, 1, hd // 2] each
    local_rope = config.rope_local_theta is not None
    if local_rope:
        local_cos, local_sin = rope_tables(batch["positions"], config.rope_inv_freq(sliding=True))

    def attend(q, k, v, k_cache, v_cache, window, slot_mapping, decode_block_table, decode_seq_lens,
               prefill_block_table, prefill_seq_lens, prefill_query_start_loc):
        k_cache, v_cache = dispatch.write_kv(k_cache, v_cache, k, v, slot_mapping)
        layer_options = {**options, "sliding_window": window} if windowed else options
        parts = []
        if num_decode:
            parts.append(dispatch.decode_attention(
                backend, q[:num_decode], k_cache, v_cache, decode_block_table, decode_seq_lens, **layer_options))
        if num_prefill_seqs:
            parts.append(dispatch.ragged_attention(
                backend, q[num_decode:], k_cache, v_cache, prefill_block_table, prefill_seq_lens,
                prefill_query_start_loc, max_query_len=max_query_len, **layer_options))
        attn = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)  # [T, heads, hd]
        return attn, k_cache, v_cache

    if mesh is not None:
        attend = sharding.shard_attention(attend, mesh)

    def before_attention(lp, x):  # x [T, D] -> q [T, Hq, hd], k and v [T, Hkv, hd] (before RoPE)
        h = rms_norm(x, lp["attn_norm"], eps, offset)
        q, k, v = linear(h, lp["wq"]), linear(h, lp["wk"]), linear(h, lp["wv"])
        if config.attention_bias:
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
        q, k, v = q.reshape(T, Hq, hd), k.reshape(T, Hkv, hd), v.reshape(T, Hkv, hd)
        if config.qk_norm:
            q, k = rms_norm(q, lp["q_norm"], eps, offset), rms_norm(k, lp["k_norm"], eps, offset)
        return q, k, v

    def after_attention(lp, x, attn):  # the residual stream after the layer: [T, D]
        out = linear(attn.reshape(T, Hq * hd), lp["wo"])
        if config.sandwich_norms:
            out = rms_norm(out, lp["attn_post_norm"], eps, offset)
        x = x + out
        h = rms_norm(x, lp["mlp_norm"], eps, offset)
        out = linear(activation(linear(h, lp["w_gate"])) * linear(h, lp["w_up"]), lp["w_down"])
        if config.sandwich_norms:
            out = rms_norm(out, lp["mlp_post_norm"], eps, offset)
        return x + out

    per_layer = isinstance(params["layers"], (list, tuple))  # layer_views: an array per layer
    # Stacked weights in the CPU kernel's layout (layer_views): passed whole with the layer index,
    # never sliced by the scan (a slice is a copy); the rest of the layer is sliced as usual.
    whole = {} if per_layer else {
        name: {key: w[key] for key in quantization.KERNEL_LAYOUT if key in w}
        for name, w in params["layers"].items() if isinstance(w, dict) and "packed" in w}
    sliced = None if per_layer else {
        name: {key: a for key, a in w.items() if key not in whole[name]} if name in whole else w
        for name, w in params["layers"].items()}

    def with_weights(part, lp, layer_idx, *args):
        """A part of the layer on this layer's weights: the scan's slice `lp` of the stacked
        weights, or (per-layer weights) a switch on the layer index whose branch i reads layer
        i's own arrays, which the dots then read in place (a slice of a stacked weight is a copy)."""
        if not per_layer:
            return part(lp, *args)
        return jax.lax.switch(layer_idx, [functools.partial(part, w) for w in params["layers"]], *args)

    def layer(carry, scanned):
        x, k_cache, v_cache, layer_idx = carry  # x: [T, D]
        lp, window = scanned  # this layer's slice of the stacked weights (None: per-layer weights);
        #                       its sliding window (int32 scalar, 0: none)
        page_offset = layer_idx * num_pages
        if whole:
            lp = {**lp, **{name: {**lp[name], **arrays, "layer": layer_idx} for name, arrays in whole.items()}}
        q, k, v = with_weights(before_attention, lp, layer_idx, x)
        layer_cos, layer_sin = cos, sin
        if local_rope:
            layer_cos, layer_sin = jnp.where(window > 0, local_cos, cos), jnp.where(window > 0, local_sin, sin)
        q, k = apply_rope(q, layer_cos, layer_sin), apply_rope(k, layer_cos, layer_sin)  # [T, heads, hd]
        attn, k_cache, v_cache = attend(  # attn: [T, Hq, hd]
            q, k, v, k_cache, v_cache, window, batch["slot_mapping"] + page_offset * page_size,
            batch["decode_block_table"] + page_offset, batch["decode_seq_lens"],
            batch["prefill_block_table"] + page_offset, batch["prefill_seq_lens"],
            batch["prefill_query_start_loc"])
        x = with_weights(after_attention, lp, layer_idx, x, attn)
        return (x, k_cache, v_cache, layer_idx + 1), None

    x = embed_tokens(params, batch["token_ids"])  # [T, D]
    if config.embedding_multiplier != 1.0:
        x = x * jnp.asarray(config.embedding_multiplier, x.dtype)
    carry = (x, kv_cache["k"], kv_cache["v"], jnp.int32(0))
    scanned = (sliced, jnp.asarray(windows, jnp.int32))
    (x, k_cache, v_cache, _), _ = jax.lax.scan(layer, carry, scanned)
    logits = final_logits(params, x[batch["logits_indices"]], config)  # [R, V]
    if not prefill_hidden_rows:
        return logits, {"k": k_cache, "v": v_cache}
    prefill = x[num_decode:num_decode + prefill_hidden_rows] if num_prefill_seqs else x[:0]
    if num_prefill_seqs and prefill.shape[0] < prefill_hidden_rows:
        prefill = jnp.pad(prefill, ((0, prefill_hidden_rows - prefill.shape[0]), (0, 0)))
    return logits, {"k": k_cache, "v": v_cache}, prefill
