"""Paged attention in plain XLA for the CPU: a loop over the context a few pages at a time.

Same signatures, layout and results as the Pallas kernels and the test oracle reference.py
(options: pallas_kernels.common), computed differently:
`reference` gathers every sequence's whole block table into one [seqs, max_pages * page_size, ...]
context and soft-maxes it; here a `lax.while_loop` walks the block table `pages_per_block` pages
at a time with an online softmax (running max, running sum, rescaled accumulator) and stops after
the block holding the longest sequence of the call. So:

  * cost follows the longest sequence actually present, not the block table's width: the engine
    can pass one full-width block table and compile one shape for all context lengths; with a
    sliding window the loop also starts at the first block any query of the call sees;
  * each block's gathered K/V ([seqs, block tokens, kv, d]) stays in the CPU caches between its
    gather and its two dots, instead of a round trip through memory for the whole padded context
    (bench/step_profile.py in bench/RESULTS.md: a 64-row SmolLM2 decode step in 225 ms instead of
    642 ms with the reference over the same 64-page table).

A sequence's result does not depend on the other sequences: blocks past its length (or before
its window) are fully masked, which leaves its running max, sum and accumulator bit-for-bit
unchanged (the rescale factor is exp(0) = 1, or 0 times an empty state, and the added terms are
zeros). Softmax in float32; output in q's dtype.
"""

import jax
import jax.numpy as jnp

from pallas_kernels import kv_quant
from pallas_kernels.common import (
    check_heads, first_visible_key, in_window, queries_per_sequence, soft_cap, softmax_scale,
    to_ragged, window_size,
)

_HIGHEST = jax.lax.Precision.HIGHEST
DECODE_PAGES_PER_BLOCK = 2  # 32 tokens at page size 16: the fastest of 1, 2, 4, 8, 16 measured
PREFILL_PAGES_PER_BLOCK = 8  # a prefill block serves many queries: larger blocks, fewer loop steps


def _padded_table(block_table, pages_per_block):
    """Block table padded with null pages to a multiple of the block width."""
    pad = (-block_table.shape[1]) % pages_per_block
    return jnp.pad(block_table, ((0, 0), (0, pad))) if pad else block_table


def _gather_block(pages, block_table, block, pages_per_block):
    """K or V of one block for every sequence: [num_seqs, pages_per_block * page_size, kv, d] f32."""
    ids = jax.lax.dynamic_slice_in_dim(block_table, block * pages_per_block, pages_per_block, axis=1)
    context = kv_quant.gather(pages, ids)  # [s, pages_per_block, page_size, kv, d]
    num_seqs, _, page_size, num_kv_heads, head_dim = context.shape
    return context.reshape(num_seqs, pages_per_block * page_size, num_kv_heads, head_dim)


def _online_softmax_step(state, scores, valid, v_block):
    """Folds one block into (running max, running sum, accumulator).

    state: m, l [..., q] and acc [..., q, d], with `...` = (num_seqs, kv, group);
    scores, valid: [..., q, t]; v_block: [num_seqs, t, kv, d] (zeroed where no query reads it).
    """
    m, l, acc = state
    scores = jnp.where(valid, scores, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    weights = jnp.where(valid, jnp.exp(scores - m_safe[..., None]), 0.0)
    rescale = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
    update = jnp.einsum("skgqt,stkd->skgqd", weights, v_block, precision=_HIGHEST)
    return m_new, l * rescale + jnp.sum(weights, axis=-1), acc * rescale[..., None] + update


def _finish(state):
    _, l, acc = state
    return jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)


def _num_blocks(seq_lens, block_tokens):
    """Blocks the longest sequence needs (a traced scalar: the loop's dynamic trip count)."""
    return (jnp.max(seq_lens, initial=0) + block_tokens - 1) // block_tokens


def _first_block(first_keys, active, block_tokens):
    """First block any active query reads (a traced scalar: the loop's dynamic lower bound).
    first_keys, active: same shape; no active query gives a bound past every block."""
    never = jnp.iinfo(jnp.int32).max
    return jnp.min(jnp.where(active, first_keys, never), initial=never) // block_tokens


