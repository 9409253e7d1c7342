"""What the two Mosaic GPU kernels (mosaic_decode, mosaic_ragged) share: tile sizes, which
operands they take, their shared-memory scratch and the pipelined walk over a sequence's pages.

The walk (`attend_pages`), for one block of 64 query rows already in shared memory and one KV
head: blocks of KEYS_PER_BLOCK keys, each gathered page by page from the block table by the bulk
copy engine (TMA: one copy per page, each with its own barrier), NUM_SLOTS blocks in flight (the
copies of block i + 1 are issued before block i is computed, into the slot block i - 1 used and
has finished with). Per block: S = Q K^T (wgmma, float32 accumulator), the mask and the online
softmax in registers, P written to shared memory, O += P V (wgmma). Keys outside [key_lo, key_hi)
have their V rows zeroed in shared memory before P V: a slot no sequence owns may hold anything,
even NaN, and a zero weight times NaN is NaN. Everything here runs inside a kernel body, traced by
`plgpu.kernel` (Hopper, sm_90a); the same body runs in Mosaic GPU's interpreter on the CPU.
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat
from pallas_kernels.common import softmax_scale
from pallas_kernels.pallas_common import MASK_VALUE

WGMMA_ROWS = 64  # M of one warpgroup matmul: the query rows of a program
KEYS_PER_BLOCK = 64  # N of Q K^T and K of P V: keys per inner step
NUM_SLOTS = 2  # blocks of K/V in shared memory at once (one computed, one in flight)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # wgmma's 16-bit operand types


def unsupported(q, k_pages) -> str | None:
    """Why the Mosaic kernels cannot take these operands (None: they can): they read 16-bit float
    pages of the query's dtype, head_dim a multiple of 64 (the 128-byte swizzle of a bfloat16 row),
    page sizes that divide a block of keys, at most 64 query heads per KV head."""
    if isinstance(k_pages, dict):
        return "int8 pages (kv_cache_dtype int8)"
    if jnp.dtype(k_pages.dtype) == jnp.dtype(jnp.uint8):
        return "fp8 pages (kv_cache_dtype fp8)"
    if jnp.dtype(q.dtype) not in DTYPES or q.dtype != k_pages.dtype:
        return f"q {q.dtype} with pages {k_pages.dtype} (float16 or bfloat16, the same for both)"
    if q.shape[-1] % 64:
        return f"head_dim {q.shape[-1]} (a multiple of 64)"
    page_size = k_pages.shape[1]
    if KEYS_PER_BLOCK % page_size or page_size % 8:
        return f"page_size {page_size} (a multiple of 8 that divides {KEYS_PER_BLOCK})"
    if q.shape[-2] // k_pages.shape[2] > WGMMA_ROWS:
        return f"{q.shape[-2] // k_pages.shape[2]} query heads per KV head (at most {WGMMA_ROWS})"
    return None


def checked_options(q, k_pages, scale, logit_soft_cap):
    """What both wrappers start with: jax's Mosaic GPU module, a ValueError for operands the kernels
    do not take (`unsupported`), and the static softmax scale and soft-cap (pallas_kernels.common)."""
    plgpu = compat.mosaic_gpu()
    reason = unsupported(q, k_pages)
    if reason:
        raise ValueError(f"the Mosaic GPU attention kernels do not take {reason}")
    return plgpu, softmax_scale(scale, q.shape[-1]), None if logit_soft_cap is None else float(logit_soft_cap)


def scratch(plgpu, head_dim: int, dtype, page_size: int):
    """The shared memory and barriers of one program: q [64, d] (the output after the walk), K and
    V slots [NUM_SLOTS, 64, d], P [64, 64] (16-bit, tiled and swizzled for wgmma), the float32
    row stats [2, 64], the query's barrier and one barrier per page slot for K and for V. At
    head_dim 256 that is 168 KiB of the 227 KiB a Hopper block may have."""
    tiled = dict(transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128)))
    slots = NUM_SLOTS * (KEYS_PER_BLOCK // page_size)
    return (
        plgpu.SMEM((WGMMA_ROWS, head_dim), dtype, **tiled),
        plgpu.SMEM((NUM_SLOTS, KEYS_PER_BLOCK, head_dim), dtype, **tiled),
        plgpu.SMEM((NUM_SLOTS, KEYS_PER_BLOCK, head_dim), dtype, **tiled),
        plgpu.SMEM((WGMMA_ROWS, KEYS_PER_BLOCK), dtype, **tiled),
        plgpu.SMEM((2, WGMMA_ROWS), jnp.float32),
        plgpu.Barrier(),
        plgpu.Barrier(num_barriers=slots),
        plgpu.Barrier(num_barriers=slots),
    )


def launch(plgpu, body, out_type, *, grid: dict[str, int], name: str, interpret: bool, head_dim: int, dtype,
           page_size: int):
    """`plgpu.kernel` of a Mosaic attention kernel: one warpgroup per program over `grid` (axis name ->
    size), its inputs and outputs followed by `scratch`'s buffers, Mosaic GPU's interpreter (with race
    detection) when `interpret`."""
    return plgpu.kernel(body, out_type=out_type, scratch_types=scratch(plgpu, head_dim, dtype, page_size),
                        grid=tuple(grid.values()), grid_names=tuple(grid), kernel_name=name,
                        interpret=compat.mosaic_interpret_params() if interpret else None,
                        compiler_params=plgpu.CompilerParams(approx_math=True))


def attend_pages(plgpu, smem, k_ref, v_ref, *, page_id, head, first_block, num_blocks, key_lo, key_hi,
                 visible, scale, logit_soft_cap, page_size):
    """Online softmax attention of the 64 query rows in smem's q over key blocks
    [first_block, num_blocks) of one KV head. Returns (acc [64, d], row_max [64], row_sum [64]),
    float32 in wgmma's register layout (the caller divides, or merges splits).

    smem: the buffers of `scratch` after q is copied in (q_smem, k_smem, v_smem, p_smem,
    k_barriers, v_barriers); k_ref, v_ref: [num_pages, page_size, num_kv_heads, d] in GMEM;
    page_id(block, p): the page holding keys [block * 64 + p * page_size, ...) (a scalar read of
    the block table); keys outside [key_lo, key_hi) have their V rows zeroed; visible(key_pos):
    the [64, 64] mask of query rows x keys at positions key_pos (int32 [64, 64], wgmma layout).
    """
    q_smem, k_smem, v_smem, p_smem, k_barriers, v_barriers = smem
    layout = plgpu.Layout.WGMMA
    dtype = q_smem.dtype
    head_dim = q_smem.shape[-1]
    pages_per_block = KEYS_PER_BLOCK // page_size

    def issue_copies(block, slot):
        for p in range(pages_per_block):
            rows = pl.ds(p * page_size, page_size)
            page = page_id(block, p)
            plgpu.copy_gmem_to_smem(k_ref.at[page, :, head, :], k_smem.at[slot, rows],
                                    k_barriers.at[slot * pages_per_block + p])
            plgpu.copy_gmem_to_smem(v_ref.at[page, :, head, :], v_smem.at[slot, rows],
                                    v_barriers.at[slot * pages_per_block + p])

    def wait_copies(barriers, slot):
        for p in range(pages_per_block):
            plgpu.barrier_wait(barriers.at[slot * pages_per_block + p])

    @pl.when(first_block < num_blocks)
    def _():
        issue_copies(first_block, 0)

    def body(block, carry):
        acc, row_max, row_sum = carry
        step = block - first_block
        slot = lax.rem(step, NUM_SLOTS)

        @pl.when(block + 1 < num_blocks)
        def _():
            issue_copies(block + 1, lax.rem(step + 1, NUM_SLOTS))

        block_key = block * KEYS_PER_BLOCK
        key_pos = block_key + plgpu.broadcasted_iota(jnp.int32, (WGMMA_ROWS, KEYS_PER_BLOCK), 1, layout=layout)
        valid = visible(key_pos) & (key_pos >= key_lo) & (key_pos < key_hi)
        wait_copies(k_barriers, slot)

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].T)
            return acc_ref[...]

        scores = pl.run_scoped(qk, plgpu.ACC((WGMMA_ROWS, KEYS_PER_BLOCK), jnp.float32)) * scale
        if logit_soft_cap is not None:
            scores = logit_soft_cap * jnp.tanh(scores / logit_soft_cap)
        scores = jnp.where(valid, scores, MASK_VALUE)
        new_max = jnp.maximum(row_max, scores.max(axis=1))
        correction = jnp.exp(row_max - new_max)
        weights = jnp.where(valid, jnp.exp(scores - lax.broadcast_in_dim(new_max, scores.shape, [0])), 0.0)
        row_sum = row_sum * correction + weights.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])
        p_smem[...] = weights.astype(dtype)  # wgmma's A operand comes from shared memory
        wait_copies(v_barriers, slot)

        @pl.when((block_key < key_lo) | (block_key + KEYS_PER_BLOCK > key_hi))
        def _():  # a boundary block: zero the V rows of the keys no row reads (they may be NaN)
            v = plgpu.load(v_smem.at[slot], layout=layout)
            v_pos = block_key + plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=layout)
            v_smem.at[slot][...] = jnp.where((v_pos >= key_lo) & (v_pos < key_hi), v, 0).astype(dtype)

        plgpu.commit_smem()

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
            return acc_ref[...]

        acc = acc + pl.run_scoped(pv, plgpu.ACC((WGMMA_ROWS, head_dim), jnp.float32))
        return acc, new_max, row_sum

    init = (plgpu.layout_cast(jnp.full((WGMMA_ROWS, head_dim), 0.0, jnp.float32), layout),
            plgpu.layout_cast(jnp.full((WGMMA_ROWS,), MASK_VALUE, jnp.float32), layout.reduce(1)),
            plgpu.layout_cast(jnp.full((WGMMA_ROWS,), 0.0, jnp.float32), layout.reduce(1)))
    return lax.fori_loop(first_block, num_blocks, body, init)


def store_outputs(plgpu, q_smem, stat_smem, acc, row_max, row_sum, out_dst, max_dst=None, sum_dst=None):
    """Writes a program's results to GMEM through shared memory: acc / row_sum (0 where no key was
    seen) in the query's dtype into out_dst, through q_smem (the walk is done with the query), and
    the row stats into max_dst and sum_dst when given (the decode kernel's splits are merged after)."""
    seen = lax.broadcast_in_dim(row_sum > 0, acc.shape, [0])
    safe_sum = lax.broadcast_in_dim(jnp.where(row_sum > 0, row_sum, 1.0), acc.shape, [0])
    q_smem[...] = jnp.where(seen, acc / safe_sum, 0.0).astype(q_smem.dtype)
    if max_dst is not None:
        stat_smem.at[0][...] = row_max
        stat_smem.at[1][...] = row_sum
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, out_dst)
    if max_dst is not None:
        plgpu.copy_smem_to_gmem(stat_smem.at[0], max_dst)
        plgpu.copy_smem_to_gmem(stat_smem.at[1], sum_dst)
    plgpu.wait_smem_to_gmem(0)
