"""Pallas paged decode attention: one query token per sequence against that sequence's pages.

Grid (num_seqs, num_kv_heads, num_splits). A program owns one KV head of one sequence and one
contiguous slice of its context: it loads every page of that slice once, for all the query
heads that share the KV head (the group, padded to the 16 rows a tensor-core dot needs), and
keeps an online softmax in float32. The slices are cut at run time from the sequence's own
length (split_range), so a program's work follows the context, not the width of the block table:
a table as wide as the longest context costs a short one nothing but its unused entries. Programs
past a sequence's length do no work; with a sliding window, a program starts at the first block
of keys the query sees (programs wholly before it do no work either). The partial results of the
splits are merged with their log-sum-exp weights in the wrapper. Options (sliding_window, scale,
logit_soft_cap): see pallas_kernels.common.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import compat, kv_quant
from pallas_kernels.common import first_visible_key, softmax_scale, window_size
from pallas_kernels.pallas_common import (
    MIN_DOT_ROWS, cdiv, default_keys_per_block, init_carry, load_pages, next_power_of_2,
    online_softmax_step,
)

TARGET_PROGRAMS = 512  # enough programs to fill an H100/H200 several times over
MIN_BLOCKS_PER_SPLIT = 2


def _decode_kernel(
    q_ref, k_pages_ref, v_pages_ref, block_table_ref, seq_lens_ref,  # inputs
    *refs,  # [window_ref] when windowed, [k_scales_ref, v_scales_ref] when quantized (inputs),
    # then acc, max, sum (outputs)
    scale, logit_soft_cap, pages_per_block, page_size, num_splits, windowed, quantized,
):
    # q_ref: [group_pad, d]; k/v_pages_ref: [num_pages, page_size, d] (one KV head);
    # block_table_ref: [table_pages] (the sequence's whole row); seq_lens_ref: [1];
    # window_ref: [1] (from window_size); k/v_scales_ref: [num_pages, page_size, 1].
    inputs, (acc_ref, max_ref, sum_ref) = list(refs[:-3]), refs[-3:]
    window_ref = inputs.pop(0) if windowed else None
    k_scales_ref, v_scales_ref = inputs if quantized else (None, None)
    keys_per_block = pages_per_block * page_size
    seq_len = seq_lens_ref[0]
    # The query is the last token, at seq_len - 1: with a window, blocks before it are not walked.
    first_key = first_visible_key(seq_len - 1, window_ref[0]) if windowed else 0
    first_block, end_block = split_range(seq_len, pl.program_id(2), num_splits, keys_per_block, first_key)
    q = q_ref[...]
    rows, head_dim = q.shape

    def body(block, carry):
        page_ids = block_table_ref[pl.ds(block * pages_per_block, pages_per_block)]
        k = load_pages(k_pages_ref, page_ids, keys_per_block, k_scales_ref, q.dtype)
        v = load_pages(v_pages_ref, page_ids, keys_per_block, v_scales_ref, q.dtype)
        key_pos = block * keys_per_block + jnp.arange(keys_per_block, dtype=jnp.int32)
        key_valid = key_pos < seq_len  # [keys]
        if windowed:
            key_valid = key_valid & (key_pos >= first_key)
        valid = jnp.broadcast_to(key_valid[None, :], (rows, keys_per_block))
        return online_softmax_step(q, k, v, valid, key_valid, carry, scale, logit_soft_cap)

    acc, row_max, row_sum = jax.lax.fori_loop(first_block, end_block, body, init_carry(rows, head_dim))
    acc_ref[...] = acc
    max_ref[...] = row_max
    sum_ref[...] = row_sum


def choose_num_splits(num_seqs: int, num_kv_heads: int, num_blocks: int) -> int:
    """Context splits per sequence so that the grid fills the GPU even at small batch."""
    wanted = cdiv(TARGET_PROGRAMS, max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, cdiv(num_blocks, MIN_BLOCKS_PER_SPLIT)))


def split_block_table(block_table, pages_per_block: int, num_kv_heads: int, num_splits: int | None):
    """The context split over programs: (the int32 block table [num_seqs, num_blocks * pages_per_block]
    padded with the null page to whole blocks, num_splits); num_splits None: choose_num_splits's,
    at most one per block of the table. The kernel cuts each sequence's slices (split_range)."""
    num_blocks = cdiv(block_table.shape[1], pages_per_block)
    num_splits = min(num_splits or choose_num_splits(block_table.shape[0], num_kv_heads, num_blocks), num_blocks)
    padding = num_blocks * pages_per_block - block_table.shape[1]
    return jnp.pad(block_table.astype(jnp.int32), ((0, 0), (0, padding))), num_splits