def paged_decode_attention(q, k_pages, v_pages, block_table, seq_lens, *, sliding_window=None,
                           scale=None, logit_soft_cap=None, pages_per_block=DECODE_PAGES_PER_BLOCK):
    """One query token per sequence (its last token, K/V already written).

    q: [num_seqs, num_q_heads, head_dim] -> [num_seqs, num_q_heads, head_dim] (dtype of q);
    block_table: int32[num_seqs, max_pages]; seq_lens: int32[num_seqs] (0: padding row, zeros).
    sliding_window (int32 scalar or None), scale, logit_soft_cap: see pallas_kernels.common."""
    check_heads(q, k_pages)
    num_seqs, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_quant.values(k_pages).shape[1:3]
    scale = softmax_scale(scale, head_dim)
    pages_per_block = min(pages_per_block, block_table.shape[1])
    block_table = _padded_table(block_table, pages_per_block)
    group = num_q_heads // num_kv_heads
    block_tokens = pages_per_block * page_size
    q_grouped = q.astype(jnp.float32).reshape(num_seqs, num_kv_heads, group, 1, head_dim)
    first_block, first_key = 0, None
    if sliding_window is not None:  # the query sits at seq_len - 1
        first_key = first_visible_key(seq_lens - 1, window_size(sliding_window))  # [s]
        first_block = _first_block(first_key, seq_lens > 0, block_tokens)

    def body(block, state):
        k = _gather_block(k_pages, block_table, block, pages_per_block)  # [s, t, kv, d]
        v = _gather_block(v_pages, block_table, block, pages_per_block)
        scores = scale * jnp.einsum("skgqd,stkd->skgqt", q_grouped, k, precision=_HIGHEST)
        scores = soft_cap(scores, logit_soft_cap)
        key_pos = block * block_tokens + jnp.arange(block_tokens)[None, :]  # [1, t]
        valid = key_pos < seq_lens[:, None]  # [s, t]
        if first_key is not None:
            valid = valid & (key_pos >= first_key[:, None])
        v = jnp.where(valid[:, :, None, None], v, 0.0)  # garbage (NaN included) never reaches acc
        return _online_softmax_step(state, scores, valid[:, None, None, None, :], v)

    shape = (num_seqs, num_kv_heads, group, 1)
    state = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros((*shape, head_dim)))
    state = jax.lax.fori_loop(first_block, _num_blocks(seq_lens, block_tokens), body, state)
    return _finish(state).reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)


def ragged_paged_attention(q, k_pages, v_pages, block_table, seq_lens, query_start_loc, *,
                           sliding_window=None, scale=None, logit_soft_cap=None,
                           pages_per_block=PREFILL_PAGES_PER_BLOCK):
    """Causal attention of a ragged batch of query tokens against their sequences' pages.

    q: [num_tokens, num_q_heads, head_dim] -> same shape. The tokens of sequence i are
    q[query_start_loc[i]:query_start_loc[i+1]], the last tokens of a sequence of total length
    seq_lens[i]; query_start_loc (int32[num_seqs + 1]) is non-decreasing (padding rows repeat the
    last value). Tokens past query_start_loc[num_seqs] and rows with seq_lens 0 give zeros.
    sliding_window (int32 scalar or None), scale, logit_soft_cap: see pallas_kernels.common.
    Queries are padded per sequence to [num_seqs, num_tokens] (cheap for the few prefill
    sequences of a step)."""
    check_heads(q, k_pages)
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = block_table.shape[0]
    page_size, num_kv_heads = kv_quant.values(k_pages).shape[1:3]
    group = num_q_heads // num_kv_heads
    scale = softmax_scale(scale, head_dim)
    pages_per_block = min(pages_per_block, block_table.shape[1])
    block_table = _padded_table(block_table, pages_per_block)
    block_tokens = pages_per_block * page_size

    q_padded, query_pos, query_valid = queries_per_sequence(
        q, seq_lens, query_start_loc, num_seqs, num_kv_heads)  # [s, q, kv, g, d], [s, q], [s, q]
    first_block, window = 0, None
    if sliding_window is not None:
        window = window_size(sliding_window)
        first_block = _first_block(first_visible_key(query_pos, window), query_valid, block_tokens)

    def body(block, state):
        k = _gather_block(k_pages, block_table, block, pages_per_block)  # [s, t, kv, d]
        v = _gather_block(v_pages, block_table, block, pages_per_block)
        scores = scale * jnp.einsum("sqkgd,stkd->skgqt", q_padded, k, precision=_HIGHEST)
        scores = soft_cap(scores, logit_soft_cap)
        key_pos = block * block_tokens + jnp.arange(block_tokens)  # [t]
        if window is None:
            visible = key_pos[None, None, :] <= query_pos[:, :, None]
        else:
            visible = in_window(query_pos[:, :, None], key_pos[None, None, :], window)
        valid = visible & query_valid[:, :, None]  # [s, q, t]
        readable = jnp.any(valid, axis=1)  # [s, t]
        v = jnp.where(readable[:, :, None, None], v, 0.0)
        return _online_softmax_step(state, scores, valid[:, None, None, :, :], v)

    shape = (num_seqs, num_kv_heads, group, num_tokens)
    state = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros((*shape, head_dim)))
    state = jax.lax.fori_loop(first_block, _num_blocks(seq_lens, block_tokens), body, state)
    out = _finish(state)  # [s, kv, g, q, d]
    out = out.transpose(0, 3, 1, 2, 4).reshape(num_seqs, num_tokens, num_q_heads, head_dim)
    return to_ragged(out, query_start_loc).astype(q.dtype)
