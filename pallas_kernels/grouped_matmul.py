"""Pallas grouped matmul (the routed experts of a mixture-of-experts layer) for the GPU.

    out[rows of group g] = lhs[rows of group g] @ rhs[g]

lhs [M, K] has its rows sorted by group: group g owns the group_sizes[g] rows after those of
groups 0..g-1 (group_sizes: int32[G], a device array that sums to at most M; rows past the sum
come out zero). rhs [G, K, N]. This is `jax.lax.ragged_dot(lhs, rhs, group_sizes)`.

Work items. The rows are cut into tiles of `block_m`; a tile that a group boundary crosses holds
rows of several groups. A small jnp schedule (`work_items`, computed on device from group_sizes)
lists one work item per (tile, group) pair with at least one row of that group in that tile, in
group order. A group of n rows starting at row s gives one item per tile it touches, so the
items number at most num_tiles + G - 1 (each boundary between two non-empty groups adds at most
one tile that is counted twice); the grid (num_tiles + G - 1, N / block_n) is sized for that
worst case and spare items do nothing. Each program multiplies its tile's rows by the K x block_n
slice of its group's matrix, in float32 over K blocks, and stores only the rows of its group
(a masked store), so two programs sharing a tile write disjoint rows and nothing races.
Empty groups have no items: a decode step reads the weights of the experts it routes to and
no others. Rows no group owns are never stored; the wrapper zeroes them.

K and N must be multiples of 16 (the smallest tensor-core dot); `supports` says whether a call
fits, and pallas_kernels.dispatch falls back to XLA's ragged_dot when it does not.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import compat
from pallas_kernels.pallas_common import MIN_DOT_ROWS, cdiv, largest_dividing_block, next_power_of_2


def default_blocks(num_rows: int, k: int, n: int, dtype) -> tuple[int, int, int]:
    """(block_m, block_k, block_n): 64 x 64 x 128 tiles for 16-bit inputs (half of K and N for
    float32, which runs without tensor cores and holds twice the registers); fewer rows when the
    whole call has fewer (a decode step), never under the 16 rows of a tensor-core dot."""
    wide = jnp.dtype(dtype).itemsize <= 2
    block_m = min(64, max(MIN_DOT_ROWS, next_power_of_2(num_rows)))
    return block_m, largest_dividing_block(k, 64 if wide else 32), largest_dividing_block(n, 128 if wide else 64)


def supports(lhs, rhs) -> bool:
    """Whether grouped_matmul takes these operands: lhs [M, K] and rhs [G, K, N] of one float
    dtype with K and N multiples of 16."""
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1] or lhs.dtype != rhs.dtype:
        return False
    if lhs.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        return False
    return lhs.shape[1] % MIN_DOT_ROWS == 0 and rhs.shape[2] % MIN_DOT_ROWS == 0


def work_items(group_sizes, num_rows: int, block_m: int, num_items: int):
    """The (tile, group) schedule: for each of `num_items` work items, its group, its tile and the
    rows [row_start, row_end) of that group inside that tile; a spare item has row_end == row_start.

    group_sizes: int32[G], summing to at most num_rows (a larger sum is cut at num_rows).
    Returns item_group, item_tile, row_start, row_end: int32[num_items] each.
    """
    num_groups = group_sizes.shape[0]
    sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)  # [G]
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows)  # [G]
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])  # [G]
    nonempty = ends > starts
    first_tile = starts // block_m
    last_tile = (jnp.maximum(ends, 1) - 1) // block_m
    tiles_of_group = jnp.where(nonempty, last_tile - first_tile + 1, 0)  # [G]
    items_end = jnp.cumsum(tiles_of_group)  # [G]
    items = jnp.arange(num_items, dtype=jnp.int32)
    item_group = jnp.minimum(jnp.searchsorted(items_end, items, side="right"), num_groups - 1).astype(jnp.int32)
    in_use = items < items_end[-1]
    item_tile = first_tile[item_group] + items - (items_end[item_group] - tiles_of_group[item_group])
    item_tile = jnp.where(in_use, item_tile, 0).astype(jnp.int32)
    row_start = jnp.where(in_use, jnp.maximum(starts[item_group], item_tile * block_m), 0)
    row_end = jnp.where(in_use, jnp.minimum(ends[item_group], (item_tile + 1) * block_m), 0)
    return item_group, item_tile, row_start.astype(jnp.int32), row_end.astype(jnp.int32)


def _grouped_matmul_kernel(
    item_group_ref, item_tile_ref, row_start_ref, row_end_ref, lhs_ref, rhs_ref,  # inputs
    out_ref,  # output
    *, block_m, block_k, num_k_blocks, precision,
):
    # item_*_ref, row_*_ref: [1] (this program's work item); lhs_ref: [padded_rows, K];
    # rhs_ref: [G, K, block_n]; out_ref: [padded_rows, block_n].
    row_start, row_end = row_start_ref[0], row_end_ref[0]

    @pl.when(row_end > row_start)
    def _():
        group = item_group_ref[0]
        tile_start = pl.multiple_of(item_tile_ref[0] * block_m, block_m)

        def body(k_block, acc):
            k_start = pl.multiple_of(k_block * block_k, block_k)
            a = lhs_ref[pl.ds(tile_start, block_m), pl.ds(k_start, block_k)]  # [block_m, block_k]
            b = rhs_ref[group, pl.ds(k_start, block_k), :]  # [block_k, block_n]
            return acc + jax.lax.dot_general(
                a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)

        block_n = out_ref.shape[1]
        acc = jax.lax.fori_loop(0, num_k_blocks, body, jnp.zeros((block_m, block_n), jnp.float32))
        rows = tile_start + jnp.arange(block_m, dtype=jnp.int32)  # [block_m]
        mine = (rows >= row_start) & (rows < row_end)
        compat.masked_store(out_ref.at[pl.ds(tile_start, block_m), :], acc.astype(out_ref.dtype),
                            jnp.broadcast_to(mine[:, None], (block_m, block_n)))


@functools.partial(
    jax.jit,
    static_argnames=("preferred_element_type", "interpret", "block_m", "block_k", "block_n", "num_warps",
                     "num_stages", "items_last_first"),
)
def grouped_matmul(
    lhs, rhs, group_sizes, *, preferred_element_type=None,
    interpret=False, block_m=None, block_k=None, block_n=None, num_warps=4, num_stages=3, items_last_first=False,
):
    """lhs [M, K] (rows sorted by group), rhs [G, K, N], group_sizes int32[G] (sum <= M) ->
    [M, N] in `preferred_element_type` (default lhs's dtype), as jax.lax.ragged_dot; rows past
    sum(group_sizes) are zero. Block sizes default to `default_blocks`; `interpret=True` runs on CPU.
    items_last_first: the grid visits the work items in reverse order. The result must not change
    (the interpreter runs programs one after another, so a program storing rows of another item
    shows up in one order or the other: the tests run both).
    ValueError when `supports(lhs, rhs)` is false or a block does not divide K or N.
    """
    if not supports(lhs, rhs):
        raise ValueError(f"grouped_matmul takes lhs [M, K] and rhs [G, K, N] of one float dtype with K and N "
                         f"multiples of {MIN_DOT_ROWS}; got {lhs.shape} {lhs.dtype} and {rhs.shape} {rhs.dtype}")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"group_sizes must have shape ({rhs.shape[0]},), got {group_sizes.shape}")
    num_rows, k = lhs.shape
    num_groups, _, n = rhs.shape
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    default_m, default_k, default_n = default_blocks(num_rows, k, n, lhs.dtype)
    block_m, block_k, block_n = block_m or default_m, block_k or default_k, block_n or default_n
    if k % block_k or n % block_n:
        raise ValueError(f"block_k={block_k} and block_n={block_n} must divide K={k} and N={n}")
    num_tiles = cdiv(max(num_rows, 1), block_m)
    padded_rows = num_tiles * block_m
    num_items = num_tiles + num_groups - 1
    item_group, item_tile, row_start, row_end = work_items(group_sizes, num_rows, block_m, num_items)
    lhs_padded = jnp.pad(lhs, ((0, padded_rows - num_rows), (0, 0)))  # [padded_rows, K]
    precision = jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None
    kernel = functools.partial(_grouped_matmul_kernel, block_m=block_m, block_k=block_k,
                               num_k_blocks=k // block_k, precision=precision)
    compiler_params = None if interpret else compat.pallas_gpu_compiler_params(num_warps, num_stages)
    if items_last_first:
        item_spec = pl.BlockSpec((1,), lambda item, col: (num_items - 1 - item,))
    else:
        item_spec = pl.BlockSpec((1,), lambda item, col: (item,))
    with compat.quiet_pallas_deprecations():
        out = pl.pallas_call(
            kernel,
            grid=(num_items, n // block_n),
            in_specs=[
                item_spec, item_spec, item_spec, item_spec,
                pl.BlockSpec((padded_rows, k), lambda item, col: (0, 0)),
                pl.BlockSpec((num_groups, k, block_n), lambda item, col: (0, 0, col)),
            ],
            out_specs=pl.BlockSpec((padded_rows, block_n), lambda item, col: (0, col)),
            out_shape=jax.ShapeDtypeStruct((padded_rows, n), out_dtype),
            compiler_params=compiler_params,
            interpret=interpret,
            name="grouped_matmul",
        )(item_group, item_tile, row_start, row_end, lhs_padded, rhs)
    owned_rows = jnp.minimum(jnp.sum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), num_rows)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    return jnp.where((rows < owned_rows)[:, None], out[:num_rows], jnp.zeros((), out_dtype))
