"""Pallas ragged paged attention: prefill chunks and decode tokens of several sequences at once.

The query tokens of a batch are cut, per sequence, into blocks of `block_q` tokens; a small jnp
schedule maps each program of the grid (query block, kv head) to its sequence and first token
(the grid is sized for the worst case and spare programs do nothing). A program takes its query
block times the query heads of one KV head as the rows of its dots ([block_q * group_pad, d]),
walks that sequence's pages up to the causal limit of its last row (from the first block its
first row's sliding window reaches, with a window) with an online softmax, and writes its own
output block, so no two programs write the same memory. Options (sliding_window, scale,
logit_soft_cap): see pallas_kernels.common.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import compat, kv_quant
from pallas_kernels.common import first_visible_key, in_window, softmax_scale, window_size
from pallas_kernels.pallas_common import (
    MIN_DOT_ROWS, cdiv, default_keys_per_block, init_carry, load_pages, next_power_of_2,
    online_softmax_step,
)


def _ragged_kernel(
    block_seq_ref, block_start_ref, q_ref, k_pages_ref, v_pages_ref,
    block_table_ref, seq_lens_ref, query_start_loc_ref,  # inputs
    *refs,  # [window_ref] when windowed, [k_scales_ref, v_scales_ref] when quantized, [row_limit_ref,
    # kv_end_ref] with key limits (inputs), then out_ref (output)
    scale, logit_soft_cap, block_q, pages_per_block, page_size, windowed, quantized, limited=False,
):
    # block_seq_ref, block_start_ref: [1]; q_ref: [num_tokens + block_q, group_pad, d];
    # k/v_pages_ref: [num_pages, page_size, d]; block_table_ref: [num_seqs, padded_pages];
    # seq_lens_ref: [num_seqs]; query_start_loc_ref: [num_seqs + 1]; window_ref: [1] (from
    # window_size); k/v_scales_ref: [num_pages, page_size, 1]; row_limit_ref: [block_q * group_pad],
    # kv_end_ref: [1] (block_key_limits: the rows' highest keys, the end of the keys they read);
    # out_ref: [block_q, group_pad, d].
    inputs, out_ref = list(refs[:-1]), refs[-1]
    window_ref = inputs.pop(0) if windowed else None
    row_limit_ref, kv_end_ref = (inputs.pop(-2), inputs.pop(-1)) if limited else (None, None)
    k_scales_ref, v_scales_ref = inputs if quantized else (None, None)
    keys_per_block = pages_per_block * page_size
    seq = block_seq_ref[0]
    seq_index = jnp.maximum(seq, 0)
    block_start = block_start_ref[0]
    seq_len = jnp.where(seq >= 0, seq_lens_ref[seq_index], 0)
    query_end = query_start_loc_ref[seq_index + 1]
    first_pos = seq_len - query_end + block_start  # position of the block's first token
    kv_end = jnp.clip(first_pos + block_q, 0, seq_len)  # keys any row of this block may read
    num_blocks = (kv_end + keys_per_block - 1) // keys_per_block
    first_block, first_key = 0, 0
    if windowed:  # keys before the window of the block's first row are read by no row
        window = window_ref[0]
        first_key = first_visible_key(jnp.maximum(first_pos, 0), window)
        first_block = first_key // keys_per_block

    q = q_ref[pl.ds(block_start, block_q)]  # [block_q, group_pad, d]
    _, group_pad, head_dim = q.shape
    rows = block_q * group_pad
    q = q.reshape(rows, head_dim)
    row_pos = first_pos + jnp.arange(rows, dtype=jnp.int32) // group_pad  # [rows]
    if limited:  # each row's highest key and the keys' end, from the wrapper (block_key_limits)
        row_limit = row_limit_ref[...]
        kv_end = kv_end_ref[0]
        num_blocks = (kv_end + keys_per_block - 1) // keys_per_block

    def body(block, carry):
        page_ids = block_table_ref[seq_index, pl.ds(block * pages_per_block, pages_per_block)]
        k = load_pages(k_pages_ref, page_ids, keys_per_block, k_scales_ref, q.dtype)
        v = load_pages(v_pages_ref, page_ids, keys_per_block, v_scales_ref, q.dtype)
        key_pos = block * keys_per_block + jnp.arange(keys_per_block, dtype=jnp.int32)
        key_valid = key_pos < kv_end  # [keys]
        if limited:  # the window's rule on row_pos - key_pos, which a key after the row always passes
            if windowed:
                key_valid = key_valid & (key_pos >= first_key)
            valid = (key_pos[None, :] <= row_limit[:, None]) & key_valid[None, :]
            if windowed:
                valid = valid & (row_pos[:, None] - key_pos[None, :] < window)
        elif windowed:
            key_valid = key_valid & (key_pos >= first_key)
            valid = in_window(row_pos[:, None], key_pos[None, :], window) & key_valid[None, :]
        else:
            valid = (key_pos[None, :] <= row_pos[:, None]) & key_valid[None, :]  # [rows, keys]
        return online_softmax_step(q, k, v, valid, key_valid, carry, scale, logit_soft_cap)

    acc, _, row_sum = jax.lax.fori_loop(first_block, num_blocks, body, init_carry(rows, head_dim))
    out = jnp.where(row_sum[:, None] > 0, acc / jnp.where(row_sum > 0, row_sum, 1.0)[:, None], 0.0)
    out_ref[...] = out.reshape(block_q, group_pad, head_dim).astype(out_ref.dtype)


def query_block_schedule(query_start_loc, seq_lens, num_seqs, block_q, num_query_blocks):
    """Which sequence and first token each query block has; -1 marks a spare block.

    Returns block_seq, block_start: int32[num_query_blocks], and block_offset: int32[num_seqs],
    the index of each sequence's first block.
    """
    starts = query_start_loc[:num_seqs]
    query_lens = jnp.where(seq_lens > 0, query_start_loc[1 : num_seqs + 1] - starts, 0)
    blocks_per_seq = (query_lens + block_q - 1) // block_q
    blocks_end = jnp.cumsum(blocks_per_seq)
    block_offset = blocks_end - blocks_per_seq
    blocks = jnp.arange(num_query_blocks, dtype=jnp.int32)
    seq_of_block = jnp.minimum(jnp.searchsorted(blocks_end, blocks, side="right"), num_seqs - 1)
    in_use = blocks < blocks_end[-1]
    block_start = starts[seq_of_block] + (blocks - block_offset[seq_of_block]) * block_q
    block_seq = jnp.where(in_use, seq_of_block, -1).astype(jnp.int32)
    return block_seq, jnp.where(in_use, block_start, 0).astype(jnp.int32), block_offset


@functools.partial(
    jax.jit,
    static_argnames=("scale", "logit_soft_cap", "interpret", "block_q", "pages_per_block", "num_warps"),
)
def ragged_paged_attention(
    q, k_pages, v_pages, block_table, seq_lens, query_start_loc, *, key_limit=None,
    sliding_window=None, scale=None, logit_soft_cap=None,
    interpret=False, block_q=None, pages_per_block=None, num_warps=8,
):
    """Causal paged attention of a ragged batch of query tokens.

    q: [num_tokens, num_q_heads, head_dim]; the tokens of sequence i are
    q[query_start_loc[i]:query_start_loc[i+1]], the LAST tokens of a sequence of total length
    seq_lens[i] whose K/V are already in k_pages, v_pages ([num_pages, page_size, num_kv_heads,
    head_dim]) through block_table (int32[num_seqs, max_pages_per_seq]).
    query_start_loc (int32[num_seqs + 1]) is non-decreasing: padding rows repeat the last value.
    Tokens past query_start_loc[num_seqs] and sequences with seq_lens 0 give zeros.
    sliding_window: int32 scalar operand or None; scale, logit_soft_cap: static floats or None
    (see pallas_kernels.common). With a window, a query block starts at the first block of keys
    its first query sees.
    key_limit: int32[num_tokens] or None (causal): each query's highest visible key position
    (bidirectional image spans, pallas_kernels.reference.ragged_paged_attention); a query block
    then walks its keys up to its rows' largest limit.
    Returns [num_tokens, num_q_heads, head_dim] in q's dtype. `interpret=True` runs on CPU.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    (k_pages, k_scales), (v_pages, v_scales) = kv_quant.split(k_pages), kv_quant.split(v_pages)
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs = block_table.shape[0]
    group = num_q_heads // num_kv_heads
    if group * num_kv_heads != num_q_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    scale = softmax_scale(scale, head_dim)
    logit_soft_cap = None if logit_soft_cap is None else float(logit_soft_cap)
    group_pad = next_power_of_2(group)
    rows_per_block = default_keys_per_block(q.dtype)  # block_q * group_pad; same register budget as keys
    block_q = block_q or max(1, rows_per_block // group_pad, MIN_DOT_ROWS // group_pad)
    pages_per_block = pages_per_block or max(1, default_keys_per_block(k_pages.dtype) // page_size)
    num_query_blocks = cdiv(num_tokens, block_q) + num_seqs
    padded_pages = cdiv(block_table.shape[1], pages_per_block) * pages_per_block
    block_table = jnp.pad(block_table, ((0, 0), (0, padded_pages - block_table.shape[1])))
    query_start_loc = query_start_loc.astype(jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)
    block_seq, block_start, block_offset = query_block_schedule(
        query_start_loc, seq_lens, num_seqs, block_q, num_query_blocks
    )

    q_grouped = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q_grouped = jnp.pad(q_grouped, ((0, block_q), (0, 0), (0, group_pad - group), (0, 0)))
    squeezed = compat.squeezed_block_dim()
    page_spec = pl.BlockSpec((num_pages, page_size, squeezed, head_dim), lambda b, h: (0, 0, h, 0))
    q_spec = pl.BlockSpec((num_tokens + block_q, squeezed, group_pad, head_dim), lambda b, h: (0, h, 0, 0))
    compiler_params = None if interpret else compat.pallas_gpu_compiler_params(num_warps, num_stages=2)

    def whole(shape):
        return pl.BlockSpec(shape, lambda b, h: (0,) * len(shape))

    windowed, quantized, limited = sliding_window is not None, k_scales is not None, key_limit is not None
    extra_inputs, extra_specs = [], []
    if windowed:
        extra_inputs.append(window_size(sliding_window).reshape(1))
        extra_specs.append(whole((1,)))
    if quantized:
        extra_inputs += [k_scales, v_scales]
        extra_specs += [pl.BlockSpec((num_pages, page_size, squeezed, 1), lambda b, h: (0, 0, h, 0))] * 2
    if limited:  # each block's rows' limits and its keys' end (computed here: in the kernel the
        # end's reduction over the rows costs ~40 registers, spills at head_dim 256)
        extra_inputs += block_key_limits(key_limit, block_seq, block_start, seq_lens, query_start_loc, block_q,
                                         group_pad)
        extra_specs += [pl.BlockSpec((squeezed, block_q * group_pad), lambda b, h: (b, 0)),
                        pl.BlockSpec((1,), lambda b, h: (b,))]
    kernel = functools.partial(
        _ragged_kernel, scale=scale, logit_soft_cap=logit_soft_cap, block_q=block_q,
        pages_per_block=pages_per_block, page_size=page_size, windowed=windowed, quantized=quantized,
        **({"limited": True} if limited else {}),
    )
    with compat.quiet_pallas_deprecations():
        out_blocks = pl.pallas_call(
            kernel,
            grid=(num_query_blocks, num_kv_heads),
            in_specs=[
                pl.BlockSpec((1,), lambda b, h: (b,)),
                pl.BlockSpec((1,), lambda b, h: (b,)),
                q_spec,
                page_spec,
                page_spec,
                whole(block_table.shape),
                whole(seq_lens.shape),
                whole(query_start_loc.shape),
            ] + extra_specs,
            out_specs=pl.BlockSpec(
                (squeezed, block_q, squeezed, group_pad, head_dim), lambda b, h: (b, 0, h, 0, 0)
            ),
            out_shape=jax.ShapeDtypeStruct(
                (num_query_blocks, block_q, num_kv_heads, group_pad, head_dim), q.dtype
            ),
            compiler_params=compiler_params,
            interpret=interpret,
            name="ragged_paged_attention",
        )(block_seq, block_start, q_grouped, k_pages, v_pages, block_table.astype(jnp.int32),
          seq_lens, query_start_loc, *extra_inputs)

    return tokens_from_blocks(out_blocks, num_tokens, query_start_loc, seq_lens, block_offset, group)


def block_key_limits(key_limit, block_seq, block_start, seq_lens, query_start_loc, block_q, group_pad):
    """The key-limit operands of a query block schedule (query_block_schedule's blocks of block_q
    tokens, each token's rows the group's heads padded to group_pad): each block's rows' highest
    keys, int32 [num_query_blocks, block_q * group_pad] (row i * group_pad + j: token
    block_start + i; max(its position, its key_limit); rows past the sequence: their position),
    and where the keys its rows read end, int32 [num_query_blocks] (at most the sequence's length)."""
    num_tokens = key_limit.shape[0]
    seq = jnp.maximum(block_seq, 0)
    seq_len = jnp.where(block_seq >= 0, seq_lens[seq], 0)
    query_end = query_start_loc[seq + 1]
    tokens = block_start[:, None] + jnp.arange(block_q, dtype=jnp.int32)[None, :]  # [blocks, block_q]
    positions = (seq_len - query_end)[:, None] + tokens
    limits = jnp.pad(key_limit.astype(jnp.int32), (0, block_q))[jnp.minimum(tokens, num_tokens + block_q - 1)]
    limits = jnp.where(tokens < query_end[:, None], jnp.maximum(positions, limits), positions)
    kv_end = jnp.clip(jnp.max(limits, axis=1) + 1, 0, seq_len)
    return [jnp.repeat(limits, group_pad, axis=1), kv_end.astype(jnp.int32)]


def tokens_from_blocks(out_blocks, num_tokens, query_start_loc, seq_lens, block_offset, group):
    """Query blocks' outputs [num_query_blocks, block_q, kv, group_pad, d] (query_block_schedule's
    blocks) back to the token layout [num_tokens, kv * group, d]: token t of a sequence starting at
    `start` is row (t - start) % block_q of block block_offset + (t - start) // block_q. Tokens past
    the last sequence, and those of sequences with seq_lens 0, are zeros."""
    num_query_blocks, block_q, num_kv_heads, _, head_dim = out_blocks.shape
    num_seqs = seq_lens.shape[0]
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_of_token = jnp.minimum(
        jnp.searchsorted(query_start_loc[1 : num_seqs + 1], tokens, side="right"), num_seqs - 1
    )
    index_in_seq = tokens - query_start_loc[seq_of_token]
    block_of_token = block_offset[seq_of_token] + index_in_seq // block_q
    block_of_token = jnp.clip(block_of_token, 0, num_query_blocks - 1)
    out = out_blocks[block_of_token, index_in_seq % block_q]  # [num_tokens, kv, group_pad, d]
    token_valid = (tokens < query_start_loc[num_seqs]) & (seq_lens[seq_of_token] > 0)
    out = jnp.where(token_valid[:, None, None, None], out[:, :, :group], jnp.zeros((), out_blocks.dtype))
    return out.reshape(num_tokens, num_kv_heads * group, head_dim)
