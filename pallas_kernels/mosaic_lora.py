"""Mosaic GPU multi-LoRA update (Hopper, sm_90a: TMA copies, wgmma), beside the Triton-lowering
kernel of lora_bgmv.py:

    y[t] = (x[t] @ a[slots[t]]) @ b[slots[t]]          x [T, K], a [S, K, R], b [S, R, N]

Slot 0 is the zero adapter of base rows: their outputs are zeros and its matrices are never read.

Grid ("col": N / block_n, "row": T / 64), one warpgroup per program. A program owns 64 rows (the
M of a wgmma; the wrapper pads T with rows of slot 0) and block_n output columns. The wrapper
lists, per block of 64 rows, the slots its rows use other than 0 (`block_slots`, `block_counts`:
a one-hot over the S slots, cheap beside the kernel); the program walks only those. Per slot s:
  shrink  [64, R] = x[rows] @ a[s], K in blocks of block_k (wgmma, float32 accumulator), the x and
          A blocks copied by TMA two at a time (block k + 1 in flight while block k multiplies);
  mask    the rows whose slot is not s are zeroed, the rest rounded to the adapters' dtype (as
          the XLA path and the Triton kernel round the shrunk row) into shared memory;
  expand  out [64, block_n] += shrunk @ b[s][:, cols] (wgmma; B's block copied by TMA while the
          shrink runs).
So a block of rows costs one dense [64, K] x [K, R] and [64, R] x [R, block_n] per distinct slot in
it (the SGMV form without sorting: rows of one sequence share a slot, so prefill blocks mostly hold
one slot; a decode batch of 64 rows holds each adapter once), on tensor cores, every operand read
by TMA. Each column block recomputes its rows' shrink (K x R per slot: R is small and x and A stay
in L2 across the column blocks), as lora_bgmv.py does.

With a stacked slab (a [L, S, K, R], b [L, S, R, N] and an int32 `layer`), the kernel reads that
layer's matrices in place (a flat [L * S, ...] view, matrix layer * S + slot): no slice is copied.

Every buffer a wgmma reads (x, A, the shrunk rows, B) is tiled and swizzled alike, in tiles of
min(R, 64) columns (32, 64 or 128 bytes): Mosaic GPU's wgmma wants its two operands under one
swizzle, and A's rows are R values wide. (Mosaic GPU's interpreter does not check this; the compile
for sm_90a does: tests/test_mosaic_kernels.py.)

Limits (`supports`; pallas_kernels.dispatch falls back to the Triton kernel, then to XLA):
x, a and b of one 16-bit dtype (bfloat16 or float16: wgmma's operands), R a power of two from
16 to 128 (the K of the expand's wgmma is a multiple of 16; R = 8 would need a 16-byte swizzle),
K and N multiples of min(R, 64) (whole tiles). Any T: the wrapper pads x and the slots to whole
blocks of 64 rows (a copy of x when T is not a multiple of 64). Compiled for sm_90a: 82 registers
at rank 16, about 150 at ranks 64-128, no spills; shared memory 33 KiB at rank 16 and 113 KiB at
rank 128 (block_n 128). The Mosaic GPU API used is jax 0.11's (pallas_kernels.compat.mosaic_gpu);
`interpret=True` runs the same body in Mosaic GPU's interpreter on the CPU, with race detection.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat
from pallas_kernels.pallas_common import cdiv, largest_dividing_block

BLOCK_ROWS = 64  # M of one warpgroup matmul: the rows of a program
MAX_BLOCK_K = 64  # 128 bytes of a 16-bit row: one swizzled tile across
MAX_BLOCK_N = 128
MIN_RANK, MAX_RANK = 16, 128
NUM_BUFFERS = 2  # x and A blocks in shared memory at once (one multiplied, one in flight)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def supports(x, a, b) -> bool:
    """Whether lora_update takes these operands (arrays or ShapeDtypeStructs): x [T, K],
    a [S, K, R], b [S, R, N], all three bfloat16 or all three float16, R a power of two from 16
    to 128, K and N multiples of min(R, 64) (the swizzled tile's columns: `swizzle_columns`)."""
    if x.ndim != 2 or a.ndim != 3 or b.ndim != 3 or a.shape[:1] != b.shape[:1]:
        return False
    if x.shape[1] != a.shape[1] or a.shape[2] != b.shape[1]:
        return False
    if jnp.dtype(x.dtype) not in DTYPES or not jnp.dtype(x.dtype) == jnp.dtype(a.dtype) == jnp.dtype(b.dtype):
        return False
    rank = a.shape[2]
    if rank & (rank - 1) or not MIN_RANK <= rank <= MAX_RANK:
        return False
    return x.shape[1] % swizzle_columns(rank) == 0 and b.shape[2] % swizzle_columns(rank) == 0


def swizzle_columns(rank: int) -> int:
    """The columns of one swizzled tile of every buffer wgmma reads: a wgmma's two operands must
    share one swizzle, and A's [block_k, R] rows are R values wide (32, 64 or 128 bytes)."""
    return min(rank, MAX_BLOCK_K)


def _swizzled(plgpu, dtype, columns: int) -> dict:
    """Tiling and swizzle of a 16-bit buffer in tiles of 8 rows of `columns` values."""
    row_bytes = columns * jnp.dtype(dtype).itemsize
    return dict(transforms=(plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(row_bytes)))


def block_slot_lists(slots, num_slots: int):
    """Per block of BLOCK_ROWS rows (slots int32 [blocks * 64]): (block_slots int32 [blocks, S],
    the slots other than 0 that its rows use, ascending, then the rest; block_counts int32
    [blocks], how many it uses). A slot outside [0, S) matches no list: its rows stay zero."""
    ids = jnp.arange(num_slots, dtype=jnp.int32)
    present = (slots.reshape(-1, BLOCK_ROWS)[:, :, None] == ids).any(axis=1) & (ids > 0)  # [blocks, S]
    block_slots = jnp.argsort(jnp.where(present, 0, 1), axis=1, stable=True).astype(jnp.int32)
    return block_slots, present.sum(axis=1).astype(jnp.int32)


def _lora_kernel(block_slots_ref, block_counts_ref, base_ref, slots_ref, x_ref, a_ref, b_ref, out_ref,
                 x_smem, a_smem, b_smem, shrunk_smem, out_smem, slots_smem,
                 x_barriers, a_barriers, b_barrier, slots_barrier, *, block_k, num_k_blocks, plgpu):
    # block_slots_ref [blocks, S], block_counts_ref [blocks] (block_slot_lists); base_ref [1]: the
    # first matrix of the layer (layer * S); slots_ref [T]; x_ref [T, K]; a_ref [L * S, K, R];
    # b_ref [L * S, R, N]; out_ref [T, N]. Scratch: x_smem [2, 64, block_k], a_smem [2, block_k, R],
    # b_smem [R, block_n], shrunk_smem [64, R], out_smem [64, block_n], slots_smem [64] (int32),
    # one barrier per x and A buffer, one for B's block, one for the rows' slots.
    layout = plgpu.Layout.WGMMA
    col, row = lax.axis_index("col"), lax.axis_index("row")
    block_n = out_smem.shape[1]
    rank = shrunk_smem.shape[1]
    rows, cols = pl.ds(row * BLOCK_ROWS, BLOCK_ROWS), pl.ds(col * block_n, block_n)
    plgpu.copy_gmem_to_smem(slots_ref.at[rows], slots_smem, slots_barrier)
    base = base_ref[0]
    plgpu.barrier_wait(slots_barrier)
    row_slots = plgpu.load(slots_smem, layout=layout.reduce(1))  # [64]: each row's slot

    def per_slot(i, out):  # out [64, block_n] float32: the slots before i, summed
        slot = block_slots_ref[row, i]
        matrix = base + slot
        plgpu.copy_gmem_to_smem(b_ref.at[matrix, :, cols], b_smem, b_barrier)  # lands while the shrink runs

        def issue(k_block, buffer):
            k_cols = pl.ds(k_block * block_k, block_k)
            plgpu.copy_gmem_to_smem(x_ref.at[rows, k_cols], x_smem.at[buffer], x_barriers.at[buffer])
            plgpu.copy_gmem_to_smem(a_ref.at[matrix, k_cols, :], a_smem.at[buffer], a_barriers.at[buffer])

        def shrink(acc_ref):
            issue(0, 0)

            def step(k_block, carry):
                buffer = lax.rem(k_block, NUM_BUFFERS)
                plgpu.barrier_wait(x_barriers.at[buffer])
                plgpu.barrier_wait(a_barriers.at[buffer])
                plgpu.wgmma(acc_ref, x_smem.at[buffer], a_smem.at[buffer])
                plgpu.wgmma_wait(1)  # the previous block's wgmma is done: its buffers are free again

                @pl.when(k_block + 1 < num_k_blocks)
                def _():
                    issue(k_block + 1, lax.rem(k_block + 1, NUM_BUFFERS))

                return carry

            lax.fori_loop(0, num_k_blocks, step, None)
            return acc_ref[...]  # waits for the last wgmma

        shrunk = pl.run_scoped(shrink, plgpu.ACC((BLOCK_ROWS, rank), jnp.float32))
        mine = lax.broadcast_in_dim(row_slots == slot, shrunk.shape, [0])
        shrunk_smem[...] = jnp.where(mine, shrunk, 0.0).astype(shrunk_smem.dtype)
        plgpu.commit_smem()
        plgpu.barrier_wait(b_barrier)

        def expand(acc_ref):
            plgpu.wgmma(acc_ref, shrunk_smem, b_smem)
            return acc_ref[...]

        return out + pl.run_scoped(expand, plgpu.ACC((BLOCK_ROWS, block_n), jnp.float32))

    zeros = plgpu.layout_cast(jnp.full((BLOCK_ROWS, block_n), 0.0, jnp.float32), layout)
    out = lax.fori_loop(0, block_counts_ref[row], per_slot, zeros)
    out_smem[...] = out.astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_ref.at[rows, cols])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=("interpret", "block_k", "block_n"))
