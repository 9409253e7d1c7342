"""Mosaic GPU paged decode attention (Hopper: TMA page copies, wgmma): one query token per sequence.

Grid (num_kv_heads, num_splits, num_seqs), one warpgroup per program. A program owns one KV head
of one sequence and one contiguous slice of its context, cut at run time from the keys the query
sees (paged_decode.split_range: the table's width costs nothing): the query heads of that KV head
(the group, padded to the 64 rows of a wgmma) are copied into shared memory once, then the slice's
pages are walked as mosaic_common.attend_pages says (TMA page copies, two blocks of 64 keys in
flight, wgmma for Q K^T and P V). The splits' partial results are merged with their log-sum-exp weights in
the wrapper, as in the Triton kernel (paged_decode.merge_splits).

Hopper (sm_90a) only: TMA and wgmma. On Ampere the Triton kernels run (pallas_kernels.dispatch).
Operands: mosaic_common.unsupported. Options (sliding_window, scale,
logit_soft_cap): see pallas_kernels.common.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import kv_quant
from pallas_kernels.common import first_visible_key
from pallas_kernels.mosaic_common import (
    KEYS_PER_BLOCK, WGMMA_ROWS, attend_pages, block_scales, checked_options, extra_operands, extra_refs, launch,
    store_outputs,
)
from pallas_kernels.paged_decode import merge_splits, split_block_table, split_range


def _decode_kernel(q_ref, k_ref, v_ref, block_table_ref, seq_lens_ref, *refs,
                   scale, logit_soft_cap, page_size, num_splits, windowed, scaled, plgpu):
    # q_ref: [num_seqs, num_kv_heads, 64, d]; k_ref, v_ref: [num_pages, page_size, num_kv_heads, d];
    # block_table_ref: [num_seqs, table_pages] (whole blocks of keys); seq_lens_ref: [num_seqs];
    # window_ref: [1] (from window_size) when windowed; scales_ref: [num_seqs, num_kv_heads, 2, keys]
    # (mosaic_common.sequence_scales) for int8 pages; then the outputs out_ref [s, kv, splits, 64, d]
    # (each split's normalised partial, q's dtype), max_ref, sum_ref [s, kv, splits, 64] (float32),
    # then the scratch of mosaic_common.scratch.
    window_ref, scales_ref, refs = extra_refs(refs, windowed, scaled)
    out_ref, max_ref, sum_ref, q_smem, stat_smem, q_barrier, buffers = refs
    head, split, seq = lax.axis_index("head"), lax.axis_index("split"), lax.axis_index("seq")
    plgpu.copy_gmem_to_smem(q_ref.at[seq, head], q_smem, q_barrier)
    seq_len = seq_lens_ref[seq]
    # The query is the last token, at seq_len - 1: with a window, blocks before it are not walked.
    first_key = first_visible_key(seq_len - 1, window_ref[0]) if windowed else 0
    first_block, end_block = split_range(seq_len, split, num_splits, KEYS_PER_BLOCK, first_key)
    plgpu.barrier_wait(q_barrier)
    acc, row_max, row_sum = attend_pages(
        plgpu, q_smem, buffers, k_ref, v_ref,
        page_id=lambda block, p: block_table_ref[seq, block * (KEYS_PER_BLOCK // page_size) + p],
        scales_of_block=block_scales(scales_ref, seq, head),
        head=head, first_block=first_block, num_blocks=end_block, key_lo=first_key, key_hi=seq_len,
        visible=lambda key_pos: key_pos >= 0, scale=scale, logit_soft_cap=logit_soft_cap, page_size=page_size)
    store_outputs(plgpu, q_smem, stat_smem, acc, row_max, row_sum, out_ref.at[seq, head, split],
                  max_ref.at[seq, head, split], sum_ref.at[seq, head, split])


@functools.partial(jax.jit, static_argnames=("scale", "logit_soft_cap", "interpret", "num_splits"))
def paged_decode_attention(q, k_pages, v_pages, block_table, seq_lens, *, sliding_window=None, scale=None,
                           logit_soft_cap=None, interpret=False, num_splits=None):
    """Paged attention of one query token per sequence: the arguments and result of
    pallas_kernels.paged_decode.paged_decode_attention. `interpret=True` runs the kernel in
    Mosaic GPU's interpreter (on the CPU, with race detection). ValueError for operands it does
    not take (mosaic_common.unsupported)."""
    plgpu, scale, logit_soft_cap = checked_options(q, k_pages, scale, logit_soft_cap)
    k_cache, v_cache, k_pages, v_pages = k_pages, v_pages, kv_quant.values(k_pages), kv_quant.values(v_pages)
    num_seqs, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    block_table, num_splits = split_block_table(block_table, KEYS_PER_BLOCK // page_size, num_kv_heads, num_splits)
    q_grouped = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    q_grouped = jnp.pad(q_grouped, ((0, 0), (0, 0), (0, WGMMA_ROWS - group), (0, 0)))
    extra, windowed, scaled = extra_operands(sliding_window, k_cache, v_cache, block_table)
    partial_shape = (num_seqs, num_kv_heads, num_splits, WGMMA_ROWS)
    kernel = functools.partial(_decode_kernel, scale=scale, logit_soft_cap=logit_soft_cap, page_size=page_size,
                               num_splits=num_splits, windowed=windowed, scaled=scaled,
                               plgpu=plgpu)
    stats = jax.ShapeDtypeStruct(partial_shape, jnp.float32)
    partial, row_max, row_sum = launch(
        plgpu, kernel, [jax.ShapeDtypeStruct(partial_shape + (head_dim,), q.dtype), stats, stats],
        grid={"head": num_kv_heads, "split": num_splits, "seq": num_seqs}, name="paged_decode_attention_mosaic",
        interpret=interpret, q=q, k_cache=k_cache,
    )(q_grouped, k_pages, v_pages, block_table, seq_lens.astype(jnp.int32), *extra)
    row_max, row_sum = row_max[..., :group], row_sum[..., :group]
    acc = partial[..., :group, :].astype(jnp.float32) * row_sum[..., None]  # the splits' unnormalised sums
    out = merge_splits(acc, row_max, row_sum)
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)
