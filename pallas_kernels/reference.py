"""Plain-jnp paged attention: the oracle of the kernel tests (and the explicit "reference"
attention backend), and the multi-LoRA update's (`lora_update`). Production code does not import
it: the engine's CPU path is xla_paged.py, the KV write and the shared helpers live in common.py.

It gathers each sequence's whole block table and soft-maxes it with a dense mask written from the
positions, transformers-style (options as in pallas_kernels.common):
  scores = scale * q.k  (scale None: head_dim ** -0.5)
  scores = cap * tanh(scores / cap)  when logit_soft_cap is set
  a query at position p sees key k iff k <= p and (window <= 0 or k > p - window)
  (ragged attention with key_limit: k <= max(p, key_limit) and k < seq_len instead of k <= p,
  the window's rule unchanged; see `ragged_paged_attention`)

Layout shared with the kernels:
  k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim]; page 0 is the null page.
  Quantized caches (kv_quant: int8 pages with per-token scales, fp8 bits) are dequantized on load.
  block_table: int32[num_seqs, max_pages_per_seq]; seq_lens: int32[num_seqs] (0 = padding row).
Query head h reads KV head h // (num_q_heads // num_kv_heads). Softmax runs in float32 and
the output has the dtype of q. Pages past a sequence's length may hold anything (NaN
included): every masked position goes through `jnp.where`, never a multiply by zero.
"""

import jax
import jax.numpy as jnp

from pallas_kernels import kv_quant
from pallas_kernels.common import check_heads, queries_per_sequence, to_ragged

_HIGHEST = jax.lax.Precision.HIGHEST


def _gather_context(pages, block_table):
    """[num_pages, page_size, kv, d] -> [num_seqs, max_pages * page_size, kv, d] in float32."""
    num_seqs, max_pages = block_table.shape
    _, page_size, num_kv_heads, head_dim = kv_quant.values(pages).shape
    context = kv_quant.gather(pages, block_table)  # [num_seqs, max_pages, page_size, kv, d] f32
    return context.reshape(num_seqs, max_pages * page_size, num_kv_heads, head_dim)