def lora_update(x, a, b, slots, layer=None, *, interpret=False, block_k=None, block_n=None):
    """x [T, K], a [S, K, R], b [S, R, N], slots int32[T] in [0, S) -> [T, N] in x's dtype: each
    row through its slot's A then B, float32 accumulation, the shrunk row rounded to the adapters'
    dtype (slot 0: zeros). With `layer` (an int32 scalar, clamped to [0, L)), a and b are stacked
    slabs [L, S, K, R], [L, S, R, N] and that layer's matrices are read in place.
    Blocks default to the largest powers of two up to 64 (K) and 128 (N) that divide them;
    `interpret=True` runs the kernel in Mosaic GPU's interpreter (on the CPU, with race detection).
    ValueError when `supports` is false for the layer's operands or a block does not divide."""
    plgpu = compat.mosaic_gpu()
    if layer is None:
        a, b, layer = a[None], b[None], 0
    layer_a, layer_b = (jax.ShapeDtypeStruct(t.shape[1:], t.dtype) for t in (a, b))
    if a.ndim != 4 or b.ndim != 4 or a.shape[0] != b.shape[0] or not supports(x, layer_a, layer_b):
        raise ValueError(f"the Mosaic LoRA kernel takes x [T, K], a [S, K, R], b [S, R, N] of one 16-bit dtype, "
                         f"R a power of two in [{MIN_RANK}, {MAX_RANK}], K and N multiples of min(R, {MAX_BLOCK_K}); "
                         f"got {x.shape} {x.dtype}, {a.shape} {a.dtype}, {b.shape} {b.dtype}")
    num_rows, k = x.shape
    num_layers, num_slots, _, rank = a.shape
    n = b.shape[3]
    tile = swizzle_columns(rank)
    block_k = block_k or largest_dividing_block(k, MAX_BLOCK_K)
    block_n = block_n or largest_dividing_block(n, MAX_BLOCK_N)
    if k % block_k or n % block_n or block_k % tile or block_n % tile:
        raise ValueError(f"block_k={block_k} and block_n={block_n} must divide K={k} and N={n} and be "
                         f"multiples of {tile}")
    padded_rows = cdiv(num_rows, BLOCK_ROWS) * BLOCK_ROWS
    slots = jnp.pad(slots.astype(jnp.int32), (0, padded_rows - num_rows))  # padding rows: slot 0
    x = jnp.pad(x, ((0, padded_rows - num_rows), (0, 0)))
    block_slots, block_counts = block_slot_lists(slots, num_slots)
    base = (jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1) * num_slots).reshape(1)
    dtype = x.dtype
    scratch = (  # in the order of _lora_kernel's scratch arguments
        plgpu.SMEM((NUM_BUFFERS, BLOCK_ROWS, block_k), dtype, **_swizzled(plgpu, dtype, tile)),  # x
        plgpu.SMEM((NUM_BUFFERS, block_k, rank), dtype, **_swizzled(plgpu, dtype, tile)),  # A
        plgpu.SMEM((rank, block_n), dtype, **_swizzled(plgpu, dtype, tile)),  # B
        plgpu.SMEM((BLOCK_ROWS, rank), dtype, **_swizzled(plgpu, dtype, tile)),  # shrunk
        plgpu.SMEM((BLOCK_ROWS, block_n), dtype, **_swizzled(plgpu, dtype, tile)),  # out
        plgpu.SMEM((BLOCK_ROWS,), jnp.int32),  # the rows' slots
        plgpu.Barrier(num_barriers=NUM_BUFFERS), plgpu.Barrier(num_barriers=NUM_BUFFERS),  # x, A
        plgpu.Barrier(), plgpu.Barrier(),  # B, the rows' slots
    )
    kernel = functools.partial(_lora_kernel, block_k=block_k, num_k_blocks=k // block_k, plgpu=plgpu)
    out = plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((padded_rows, n), dtype), scratch_types=scratch,
        grid=(n // block_n, padded_rows // BLOCK_ROWS), grid_names=("col", "row"), kernel_name="lora_bgmv_mosaic",
        interpret=compat.mosaic_interpret_params() if interpret else None,
    )(block_slots, block_counts, base, slots, x, a.reshape(num_layers * num_slots, k, rank),
      b.reshape(num_layers * num_slots, rank, n))
    return out[:num_rows]
