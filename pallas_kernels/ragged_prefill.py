"""Pallas ragged paged attention: prefill chunks and decode tokens of several sequences at once.

The query tokens of a batch are cut, per sequence, into blocks of `block_q` tokens; a small jnp
schedule maps each program of the grid (query block, kv head) to its sequence and first token
(the grid is sized for the worst case and spare programs do nothing). A program takes its query
block times the query heads of one KV head as the rows of its dots ([block_q * group_pad, d]),
walks that sequence's pages up to the causal limit of its last row with an online softmax, and
writes its own output block, so no two programs write the same memory.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxserve import compat
from pallas_kernels import kv_quant
from pallas_kernels.paged_decode import (
    MASK_VALUE, MIN_DOT_ROWS, cdiv, default_keys_per_block, load_pages, next_power_of_2,
    online_softmax_step,
)


def _ragged_kernel(
    block_seq_ref, block_start_ref, q_ref, k_pages_ref, v_pages_ref,
    block_table_ref, seq_lens_ref, query_start_loc_ref,  # inputs
    *refs,  # [k_scales_ref, v_scales_ref] when quantized (inputs), then out_ref (output)
    scale, block_q, pages_per_block, page_size, quantized=False,
):
    # block_seq_ref, block_start_ref: [1]; q_ref: [num_tokens + block_q, group_pad, d];
    # k/v_pages_ref: [num_pages, page_size, d]; block_table_ref: [num_seqs, padded_pages];
    # seq_lens_ref: [num_seqs]; query_start_loc_ref: [num_seqs + 1]; out_ref: [block_q, group_pad, d];
    # k/v_scales_ref: [num_pages, page_size, 1].
    k_scales_ref, v_scales_ref = refs[:2] if quantized else (None, None)
    out_ref = refs[-1]
    keys_per_block = pages_per_block * page_size
    seq = block_seq_ref[0]
    seq_index = jnp.maximum(seq, 0)
    block_start = block_start_ref[0]
    seq_len = jnp.where(seq >= 0, seq_lens_ref[seq_index], 0)
    query_end = query_start_loc_ref[seq_index + 1]
    first_pos = seq_len - query_end + block_start  # position of the block's first token
    kv_end = jnp.clip(first_pos + block_q, 0, seq_len)  # keys any row of this block may read
    num_blocks = (kv_end + keys_per_block - 1) // keys_per_block

    q = q_ref[pl.ds(block_start, block_q)]  # [block_q, group_pad, d]
    _, group_pad, head_dim = q.shape
    rows = block_q * group_pad
    q = q.reshape(rows, head_dim)
    row_pos = first_pos + jnp.arange(rows, dtype=jnp.int32) // group_pad  # [rows]

    def body(block, carry):
        page_ids = block_table_ref[seq_index, pl.ds(block * pages_per_block, pages_per_block)]
        k = load_pages(k_pages_ref, page_ids, keys_per_block, k_scales_ref, q.dtype)
        v = load_pages(v_pages_ref, page_ids, keys_per_block, v_scales_ref, q.dtype)
        key_pos = block * keys_per_block + jnp.arange(keys_per_block, dtype=jnp.int32)
        key_valid = key_pos < kv_end  # [keys]
        valid = (key_pos[None, :] <= row_pos[:, None]) & key_valid[None, :]  # [rows, keys]
        return online_softmax_step(q, k, v, valid, key_valid, carry, scale)

    init = (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    acc, _, row_sum = jax.lax.fori_loop(0, num_blocks, body, init)
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
    jax.jit, static_argnames=("scale", "interpret", "block_q", "pages_per_block", "num_warps")
)
def ragged_paged_attention(
    q, k_pages, v_pages, block_table, seq_lens, query_start_loc, *,
    scale=None, interpret=False, block_q=None, pages_per_block=None, num_warps=8,
):
    """Causal paged attention of a ragged batch of query tokens.

    q: [num_tokens, num_q_heads, head_dim]; the tokens of sequence i are
    q[query_start_loc[i]:query_start_loc[i+1]], the LAST tokens of a sequence of total length
    seq_lens[i] whose K/V are already in k_pages, v_pages ([num_pages, page_size, num_kv_heads,
    head_dim]) through block_table (int32[num_seqs, max_pages_per_seq]).
    query_start_loc (int32[num_seqs + 1]) is non-decreasing: padding rows repeat the last value.
    Tokens past query_start_loc[num_seqs] and sequences with seq_lens 0 give zeros.
    Returns [num_tokens, num_q_heads, head_dim] in q's dtype. `interpret=True` runs on CPU.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    (k_pages, k_scales), (v_pages, v_scales) = kv_quant.split(k_pages), kv_quant.split(v_pages)
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs = block_table.shape[0]
    group = num_q_heads // num_kv_heads
    if group * num_kv_heads != num_q_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    scale = head_dim**-0.5 if scale is None else float(scale)
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

    quantized = k_scales is not None
    scale_specs = [pl.BlockSpec((num_pages, page_size, squeezed, 1), lambda b, h: (0, 0, h, 0))] * 2
    kernel = functools.partial(
        _ragged_kernel, scale=scale, block_q=block_q,
        pages_per_block=pages_per_block, page_size=page_size, quantized=quantized,
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
            ] + (scale_specs if quantized else []),
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
          seq_lens, query_start_loc, *([k_scales, v_scales] if quantized else []))

    # Back to the token layout: token t of a sequence starting at `start` is row
    # (t - start) % block_q of block block_offset + (t - start) // block_q.
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_of_token = jnp.minimum(
        jnp.searchsorted(query_start_loc[1 : num_seqs + 1], tokens, side="right"), num_seqs - 1
    )
    index_in_seq = tokens - query_start_loc[seq_of_token]
    block_of_token = block_offset[seq_of_token] + index_in_seq // block_q
    block_of_token = jnp.clip(block_of_token, 0, num_query_blocks - 1)
    out = out_blocks[block_of_token, index_in_seq % block_q]  # [num_tokens, kv, group_pad, d]
    token_valid = (tokens < query_start_loc[num_seqs]) & (seq_lens[seq_of_token] > 0)
    out = jnp.where(token_valid[:, None, None, None], out[:, :, :group], jnp.zeros((), q.dtype))
    return out.reshape(num_tokens, num_q_heads, head_dim)
