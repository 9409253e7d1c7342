"""Mosaic GPU ragged paged attention (Hopper: TMA page copies, wgmma): prefill chunks and decode
tokens of several sequences in one call.

The query tokens are cut, per sequence, into blocks of block_q = 64 / group_pad tokens (the
schedule of the Triton kernel, ragged_prefill.query_block_schedule), so that a block's tokens
times the query heads of one KV head (the group, padded to a power of two) are the 64 rows of a
wgmma. Grid (num_kv_heads, num_query_blocks), one warpgroup per program: it copies its 64 query
rows into shared memory (one TMA copy of the rows the wrapper gathered for it), walks its
sequence's pages up to the causal limit of its last row, from the first block its first row's
sliding window reaches (mosaic_common.attend_pages), and writes its
own output block, so no two programs write the same memory. Spare programs (the grid is sized for
the worst case) do no work. With key limits (bidirectional image spans) the wrapper gives each
program its 64 rows' highest keys and the end of the keys its rows read, and the walk runs to it.

Hopper (sm_90a) only; operands: mosaic_common.unsupported. Options (sliding_window, scale,
logit_soft_cap): see pallas_kernels.common.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import kv_quant
from pallas_kernels.common import first_visible_key, in_window
from pallas_kernels.mosaic_common import (
    KEYS_PER_BLOCK, WGMMA_ROWS, attend_pages, block_scales, checked_options, extra_operands, extra_refs, launch,
    store_outputs,
)
from pallas_kernels.pallas_common import cdiv, next_power_of_2
from pallas_kernels.ragged_prefill import block_key_limits, query_block_schedule, tokens_from_blocks


def _ragged_kernel(block_seq_ref, block_start_ref, q_ref, k_ref, v_ref, block_table_ref, seq_lens_ref,
                   query_start_loc_ref, *refs, scale, logit_soft_cap, group_pad, page_size, windowed, scaled, plgpu,
                   limited=False):
    # block_seq_ref, block_start_ref: [num_query_blocks]; q_ref: [num_query_blocks, num_kv_heads, 64, d];
    # k_ref, v_ref: [num_pages, page_size, num_kv_heads, d]; block_table_ref: [num_seqs, max_pages];
    # seq_lens_ref: [num_seqs]; query_start_loc_ref: [num_seqs + 1]; window_ref: [1] (from window_size)
    # when windowed; scales_ref: [num_seqs, num_kv_heads, 2, keys] (mosaic_common.sequence_scales) for
    # int8 pages; with key limits row_limit_ref [num_query_blocks, 64] (each row's highest key) and
    # kv_end_ref [num_query_blocks] (the end of the keys the block's rows read); then the output
    # out_ref [num_query_blocks, num_kv_heads, 64, d] (q's dtype), then the scratch of
    # mosaic_common.scratch.
    window_ref, scales_ref, refs = extra_refs(refs, windowed, scaled)
    row_limit_ref, kv_end_ref = (refs.pop(0), refs.pop(0)) if limited else (None, None)
    out_ref, q_smem, stat_smem, q_barrier, buffers = refs
    head, block_index = lax.axis_index("head"), lax.axis_index("block")
    block_q = WGMMA_ROWS // group_pad
    seq = block_seq_ref[block_index]
    seq_index = jnp.maximum(seq, 0)
    block_start = block_start_ref[block_index]
    plgpu.copy_gmem_to_smem(q_ref.at[block_index, head], q_smem, q_barrier)
    seq_len = jnp.where(seq >= 0, seq_lens_ref[seq_index], 0)
    first_pos = seq_len - query_start_loc_ref[seq_index + 1] + block_start  # the block's first token
    kv_end = jnp.clip(first_pos + block_q, 0, seq_len)  # keys any row of this block may read
    if limited:
        kv_end = kv_end_ref[block_index]
    num_blocks = (kv_end + KEYS_PER_BLOCK - 1) // KEYS_PER_BLOCK
    row_pos = first_pos + plgpu.broadcasted_iota(jnp.int32, (WGMMA_ROWS, KEYS_PER_BLOCK), 0,
                                                 layout=plgpu.Layout.WGMMA) // group_pad
    first_key = jnp.int32(0)
    if limited:  # each row's highest key; the window's rule on row_pos - key_pos (a later key passes it)
        # 64 int32 read straight from GMEM into the row layout (no optimized GMEM transfer exists; it
        # is 256 bytes a program, once)
        limits = plgpu.load(row_limit_ref.at[block_index], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
        row_limit = lax.broadcast_in_dim(limits, (WGMMA_ROWS, KEYS_PER_BLOCK), [0])
    if windowed:  # keys before the window of the block's first row are read by no row
        window = window_ref[0]
        first_key = first_visible_key(jnp.maximum(first_pos, 0), window)
        if limited:
            visible = lambda key_pos: (key_pos <= row_limit) & (row_pos - key_pos < window)  # noqa: E731
        else:
            visible = lambda key_pos: in_window(row_pos, key_pos, window)  # noqa: E731
    elif limited:
        visible = lambda key_pos: key_pos <= row_limit  # noqa: E731
    else:
        visible = lambda key_pos: key_pos <= row_pos  # noqa: E731
    plgpu.barrier_wait(q_barrier)
    acc, row_max, row_sum = attend_pages(
        plgpu, q_smem, buffers, k_ref, v_ref,
        page_id=lambda block, p: block_table_ref[seq_index, block * (KEYS_PER_BLOCK // page_size) + p],
        scales_of_block=block_scales(scales_ref, seq_index, head),
        head=head, first_block=jnp.minimum(first_key // KEYS_PER_BLOCK, num_blocks), num_blocks=num_blocks,
        key_lo=first_key, key_hi=kv_end, visible=visible, scale=scale, logit_soft_cap=logit_soft_cap,
        page_size=page_size)
    store_outputs(plgpu, q_smem, stat_smem, acc, row_max, row_sum, out_ref.at[block_index, head])


@functools.partial(jax.jit, static_argnames=("scale", "logit_soft_cap", "interpret"))
def ragged_paged_attention(q, k_pages, v_pages, block_table, seq_lens, query_start_loc, *, key_limit=None,
                           sliding_window=None, scale=None, logit_soft_cap=None, interpret=False):
    """Causal paged attention of a ragged batch of query tokens: the arguments and result of
    pallas_kernels.ragged_prefill.ragged_paged_attention (key_limit included). `interpret=True` runs the kernel in
    Mosaic GPU's interpreter (on the CPU, with race detection). ValueError for operands it does
    not take (mosaic_common.unsupported)."""
    plgpu, scale, logit_soft_cap = checked_options(q, k_pages, scale, logit_soft_cap)
    k_cache, v_cache, k_pages, v_pages = k_pages, v_pages, kv_quant.values(k_pages), kv_quant.values(v_pages)
    num_tokens, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    num_seqs = block_table.shape[0]
    group = num_q_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    block_q = WGMMA_ROWS // group_pad
    num_query_blocks = cdiv(num_tokens, block_q) + num_seqs
    pages_per_block = KEYS_PER_BLOCK // page_size
    padded_pages = cdiv(block_table.shape[1], pages_per_block) * pages_per_block
    block_table = jnp.pad(block_table.astype(jnp.int32), ((0, 0), (0, padded_pages - block_table.shape[1])))
    query_start_loc = query_start_loc.astype(jnp.int32)
    seq_lens = seq_lens.astype(jnp.int32)
    block_seq, block_start, block_offset = query_block_schedule(
        query_start_loc, seq_lens, num_seqs, block_q, num_query_blocks)
    # Each program's 64 query rows, gathered here so that its one TMA copy starts on a tile (a copy into
    # tiled shared memory cannot start mid-tile): block b, KV head h, row i * group_pad + j is token
    # block_start[b] + i, query head h * group + j (zeros past the group and past the tokens).
    q_grouped = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    q_grouped = jnp.pad(q_grouped, ((0, block_q), (0, 0), (0, group_pad - group), (0, 0)))
    tokens_of_block = block_start[:, None] + jnp.arange(block_q, dtype=jnp.int32)[None, :]  # [blocks, block_q]
    q_blocks = q_grouped[tokens_of_block].transpose(0, 2, 1, 3, 4)  # [blocks, kv, block_q, group_pad, d]
    q_blocks = q_blocks.reshape(num_query_blocks, num_kv_heads, WGMMA_ROWS, head_dim)
    extra, windowed, scaled = extra_operands(sliding_window, k_cache, v_cache, block_table)
    limited = key_limit is not None
    if limited:
        extra += block_key_limits(key_limit, block_seq, block_start, seq_lens, query_start_loc, block_q, group_pad)
    kernel = functools.partial(_ragged_kernel, scale=scale, logit_soft_cap=logit_soft_cap, group_pad=group_pad,
                               page_size=page_size, windowed=windowed, scaled=scaled, plgpu=plgpu,
                               **({"limited": True} if limited else {}))
    out_blocks = launch(
        plgpu, kernel, jax.ShapeDtypeStruct((num_query_blocks, num_kv_heads, WGMMA_ROWS, head_dim), q.dtype),
        grid={"head": num_kv_heads, "block": num_query_blocks}, name="ragged_paged_attention_mosaic",
        interpret=interpret, q=q, k_cache=k_cache,
    )(block_seq, block_start, q_blocks, k_pages, v_pages, block_table, seq_lens, query_start_loc, *extra)

    # [blocks, kv, block_q * group_pad, d] -> the Triton kernel's [blocks, block_q, kv, group_pad, d]
    out_blocks = out_blocks.reshape(num_query_blocks, num_kv_heads, block_q, group_pad, head_dim)
    out_blocks = out_blocks.transpose(0, 2, 1, 3, 4)
    return tokens_from_blocks(out_blocks, num_tokens, query_start_loc, seq_lens, block_offset, group)

