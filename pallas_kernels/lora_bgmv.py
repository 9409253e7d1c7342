"""Pallas multi-LoRA update (BGMV: a batched gather matrix-vector product, as in Punica and
S-LoRA) for the GPU, through Pallas' Triton lowering.

    y[t] = (x[t] @ a[slots[t]]) @ b[slots[t]]          x [T, K], a [S, K, R], b [S, R, N]

Each row carries the slot of its adapter; slot 0 is the zero adapter of base rows. One program
per (row, block of block_n output columns): it reads its row's slot, shrinks the row through
that slot's A (K in blocks of block_k, multiply-and-sum in float32: a matrix-vector product, no
tensor-core dot, so any row count works), then expands the R values through the slot's
R x block_n slice of B and stores them. A row of slot 0 stores zeros and reads no matrix.
Each program recomputes its row's shrink (K x R) for its column block: R is small (16-64) and
the slot's A stays in L2 across the programs of a row.

R must be a power of two and K and N multiples of 16 (`supports`); pallas_kernels.dispatch
falls back to the XLA path otherwise.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import compat
from pallas_kernels.pallas_common import MIN_DOT_ROWS, largest_dividing_block

MAX_BLOCK_K = 128
MAX_BLOCK_N = 256


def supports(x, a, b) -> bool:
    """Whether lora_update takes these operands: x [T, K], a [S, K, R], b [S, R, N] of float
    dtypes, R a power of two, K and N multiples of 16."""
    if x.ndim != 2 or a.ndim != 3 or b.ndim != 3 or a.shape[:1] != b.shape[:1]:
        return False
    if x.shape[1] != a.shape[1] or a.shape[2] != b.shape[1]:
        return False
    floats = (jnp.float32, jnp.bfloat16, jnp.float16)
    if any(jnp.dtype(t.dtype) not in floats for t in (x, a, b)):
        return False
    rank = a.shape[2]
    return rank & (rank - 1) == 0 and x.shape[1] % MIN_DOT_ROWS == 0 and b.shape[2] % MIN_DOT_ROWS == 0


def _lora_kernel(slot_ref, x_ref, a_ref, b_ref, out_ref, *, block_k, num_k_blocks):
    # slot_ref: [1] (this row's slot); x_ref: [K] (this row); a_ref: [S, K, R];
    # b_ref: [S, R, block_n]; out_ref: [block_n].
    slot = slot_ref[0]

    @pl.when(slot == 0)
    def _():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    @pl.when(slot != 0)
    def _():
        rank = a_ref.shape[2]

        def shrink(k_block, acc):  # acc: [R] float32
            k_start = pl.multiple_of(k_block * block_k, block_k)
            xk = x_ref[pl.ds(k_start, block_k)].astype(jnp.float32)  # [block_k]
            ak = a_ref[slot, pl.ds(k_start, block_k), :].astype(jnp.float32)  # [block_k, R]
            return acc + jnp.sum(xk[:, None] * ak, axis=0)

        shrunk = jax.lax.fori_loop(0, num_k_blocks, shrink, jnp.zeros((rank,), jnp.float32))  # [R]
        if b_ref.dtype != jnp.float32:  # the shrunk row in the adapter's dtype, as the XLA path rounds it
            shrunk = shrunk.astype(b_ref.dtype).astype(jnp.float32)
        bn = b_ref[slot, :, :].astype(jnp.float32)  # [R, block_n]
        out_ref[...] = jnp.sum(shrunk[:, None] * bn, axis=0).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "block_k", "block_n", "num_warps", "num_stages"))
def lora_update(x, a, b, slots, *, interpret=False, block_k=None, block_n=None, num_warps=4, num_stages=2):
    """x [T, K], a [S, K, R], b [S, R, N], slots int32[T] in [0, S) -> [T, N] in x's dtype:
    each row through its slot's A then B, accumulated in float32 (slot 0: zeros).
    Blocks default to the largest powers of two up to 128 (K) and 256 (N) that divide them;
    `interpret=True` runs on the CPU. ValueError when `supports` is false or a block does not divide."""
    if not supports(x, a, b):
        raise ValueError(f"lora_update takes x [T, K], a [S, K, R], b [S, R, N] of float dtypes, R a power of two, "
                         f"K and N multiples of {MIN_DOT_ROWS}; got {x.shape} {a.shape} {b.shape}")
    num_rows, k = x.shape
    num_slots, _, rank = a.shape
    n = b.shape[2]
    block_k = block_k or largest_dividing_block(k, MAX_BLOCK_K)
    block_n = block_n or largest_dividing_block(n, MAX_BLOCK_N)
    if k % block_k or n % block_n:
        raise ValueError(f"block_k={block_k} and block_n={block_n} must divide K={k} and N={n}")
    squeezed = compat.squeezed_block_dim()
    kernel = functools.partial(_lora_kernel, block_k=block_k, num_k_blocks=k // block_k)
    compiler_params = None if interpret else compat.pallas_gpu_compiler_params(num_warps, num_stages)
    with compat.quiet_pallas_deprecations():
        return pl.pallas_call(
            kernel,
            grid=(num_rows, n // block_n),
            in_specs=[
                pl.BlockSpec((1,), lambda row, col: (row,)),
                pl.BlockSpec((squeezed, k), lambda row, col: (row, 0)),
                pl.BlockSpec((num_slots, k, rank), lambda row, col: (0, 0, 0)),
                pl.BlockSpec((num_slots, rank, block_n), lambda row, col: (0, 0, col)),
            ],
            out_specs=pl.BlockSpec((squeezed, block_n), lambda row, col: (row, col)),
            out_shape=jax.ShapeDtypeStruct((num_rows, n), x.dtype),
            compiler_params=compiler_params,
            interpret=interpret,
            name="lora_bgmv",
        )(slots.astype(jnp.int32), x, a, b)