def _masked_softmax_attention(scores, valid, v_context):
    """Softmax over the last axis of `scores` where `valid`, then weights @ V.

    scores, valid: [num_seqs, kv, group, num_queries, context_len]
    v_context: [num_seqs, context_len, kv, head_dim]
    Rows with no valid position give zeros. Returns [num_seqs, kv, group, num_queries, d].
    """
    scores = jnp.where(valid, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(valid, jnp.exp(scores - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    # Zero V at positions no query of the sequence may read, so NaN garbage cannot leak.
    readable = jnp.any(valid, axis=(1, 2, 3))  # [num_seqs, context_len]
    v_context = jnp.where(readable[:, :, None, None], v_context, 0.0)
    out = jnp.einsum("skgqt,stkd->skgqd", weights, v_context, precision=_HIGHEST)
    return jnp.where(denom > 0, out / jnp.where(denom > 0, denom, 1.0), 0.0)


def _grouped_queries(q, num_kv_heads):
    """[..., num_q_heads, d] -> [..., kv, group, d] in float32."""
    *lead, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    return q.astype(jnp.float32).reshape(*lead, num_kv_heads, group, head_dim)


def _scores(q, k_context, equation, scale, logit_soft_cap):
    """scale * q.k (einsum `equation`), soft-capped when logit_soft_cap is set; float32."""
    scores = scale * jnp.einsum(equation, q, k_context, precision=_HIGHEST)
    return scores if logit_soft_cap is None else logit_soft_cap * jnp.tanh(scores / logit_soft_cap)


def _visible(query_pos, key_pos, sliding_window, limit=None):
    """Causal mask, narrowed to a sliding window as transformers' sliding_window_overlay does:
    key_pos <= query_pos and key_pos > query_pos - window (when window > 0). Broadcasts.
    With `limit` (the highest key position each query may see, >= query_pos): key_pos <= limit
    in place of key_pos <= query_pos; the window's rule stays on query_pos - key_pos."""
    visible = key_pos <= (query_pos if limit is None else limit)
    if sliding_window is not None:
        window = jnp.asarray(sliding_window, jnp.int32)
        visible = visible & ((window <= 0) | (key_pos > query_pos - window))
    return visible


def paged_decode_attention(q, k_pages, v_pages, block_table, seq_lens, *, sliding_window=None,
                           scale=None, logit_soft_cap=None, interpret=False):
    """One query token per sequence against that sequence's pages (its last token).

    q: [num_seqs, num_q_heads, head_dim] -> [num_seqs, num_q_heads, head_dim] (dtype of q).
    Rows whose seq_lens is 0 give zeros. `interpret` is accepted for signature parity.
    """
    del interpret
    check_heads(q, k_pages)
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, page_size = kv_quant.values(k_pages).shape[2], kv_quant.values(k_pages).shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    k_context = _gather_context(k_pages, block_table)  # [s, t, kv, d]
    v_context = _gather_context(v_pages, block_table)
    q_grouped = _grouped_queries(q, num_kv_heads)[:, :, :, None, :]  # [s, kv, g, 1, d]
    scores = _scores(q_grouped, k_context, "skgqd,stkd->skgqt", scale, logit_soft_cap)
    positions = jnp.arange(block_table.shape[1] * page_size)
    valid = _visible(seq_lens[:, None] - 1, positions[None, :], sliding_window)  # [s, t]
    out = _masked_softmax_attention(scores, valid[:, None, None, None, :], v_context)
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)


def ragged_paged_attention(
    q, k_pages, v_pages, block_table, seq_lens, query_start_loc, *, key_limit=None, sliding_window=None,
    scale=None, logit_soft_cap=None, interpret=False,
):
    """Causal attention of a ragged batch of query tokens against their sequences' pages.

    q: [num_tokens, num_q_heads, head_dim]. The tokens of sequence i are
    q[query_start_loc[i]:query_start_loc[i+1]], the last tokens of a sequence of total length
    seq_lens[i] (their K/V already written); query_start_loc is non-decreasing (padding rows
    repeat the last value). Tokens past query_start_loc[num_seqs] and rows with
    seq_lens 0 give zeros. Queries are laid out padded per sequence, [num_seqs, num_tokens, ...]:
    cheap for the few prefill sequences a step carries.

    key_limit (int32[num_tokens] or None: causal): the highest key position each query token may
    see, for bidirectional attention among the tokens of an image (Gemma 3): a token of an image
    span [s, e) of its sequence's positions gets e - 1, any other token its own position. A query
    at position p then sees the keys k <= max(p, key_limit) below its sequence's length, with a
    sliding window also p - k < window (a key after the query is always inside it).
    """
    del interpret
    check_heads(q, k_pages)
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs, max_pages = block_table.shape
    num_kv_heads, page_size = kv_quant.values(k_pages).shape[2], kv_quant.values(k_pages).shape[1]
    scale = head_dim**-0.5 if scale is None else scale
    q_padded, query_pos, query_valid = queries_per_sequence(q, seq_lens, query_start_loc, num_seqs, num_kv_heads)
    k_context = _gather_context(k_pages, block_table)  # [s, t, kv, d]
    v_context = _gather_context(v_pages, block_table)
    scores = _scores(q_padded, k_context, "sqkgd,stkd->skgqt", scale, logit_soft_cap)
    key_pos = jnp.arange(max_pages * page_size)  # [t]
    limit = None
    if key_limit is not None:  # each query's limit, laid out as the queries, never below its position
        slot = jnp.arange(num_tokens)
        token_index = jnp.clip(query_start_loc[:num_seqs, None] + slot[None, :], 0, num_tokens - 1)  # [s, q]
        limit = jnp.minimum(jnp.maximum(query_pos, key_limit.astype(jnp.int32)[token_index]),
                            seq_lens[:, None] - 1)[:, :, None]
    valid = _visible(query_pos[:, :, None], key_pos[None, None, :], sliding_window, limit)
    valid = valid & query_valid[:, :, None]  # [s, q, t]
    out = _masked_softmax_attention(scores, valid[:, None, None, :, :], v_context)  # [s,kv,g,q,d]
    out = out.transpose(0, 3, 1, 2, 4).reshape(num_seqs, num_tokens, num_q_heads, head_dim)
    return to_ragged(out, query_start_loc).astype(q.dtype)


def lora_update(x, a, b, slots):
    """The multi-LoRA update row by row: x [T, K] through a[slots[t]] [K, R] then b[slots[t]]
    [R, N] (gathered per row), in float32 at full precision -> [T, N] in x's dtype."""
    f32 = jnp.float32
    shrunk = jnp.einsum("tk,tkr->tr", x.astype(f32), a[slots].astype(f32), precision=_HIGHEST)
    return jnp.einsum("tr,trn->tn", shrunk, b[slots].astype(f32), precision=_HIGHEST).astype(x.dtype)
