"""Plain-jnp paged attention: the oracle of the kernel tests and the engine's CPU path.

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

_HIGHEST = jax.lax.Precision.HIGHEST


def write_kv(k_pages, v_pages, k, v, slot_mapping):
    """Scatters new K/V rows into their slots; in place under jit with donated pages.

    k, v: [num_tokens, num_kv_heads, head_dim]; slot_mapping: int32[num_tokens] holding
    page * page_size + offset (padding tokens point into page 0).
    Returns (k_pages, v_pages) with the same shapes and dtypes (quantized caches quantize the rows).
    """
    return kv_quant.write_rows(k_pages, k, slot_mapping), kv_quant.write_rows(v_pages, v, slot_mapping)


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


def check_heads(q, k_pages):
    """ValueError unless q's heads divide evenly over the pages' KV heads with the same head_dim."""
    k_pages = kv_quant.values(k_pages)
    num_q_heads, num_kv_heads = q.shape[-2], k_pages.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if q.shape[-1] != k_pages.shape[-1]:
        raise ValueError(f"head_dim of q ({q.shape[-1]}) != head_dim of pages ({k_pages.shape[-1]})")


def paged_decode_attention(q, k_pages, v_pages, block_table, seq_lens, *, scale=None, interpret=False):
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
    scores = scale * jnp.einsum("skgqd,stkd->skgqt", q_grouped, k_context, precision=_HIGHEST)
    positions = jnp.arange(block_table.shape[1] * page_size)
    valid = positions[None, :] < seq_lens[:, None]  # [s, t]
    out = _masked_softmax_attention(scores, valid[:, None, None, None, :], v_context)
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)


def ragged_paged_attention(
    q, k_pages, v_pages, block_table, seq_lens, query_start_loc, *, scale=None, interpret=False
):
    """Causal attention of a ragged batch of query tokens against their sequences' pages.

    q: [num_tokens, num_q_heads, head_dim]. The tokens of sequence i are
    q[query_start_loc[i]:query_start_loc[i+1]], the last tokens of a sequence of total length
    seq_lens[i] (their K/V already written); query_start_loc is non-decreasing (padding rows
    repeat the last value). Tokens past query_start_loc[num_seqs] and rows with
    seq_lens 0 give zeros. Queries are laid out padded per sequence, [num_seqs, num_tokens, ...]:
    cheap for the few prefill sequences a step carries.
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
    scores = scale * jnp.einsum("sqkgd,stkd->skgqt", q_padded, k_context, precision=_HIGHEST)
    key_pos = jnp.arange(max_pages * page_size)  # [t]
    valid = (key_pos[None, None, :] <= query_pos[:, :, None]) & query_valid[:, :, None]  # [s, q, t]
    out = _masked_softmax_attention(scores, valid[:, None, None, :, :], v_context)  # [s,kv,g,q,d]
    out = out.transpose(0, 3, 1, 2, 4).reshape(num_seqs, num_tokens, num_q_heads, head_dim)
    return to_ragged(out, query_start_loc).astype(q.dtype)


def queries_per_sequence(q, seq_lens, query_start_loc, num_seqs, num_kv_heads):
    """Ragged queries [num_tokens, heads, d] laid out per sequence.

    Returns q_padded [s, num_tokens, kv, group, d] float32 (zeros where invalid), the position of
    each query in its sequence query_pos [s, num_tokens] and query_valid [s, num_tokens]."""
    num_tokens = q.shape[0]
    starts = query_start_loc[:num_seqs]  # [s]
    query_lens = query_start_loc[1 : num_seqs + 1] - starts  # [s]
    slot = jnp.arange(num_tokens)  # index of a query inside its sequence
    token_index = jnp.clip(starts[:, None] + slot[None, :], 0, num_tokens - 1)  # [s, q]
    query_valid = (slot[None, :] < query_lens[:, None]) & (seq_lens[:, None] > 0)  # [s, q]
    q_padded = _grouped_queries(q[token_index], num_kv_heads)  # [s, q, kv, g, d]
    q_padded = jnp.where(query_valid[:, :, None, None, None], q_padded, 0.0)
    query_pos = (seq_lens - query_lens)[:, None] + slot[None, :]  # [s, q]
    return q_padded, query_pos, query_valid


def to_ragged(out, query_start_loc):
    """Per-sequence results [s, num_tokens, heads, d] back to the ragged layout [num_tokens, heads, d]:
    token t reads row (its sequence, t - start of that sequence); tokens past the last sequence are 0."""
    num_seqs, num_tokens = out.shape[:2]
    starts = query_start_loc[:num_seqs]
    tokens = jnp.arange(num_tokens)
    seq_of_token = jnp.searchsorted(query_start_loc[1 : num_seqs + 1], tokens, side="right")
    token_valid = tokens < query_start_loc[num_seqs]
    seq_of_token = jnp.clip(seq_of_token, 0, num_seqs - 1)
    slot_of_token = jnp.clip(tokens - starts[seq_of_token], 0, num_tokens - 1)
    return jnp.where(token_valid[:, None, None], out[seq_of_token, slot_of_token], 0.0)
