"""The grouped matmul in plain XLA over the Pallas kernel's work items (pallas_kernels.grouped_matmul):
a loop over the (tile, group) items in use, each one dot of a tile of rows by its group's matrix.

    out[rows of group g] = lhs[rows of group g] @ rhs[g]          (jax.lax.ragged_dot)

Why: on the CPU, jax lowers ragged_dot to a dense dot of the rows masked once per group
([G, M, K] x [G, K, N]): every group's matrix is read and G times the FLOPs are done, whatever
the group sizes. Here an empty group costs nothing, so a decode step of a mixture-of-experts
model reads the weights of the experts it routes to and no others, and a tile of rows costs one
block_m x K x N dot per group it holds. The loop runs as many times as there are items in use
(a dynamic trip count: at most num_tiles + G - 1).
"""

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import work_items
from pallas_kernels.pallas_common import cdiv, next_power_of_2

MAX_BLOCK_ROWS = 64
MIN_BLOCK_ROWS = 4


def default_block_rows(num_rows: int, num_groups: int) -> int:
    """Rows per tile: about the rows of one group (num_rows / num_groups, as a power of two) within
    [4, 64], never more than the power of two covering num_rows. A tile costs a whole dot per group
    it holds, so tiles much taller than a group waste FLOPs; much shorter ones read a group's matrix
    again per tile (on the 2-core CPU, 16 experts, 1024 x 512: 4 rows best at 16 rows, 8 at 128,
    each 2-5x faster than 64; bench/RESULTS.md)."""
    per_group = next_power_of_2(cdiv(max(num_rows, 1), max(num_groups, 1)))
    return min(next_power_of_2(max(num_rows, 1)), max(MIN_BLOCK_ROWS, min(per_group, MAX_BLOCK_ROWS)))


def grouped_matmul(lhs, rhs, group_sizes, *, block_m=None, product=None):
    """lhs [M, K] (rows sorted by group), rhs [G, K, N], group_sizes int32[G] (sum <= M) -> [M, N]
    in the operands' promoted dtype, as jax.lax.ragged_dot; rows past sum(group_sizes) are zero.
    block_m (static): rows per tile, default `default_block_rows`.

    With `product(rows [block_m, K], rhs_g) -> [block_m, N]`, `rhs` is any pytree whose leaves
    all have the leading G axis (a quantized weight), and each item multiplies its tile by the
    tree indexed at its group (rhs_g) through `product`; the result is in lhs's dtype."""
    num_rows, k = lhs.shape
    num_groups = jax.tree.leaves(rhs)[0].shape[0]
    block_m = block_m or default_block_rows(num_rows, num_groups)
    if product is None:
        out_dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
        precision = jax.lax.Precision.HIGHEST if out_dtype == jnp.float32 else None
        product = lambda rows, matrix: jnp.dot(rows, matrix, precision=precision,  # noqa: E731
                                               preferred_element_type=jnp.float32)
    else:
        out_dtype = lhs.dtype
    group_struct = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), rhs)
    n = jax.eval_shape(product, jax.ShapeDtypeStruct((block_m, k), lhs.dtype), group_struct).shape[-1]
    num_tiles = cdiv(max(num_rows, 1), block_m)
    padded_rows = num_tiles * block_m
    item_group, item_tile, row_start, row_end = work_items(group_sizes, num_rows, block_m,
                                                           num_tiles + num_groups - 1)
    items_in_use = jnp.sum(row_end > row_start)  # the items in use come first
    lhs_padded = jnp.pad(lhs, ((0, padded_rows - num_rows), (0, 0)))  # [padded_rows, K]

    def item(i, out):  # out: [padded_rows, N]
        tile_start = item_tile[i] * block_m
        rows = jax.lax.dynamic_slice_in_dim(lhs_padded, tile_start, block_m)  # [block_m, K]
        matrix = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, item_group[i], keepdims=False), rhs)
        result = product(rows, matrix)  # [block_m, N]
        row_ids = tile_start + jnp.arange(block_m, dtype=jnp.int32)
        mine = ((row_ids >= row_start[i]) & (row_ids < row_end[i]))[:, None]  # [block_m, 1]
        current = jax.lax.dynamic_slice_in_dim(out, tile_start, block_m)  # [block_m, N]
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine, result.astype(out.dtype), current),
                                                   tile_start, 0)

    out = jax.lax.fori_loop(0, items_in_use, item, jnp.zeros((padded_rows, n), out_dtype))
    return out[:num_rows]
