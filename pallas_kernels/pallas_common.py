"""What the two Pallas kernels (paged_decode, ragged_prefill) share: tile sizes, the page gather
and one step of the online softmax. Everything here runs inside a kernel body (or picks its
static sizes), so it sticks to what the Triton lowering of Pallas supports.
"""

import jax
import jax.numpy as jnp

from pallas_kernels import kv_quant
from pallas_kernels.common import soft_cap

MASK_VALUE = -1e30  # score of a masked key: finite, so exp(MASK_VALUE - max) underflows to 0
MIN_DOT_ROWS = 16  # smallest M of a tensor-core dot in the Triton lowering


def default_keys_per_block(dtype) -> int:
    """Keys (pages_per_block * page_size) per inner step. float32 dots run without tensor cores
    and hold far more registers, so they get half the tile (ptxas for sm_90: 16-bit tiles do not
    spill; float32 with head_dim 128 spills a few hundred bytes, acceptable off the hot path)."""
    return 64 if jnp.dtype(dtype).itemsize <= 2 else 32


def next_power_of_2(value: int) -> int:
    return 1 if value <= 1 else 1 << (value - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def largest_dividing_block(size: int, limit: int) -> int:
    """The largest power of two <= limit that divides `size`, or MIN_DOT_ROWS (a tile size of
    the kernels' dots; `size` a multiple of MIN_DOT_ROWS where they take it)."""
    block = limit
    while block > MIN_DOT_ROWS and size % block:
        block //= 2
    return block


def online_softmax_step(q, k, v, valid, key_valid, carry, scale, logit_soft_cap=None):
    """One block of keys of an online softmax.

    q: [rows, d]; k, v: [keys, d]; valid: [rows, keys]; key_valid: [keys], the keys some row may
    read (V elsewhere may be garbage, even NaN, and is zeroed); scale, logit_soft_cap: static.
    carry: (acc [rows, d] f32, row_max [rows] f32, row_sum [rows] f32).
    """
    acc, row_max, row_sum = carry
    precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    scores = jax.lax.dot_general(
        q, k, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )  # [rows, keys]
    scores = jnp.where(valid, soft_cap(scores * scale, logit_soft_cap), MASK_VALUE)
    new_max = jnp.maximum(row_max, jnp.max(scores, axis=1))
    correction = jnp.exp(row_max - new_max)
    weights = jnp.where(valid, jnp.exp(scores - new_max[:, None]), 0.0)
    v = jnp.where(key_valid[:, None], v, jnp.zeros_like(v))
    update = jax.lax.dot_general(
        weights.astype(v.dtype), v, (((1,), (0,)), ((), ())),
        precision=precision, preferred_element_type=jnp.float32,
    )  # [rows, d]
    acc = acc * correction[:, None] + update
    row_sum = row_sum * correction + jnp.sum(weights, axis=1)
    return acc, new_max, row_sum


def load_pages(pages_ref, page_ids, keys_per_block, scales_ref=None, dtype=None):
    """Gathers pages of one KV head: [pages_per_block] ids -> [keys_per_block, head_dim] in
    `dtype` (needed with scales_ref): int8 pages times their per-token scales, fp8 bits as floats
    (see kv_quant)."""
    block = pages_ref[page_ids]  # [pages_per_block, page_size, head_dim]
    if dtype is not None:  # scales: [pages_per_block, page_size, 1]
        block = kv_quant.dequantize(block, None if scales_ref is None else scales_ref[page_ids], dtype)
    return block.reshape(keys_per_block, block.shape[-1])


def init_carry(rows: int, head_dim: int):
    """Empty online-softmax state: (acc [rows, d], row_max [rows], row_sum [rows]), float32."""
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
