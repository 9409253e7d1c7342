"""Paged attention in plain XLA for the CPU: a loop over the context a few pages at a time.

Same signatures, layout and results as the Pallas kernels and the test oracle reference.py
(options: pallas_kernels.common), computed differently:
`reference` gathers every sequence's whole block table into one [seqs, max_pages * page_size, ...]
context and soft-maxes it; here `lax` loops walk the block table `pages_per_block` pages at a time
with an online softmax (running max, running sum, rescaled accumulator) and stop after the block
holding the longest sequence (decode) or each chunk's last query (prefill). So:

  * cost follows the context actually present, not the block table's width: the engine can pass
    one full-width block table and compile one shape for all context lengths; with a sliding
    window the loop also starts at the first block any query sees;
  * each block's gathered K/V stays in the CPU caches between its gather and its two dots,
    instead of a round trip through memory for the whole padded context;
  * decode: the block size follows the number of rows (`decode_pages_per_block`): on XLA:CPU a
    loop iteration costs a dozen ops on top of its bytes, so one row takes 16 pages per
    iteration; many rows take 2, so that a block of every row stays in the cache. The gathered
    block is used as it lies (no transpose), see `paged_decode_attention`;
  * prefill: the work follows the causal triangle of the sequences present: chunks of one
    sequence's queries, each over the key blocks its queries see; a padding sequence costs
    nothing (bench/step_profile.py --prefill_tokens in bench/RESULTS.md).

A sequence's result does not depend on the other sequences: blocks past its length (or before
its window) are fully masked, which leaves its running max, sum and accumulator bit-for-bit
unchanged (the rescale factor is exp(0) = 1, or 0 times an empty state, and the added terms are
zeros); decode sums run in dots, whose order does not depend on the number of rows (tested).
The decode block size follows the number of rows and the prefill query chunk the step's tokens,
so a step of another bucket may round differently. Softmax in float32; output in q's dtype.
"""

import jax
import jax.numpy as jnp

from pallas_kernels import kv_quant
from pallas_kernels.common import (
    check_heads, first_visible_key, in_window, soft_cap, softmax_scale, window_size,
)

_HIGHEST = jax.lax.Precision.HIGHEST
DECODE_PAGES_PER_BLOCK = None  # None: decode_pages_per_block(rows), see there
DECODE_BLOCK_BYTES = 2**20  # K (or V) bytes a decode block gathers for all rows: stays in the L2 cache
DECODE_MAX_PAGES_PER_BLOCK = 16
PREFILL_PAGES_PER_BLOCK = 8  # a prefill block serves many queries: larger blocks, fewer loop steps
PREFILL_QUERY_CHUNK = 128  # queries of one sequence per outer step of the prefill attention