def split_range(seq_len, split, num_splits: int, keys_per_block: int, first_key=0):
    """Inside a kernel: the blocks of keys one split of a sequence of `seq_len` keys walks,
    (first_block, end_block) (int32 scalars; empty when first >= end). The blocks from the one
    holding `first_key` (the first key the query sees: 0, or a sliding window's start) to the
    sequence's last are shared out evenly over the splits, at least MIN_BLOCKS_PER_SPLIT a split,
    so a split's work follows the keys the query sees (not the width of the block table)."""
    seq_blocks = (seq_len + keys_per_block - 1) // keys_per_block
    start = jnp.minimum(first_key // keys_per_block, seq_blocks)
    blocks_per_split = jnp.maximum(MIN_BLOCKS_PER_SPLIT, (seq_blocks - start + num_splits - 1) // num_splits)
    first_block = jnp.minimum(start + split * blocks_per_split, seq_blocks)
    return first_block, jnp.minimum(first_block + blocks_per_split, seq_blocks)


def merge_splits(acc, row_max, row_sum):
    """Log-sum-exp merge over axis 2 (splits): [s, kv, splits, g, d] -> [s, kv, g, d] f32."""
    global_max = jnp.max(row_max, axis=2, keepdims=True)
    weight = jnp.exp(row_max - global_max)  # [s, kv, splits, g]
    numerator = jnp.sum(weight[..., None] * acc, axis=2)
    denominator = jnp.sum(weight * row_sum, axis=2)[..., None]
    safe = jnp.where(denominator > 0, denominator, 1.0)
    return jnp.where(denominator > 0, numerator / safe, 0.0)


@functools.partial(
    jax.jit,
    static_argnames=("scale", "logit_soft_cap", "interpret", "num_splits", "pages_per_block", "num_warps"),
)
def paged_decode_attention(
    q, k_pages, v_pages, block_table, seq_lens, *,
    sliding_window=None, scale=None, logit_soft_cap=None,
    interpret=False, num_splits=None, pages_per_block=None, num_warps=None,
):
    """Paged attention of one query token per sequence (its last token, K/V already written).

    q: [num_seqs, num_q_heads, head_dim]; k_pages, v_pages: [num_pages, page_size,
    num_kv_heads, head_dim] (or quantized caches, see kv_quant); block_table: int32[num_seqs, max_pages_per_seq];
    seq_lens: int32[num_seqs], 0 marks a padding row (zeros out).
    sliding_window: int32 scalar operand or None; scale, logit_soft_cap: static floats or None
    (see pallas_kernels.common). With a window, blocks before it are not read.
    Returns [num_seqs, num_q_heads, head_dim] in q's dtype. `interpret=True` runs on CPU.
    """
    num_seqs, num_q_heads, head_dim = q.shape
    (k_pages, k_scales), (v_pages, v_scales) = kv_quant.split(k_pages), kv_quant.split(v_pages)
    num_pages, page_size, num_kv_heads, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    if group * num_kv_heads != num_q_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    scale = softmax_scale(scale, head_dim)
    logit_soft_cap = None if logit_soft_cap is None else float(logit_soft_cap)
    group_pad = max(MIN_DOT_ROWS, next_power_of_2(group))
    pages_per_block = pages_per_block or max(1, default_keys_per_block(k_pages.dtype) // page_size)
    num_warps = num_warps or (4 if jnp.dtype(q.dtype).itemsize <= 2 else 8)
    block_table, num_splits = split_block_table(block_table, pages_per_block, num_kv_heads, num_splits)

    q_grouped = q.reshape(num_seqs, num_kv_heads, group, head_dim)
    q_grouped = jnp.pad(q_grouped, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))
    squeezed = compat.squeezed_block_dim()
    page_spec = pl.BlockSpec((num_pages, page_size, squeezed, head_dim), lambda s, h, p: (0, 0, h, 0))
    partial_shape = (num_seqs, num_kv_heads, num_splits, group_pad)
    windowed, quantized = sliding_window is not None, k_scales is not None
    extra_inputs, extra_specs = [], []
    if windowed:
        extra_inputs.append(window_size(sliding_window).reshape(1))
        extra_specs.append(pl.BlockSpec((1,), lambda s, h, p: (0,)))
    if quantized:
        extra_inputs += [k_scales, v_scales]
        extra_specs += [pl.BlockSpec((num_pages, page_size, squeezed, 1), lambda s, h, p: (0, 0, h, 0))] * 2
    kernel = functools.partial(
        _decode_kernel, scale=scale, logit_soft_cap=logit_soft_cap, pages_per_block=pages_per_block,
        page_size=page_size, num_splits=num_splits, windowed=windowed, quantized=quantized,
    )
    compiler_params = None if interpret else compat.pallas_gpu_compiler_params(num_warps, num_stages=2)
    with compat.quiet_pallas_deprecations():
        acc, row_max, row_sum = pl.pallas_call(
            kernel,
            grid=(num_seqs, num_kv_heads, num_splits),
            in_specs=[
                pl.BlockSpec((squeezed, squeezed, group_pad, head_dim), lambda s, h, p: (s, h, 0, 0)),
                page_spec,
                page_spec,
                pl.BlockSpec((squeezed, block_table.shape[1]), lambda s, h, p: (s, 0)),
                pl.BlockSpec((1,), lambda s, h, p: (s,)),
            ] + extra_specs,
            out_specs=[
                pl.BlockSpec((squeezed,) * 3 + (group_pad, head_dim), lambda s, h, p: (s, h, p, 0, 0)),
                pl.BlockSpec((squeezed,) * 3 + (group_pad,), lambda s, h, p: (s, h, p, 0)),
                pl.BlockSpec((squeezed,) * 3 + (group_pad,), lambda s, h, p: (s, h, p, 0)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct(partial_shape + (head_dim,), jnp.float32),
                jax.ShapeDtypeStruct(partial_shape, jnp.float32),
                jax.ShapeDtypeStruct(partial_shape, jnp.float32),
            ],
            compiler_params=compiler_params,
            interpret=interpret,
            name="paged_decode_attention",
        )(q_grouped, k_pages, v_pages, block_table, seq_lens.astype(jnp.int32),
          *extra_inputs)
    out = merge_splits(acc[:, :, :, :group], row_max[:, :, :, :group], row_sum[:, :, :, :group])
    return out.reshape(num_seqs, num_q_heads, head_dim).astype(q.dtype)