def _padded_table(block_table, pages_per_block, min_blocks=1):
    """Block table padded with null pages to a multiple of the block width, at least `min_blocks`
    blocks wide."""
    width = block_table.shape[1]
    pad = max(-(-width // pages_per_block), min_blocks) * pages_per_block - width
    return jnp.pad(block_table, ((0, 0), (0, pad))) if pad else block_table


def _gather_block(pages, block_table, block, pages_per_block):
    """K or V of one block for every sequence: [num_seqs, pages_per_block * page_size, kv, d] f32."""
    ids = jax.lax.dynamic_slice_in_dim(block_table, block * pages_per_block, pages_per_block, axis=1)
    context = kv_quant.gather(pages, ids)  # [s, pages_per_block, page_size, kv, d]
    num_seqs, _, page_size, num_kv_heads, head_dim = context.shape
    return context.reshape(num_seqs, pages_per_block * page_size, num_kv_heads, head_dim)


def _online_softmax_step(state, scores, valid, v_block, equation="skgqt,stkd->skgqd"):
    """Folds one block into (running max, running sum, accumulator).

    state: m, l [..., q] and acc [..., q, d], with `...` = (num_seqs, kv, group) (the ragged
    path: (kv, group), v_block [t, kv, d] and `equation` "kgqt,tkd->kgqd");
    scores, valid: [..., q, t]; v_block: [num_seqs, t, kv, d] (zeroed where no query reads it).
    """
    m, l, acc = state
    scores = jnp.where(valid, scores, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    weights = jnp.where(valid, jnp.exp(scores - m_safe[..., None]), 0.0)
    rescale = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
    update = jnp.einsum(equation, weights, v_block, precision=_HIGHEST)
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


def decode_pages_per_block(num_seqs, page_size, num_kv_heads, head_dim):
    """Pages per loop iteration of a decode call: as many as keep one block's K of every row
    within DECODE_BLOCK_BYTES (float32), a power of two from 2 to DECODE_MAX_PAGES_PER_BLOCK.

    Each iteration costs a fixed dozen XLA ops on top of its bytes, so few rows take large blocks
    (SmolLM2, 30 layers, ~500-token contexts, bench/step_profile.py: 1 row 16 pages, 8 rows 8, 64
    rows 2); many rows take small ones, so that the gathered block stays in the cache between its
    gather and its two dots."""
    row_page_bytes = page_size * num_kv_heads * head_dim * 4
    pages = max(1, DECODE_BLOCK_BYTES // max(1, num_seqs * row_page_bytes))
    pages = 1 << (pages.bit_length() - 1)  # a power of two
    return int(min(max(pages, 2), DECODE_MAX_PAGES_PER_BLOCK))


def paged_decode_attention(q, k_pages, v_pages, block_table, seq_lens, *, sliding_window=None,
                           scale=None, logit_soft_cap=None, pages_per_block=DECODE_PAGES_PER_BLOCK):
    """One query token per sequence (its last token, K/V already written).

    q: [num_seqs, num_q_heads, head_dim] -> [num_seqs, num_q_heads, head_dim] (dtype of q);
    block_table: int32[num_seqs, max_pages]; seq_lens: int32[num_seqs] (0: padding row, zeros).
    sliding_window (int32 scalar or None), scale, logit_soft_cap: see pallas_kernels.common.
    pages_per_block: pages per loop iteration (None: decode_pages_per_block).

    A block's gathered pages are used as they lie, [rows, tokens * kv_heads, head_dim] (column j:
    token j // kv_heads, KV head j % kv_heads), so both dots are plain batched matmuls over the
    rows with no transpose of the block: every query head scores every column and the columns of
    other KV heads are masked out of the softmax. That is kv_heads times the dot FLOPs of a
    grouped formulation, which costs less than transposing each gathered block ([rows, tokens,
    kv, d] -> [rows, kv, tokens, d]) on XLA:CPU, where the gather is the expensive part."""
    check_heads(q, k_pages)
    num_seqs, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_quant.values(k_pages).shape[1:3]
    scale = softmax_scale(scale, head_dim)
    if pages_per_block is None:  # (not capped by the table's width, which must not change results)
        pages_per_block = decode_pages_per_block(num_seqs, page_size, num_kv_heads, head_dim)
    # At least two blocks wide: with a table of one block a decode step's time grew with the KV
    # pool's size (SmolLM2 with max_model_len <= 256: 440 ms per step instead of 18; XLA:CPU
    # apparently copies the cache). The loop never reaches the padding block: results unchanged.
    block_table = _padded_table(block_table, pages_per_block, min_blocks=2)
    group = num_q_heads // num_kv_heads
    block_tokens = pages_per_block * page_size
    width = block_tokens * num_kv_heads  # columns of a block: (token, KV head)
    # The columns in two halves, a batch dimension of the dots besides the rows: XLA drops a batch
    # dimension of size 1 and would pick another dot algorithm for a single row, whose result
    # must be the same bits as next to other rows.
    parts = 2 if width % 2 == 0 else 1
    column = jnp.arange(width).reshape(parts, 1, width // parts)  # [p, 1, j]
    column_token = column // num_kv_heads
    own_head = column % num_kv_heads == (jnp.arange(num_q_heads) // group)[None, :, None]  # [p, h, j]
    q_scaled = jnp.broadcast_to((q.astype(jnp.float32) * scale)[:, None], (num_seqs, parts, num_q_heads, head_dim))
    first_block, first_key = 0, None
    if sliding_window is not None:  # the query sits at seq_len - 1
        first_key = first_visible_key(seq_lens - 1, window_size(sliding_window))  # [s]
        first_block = _first_block(first_key, seq_lens > 0, block_tokens)

    def gather(pages, block):  # [s, p, j, d]
        blk = _gather_block(pages, block_table, block, pages_per_block)
        return blk.reshape(num_seqs, parts, width // parts, head_dim)

    def body(block, state):
        m, l, acc = state  # [s, h], [s, h], [s, h, d]
        k, v = gather(k_pages, block), gather(v_pages, block)
        scores = soft_cap(jnp.einsum("sphd,spjd->sphj", q_scaled, k, precision=_HIGHEST), logit_soft_cap)
        key_pos = block * block_tokens + column_token  # [p, 1, j]
        readable = key_pos[None] < seq_lens[:, None, None, None]  # [s, p, 1, j]
        if first_key is not None:
            readable = readable & (key_pos[None] >= first_key[:, None, None, None])
        valid = readable & own_head[None]  # [s, p, h, j]
        # V with a column of ones, so that the dot also sums the weights: XLA's reductions order
        # their sums by the array's shape, the dot's are the same for every row count.
        v = jnp.concatenate([v, jnp.ones_like(v[..., :1])], axis=-1)
        v = jnp.where(readable[:, :, 0, :, None], v, 0.0)  # garbage (NaN included) never reaches acc
        scores = jnp.where(valid, scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=(1, 3)))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        weights = jnp.where(valid, jnp.exp(scores - m_safe[:, None, :, None]), 0.0)
        rescale = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        update = jnp.einsum("sphj,spjd->sphd", weights, v, precision=_HIGHEST)  # [s, p, h, d + 1]
        update = update[:, 0] + update[:, 1] if parts == 2 else update[:, 0]
        return m_new, l * rescale + update[..., -1], acc * rescale[..., None] + update[..., :-1]

    shape = (num_seqs, num_q_heads)
    state = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros((*shape, head_dim)))
    state = jax.lax.fori_loop(first_block, _num_blocks(seq_lens, block_tokens), body, state)
    return _finish(state).astype(q.dtype)


def ragged_paged_attention(q, k_pages, v_pages, block_table, seq_lens, query_start_loc, *, key_limit=None,
                           sliding_window=None, scale=None, logit_soft_cap=None,
                           pages_per_block=PREFILL_PAGES_PER_BLOCK, query_chunk=PREFILL_QUERY_CHUNK):
    """Causal attention of a ragged batch of query tokens against their sequences' pages.

    q: [num_tokens, num_q_heads, head_dim] -> same shape. The tokens of sequence i are
    q[query_start_loc[i]:query_start_loc[i+1]], the last tokens of a sequence of total length
    seq_lens[i]; query_start_loc (int32[num_seqs + 1]) is non-decreasing (padding rows repeat the
    last value). Tokens past query_start_loc[num_seqs] and rows with seq_lens 0 give zeros.
    sliding_window (int32 scalar or None), scale, logit_soft_cap: see pallas_kernels.common.
    key_limit (int32[num_tokens] or None: causal): the highest key position each query may see
    (bidirectional image spans, see pallas_kernels.reference.ragged_paged_attention): a query at
    position p sees the keys k <= max(p, key_limit) below its sequence's length, the window's
    rule on p - k unchanged. A chunk's key blocks then run to its largest limit.

    The work follows the causal triangle of the sequences present: an outer loop over chunks of
    `query_chunk` queries of one sequence (as many as the call's sequences need, a trip count
    known at run time: a padding sequence costs nothing), an inner loop over the key blocks of
    `pages_per_block` pages that the chunk's queries see (from its window's first key to its
    last query), each folded into the chunk's online softmax."""
    check_heads(q, k_pages)
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs = block_table.shape[0]
    page_size, num_kv_heads = kv_quant.values(k_pages).shape[1:3]
    group = num_q_heads // num_kv_heads
    scale = softmax_scale(scale, head_dim)
    pages_per_block = min(pages_per_block, block_table.shape[1])
    block_table = _padded_table(block_table, pages_per_block)
    block_tokens = pages_per_block * page_size
    chunk = max(1, min(query_chunk, num_tokens))
    window = None if sliding_window is None else window_size(sliding_window)

    starts = query_start_loc[:num_seqs]
    ends = query_start_loc[1:num_seqs + 1]
    query_lens = jnp.where(seq_lens > 0, ends - starts, 0)  # [s]
    chunks = (query_lens + chunk - 1) // chunk  # [s]
    chunk_ends = jnp.cumsum(chunks)  # chunk j belongs to the first sequence i with j < chunk_ends[i]
    q_scaled = q.astype(jnp.float32) * scale

    def chunk_body(j, out):
        i = jnp.minimum(jnp.searchsorted(chunk_ends, j, side="right"), num_seqs - 1)
        first_query = starts[i] + (j - (chunk_ends[i] - chunks[i])) * chunk  # token index
        last_query = jnp.minimum(first_query + chunk, starts[i] + query_lens[i])  # exclusive
        origin = jnp.clip(first_query, 0, num_tokens - chunk)  # where the [chunk] rows start
        tokens = origin + jnp.arange(chunk)
        query_valid = (tokens >= first_query) & (tokens < last_query)  # [c]
        query_pos = seq_lens[i] - (starts[i] + query_lens[i]) + tokens  # [c]
        qc = jax.lax.dynamic_slice_in_dim(q_scaled, origin, chunk).reshape(chunk, num_kv_heads, group, head_dim)
        table = jax.lax.dynamic_index_in_dim(block_table, i, keepdims=True)  # [1, pages]
        last_pos = seq_lens[i] - (starts[i] + query_lens[i]) + last_query - 1
        limit = None
        if key_limit is not None:  # each query's highest key, the chunk's key blocks up to their largest
            chunk_limits = jax.lax.dynamic_slice_in_dim(key_limit.astype(jnp.int32), origin, chunk)
            limit = jnp.minimum(jnp.maximum(query_pos, chunk_limits), seq_lens[i] - 1)  # [c]
            last_pos = jnp.maximum(last_pos, jnp.max(jnp.where(query_valid, limit, -1)))
        first_block = 0
        if window is not None:
            first_pos = seq_lens[i] - (starts[i] + query_lens[i]) + first_query
            first_block = first_visible_key(first_pos, window) // block_tokens

        def block_body(block, state):
            k = _gather_block(k_pages, table, block, pages_per_block)[0]  # [t, kv, d]
            v = _gather_block(v_pages, table, block, pages_per_block)[0]
            scores = soft_cap(jnp.einsum("qkgd,tkd->kgqt", qc, k, precision=_HIGHEST), logit_soft_cap)
            key_pos = block * block_tokens + jnp.arange(block_tokens)  # [t]
            if limit is not None:  # the window's rule on query_pos - key_pos holds for keys after the query
                visible = key_pos[None, :] <= limit[:, None]
                if window is not None:
                    visible = visible & (query_pos[:, None] - key_pos[None, :] < window)
            elif window is None:
                visible = key_pos[None, :] <= query_pos[:, None]
            else:
                visible = in_window(query_pos[:, None], key_pos[None, :], window)
            valid = visible & query_valid[:, None]  # [c, t]
            v = jnp.where(jnp.any(valid, axis=0)[:, None, None], v, 0.0)
            return _online_softmax_step(state, scores, valid, v, "kgqt,tkd->kgqd")

        shape = (num_kv_heads, group, chunk)
        state = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros((*shape, head_dim)))
        state = jax.lax.fori_loop(first_block, last_pos // block_tokens + 1, block_body, state)
        rows = _finish(state).transpose(2, 0, 1, 3).reshape(chunk, num_q_heads, head_dim)  # [c, h, d]
        old = jax.lax.dynamic_slice_in_dim(out, origin, chunk)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(query_valid[:, None, None], rows, old), origin, 0)

    out = jnp.zeros((num_tokens, num_q_heads, head_dim), jnp.float32)
    out = jax.lax.fori_loop(0, chunk_ends[-1] if num_seqs else 0, chunk_body, out)
    return out.astype(q.dtype)
