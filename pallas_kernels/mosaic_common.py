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

Quantized pages (kv_quant: int8 with per-token scales, fp8 e4m3fn) are copied by TMA as they are
stored, one byte a value, into their own slots; each block is widened to the query's dtype in
registers (exact: every int8 and e4m3fn value is a bfloat16 and a float16) into the 16-bit buffer
wgmma reads. The int8 scales are applied in float32 where they are exact and cheap: K's to the
columns of S (S[:, t] = (Q K_int8^T)[:, t] * k_scale[t]), V's to the columns of P before P V.
The wrapper gathers each sequence's scales into one contiguous row of keys per KV head
(`sequence_scales`), so that one TMA copy brings a block's 64 K and 64 V scales.
"""

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import compat, kv_quant
from pallas_kernels.common import softmax_scale, window_size
from pallas_kernels.pallas_common import MASK_VALUE

WGMMA_ROWS = 64  # M of one warpgroup matmul: the query rows of a program
KEYS_PER_BLOCK = 64  # N of Q K^T and K of P V: keys per inner step
NUM_SLOTS = 2  # blocks of K/V in shared memory at once (one computed, one in flight)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))  # wgmma's 16-bit operand types


def unsupported(q, k_pages) -> str | None:
    """Why the Mosaic kernels cannot take these operands (None: they can): a float16 or bfloat16
    query over pages of its own dtype, int8 pages (kv_quant's scaled dict) or fp8 pages, head_dim a
    multiple of 64 (the 128-byte swizzle of a 16-bit row), page sizes that divide a block of keys,
    at most 64 query heads per KV head."""
    if jnp.dtype(q.dtype) not in DTYPES:
        return f"q {q.dtype} (float16 or bfloat16)"
    pages = kv_quant.values(k_pages)
    if not quantized(k_pages) and q.dtype != pages.dtype:
        return f"q {q.dtype} with pages {pages.dtype} (pages of the query's dtype, int8 or fp8)"
    if q.shape[-1] % 64:
        return f"head_dim {q.shape[-1]} (a multiple of 64)"
    page_size = pages.shape[1]
    if KEYS_PER_BLOCK % page_size or page_size % 8:
        return f"page_size {page_size} (a multiple of 8 that divides {KEYS_PER_BLOCK})"
    if q.shape[-2] // pages.shape[2] > WGMMA_ROWS:
        return f"{q.shape[-2] // pages.shape[2]} query heads per KV head (at most {WGMMA_ROWS})"
    return None


def quantized(cache) -> bool:
    """Whether a cache's pages are stored in a byte a value (int8 or fp8), widened in the kernel."""
    return kv_quant.is_scaled(cache) or kv_quant.values(cache).dtype == kv_quant.FP8_BITS


def sequence_scales(k_cache, v_cache, block_table):
    """The int8 scales of each sequence's keys, K's then V's, in the order the kernel walks them:
    float32 [num_seqs, num_kv_heads, 2, num_table_pages * page_size] (key j of a sequence at column
    j), or None for caches without scales. block_table: int32 [num_seqs, num_table_pages].
    The gather costs 16 bytes per key and KV head of the table (the 8 bytes of K and V scales read
    and written once more) beside the 2 * head_dim + 8 the kernel reads: 6 % more traffic at
    head_dim 128 when the table is as wide as the longest context (the engine buckets its width)."""
    if not kv_quant.is_scaled(k_cache):
        return None
    scales = jnp.stack([k_cache["scales"][..., 0], v_cache["scales"][..., 0]], axis=-1)  # [pages, ps, kv, 2]
    gathered = jnp.take(scales, block_table, axis=0, mode="clip")  # [s, table_pages, ps, kv, 2]
    num_seqs, table_pages, page_size, num_kv_heads, _ = gathered.shape
    return gathered.transpose(0, 3, 4, 1, 2).reshape(num_seqs, num_kv_heads, 2, table_pages * page_size)


def extra_operands(sliding_window, k_cache, v_cache, block_table):
    """The operands both kernels take after their fixed ones, in this order: the window [1]
    (window_size) when sliding_window is given, sequence_scales' array for int8 pages. Returns
    (operands, windowed, scaled); the kernel body takes them back with `extra_refs`."""
    windowed = sliding_window is not None
    scales = sequence_scales(k_cache, v_cache, block_table)
    operands = ([window_size(sliding_window).reshape(1)] if windowed else []) + ([] if scales is None else [scales])
    return operands, windowed, scales is not None


def extra_refs(refs, windowed: bool, scaled: bool):
    """A kernel body's refs after its fixed inputs, split as `extra_operands` put them:
    (window_ref or None, scales_ref or None, the outputs and scratch that follow)."""
    refs = list(refs)
    window_ref = refs.pop(0) if windowed else None
    scales_ref = refs.pop(0) if scaled else None
    return window_ref, scales_ref, refs


def block_scales(scales_ref, seq, head):
    """attend_pages' scales_of_block for one sequence and KV head of sequence_scales' array in GMEM
    (None without one): block -> the [2, 64] K and V scales of its keys."""
    if scales_ref is None:
        return None
    return lambda block: scales_ref.at[seq, head, :, pl.ds(block * KEYS_PER_BLOCK, KEYS_PER_BLOCK)]


def checked_options(q, k_pages, scale, logit_soft_cap):
    """What both wrappers start with: jax's Mosaic GPU module, a ValueError for operands the kernels
    do not take (`unsupported`), and the static softmax scale and soft-cap (pallas_kernels.common)."""
    plgpu = compat.mosaic_gpu()
    reason = unsupported(q, k_pages)
    if reason:
        raise ValueError(f"the Mosaic GPU attention kernels do not take {reason}")
    return plgpu, softmax_scale(scale, q.shape[-1]), None if logit_soft_cap is None else float(logit_soft_cap)


def _tiled(plgpu, dtype, columns: int):
    """Tiling and swizzle of a [rows, columns] buffer of `dtype` (columns a multiple of 64): tiles
    of 8 rows of 128 bytes, or of the whole row when it is shorter (64 one-byte values)."""
    row_bytes = min(128, columns * jnp.dtype(dtype).itemsize)
    return dict(transforms=(plgpu.TilingTransform((8, row_bytes // jnp.dtype(dtype).itemsize)),
                            plgpu.SwizzleTransform(row_bytes)))


def scratch(plgpu, head_dim: int, dtype, page_size: int, stored_dtype=None, scaled: bool = False):
    """The shared memory and barriers of one program: (q [64, d] (the output after the walk), the
    float32 row stats [2, 64], the query's barrier, page_buffers) with page_buffers the dict
    `attend_pages` reads: K and V [NUM_SLOTS, 64, d] (16-bit, tiled and swizzled for wgmma), P
    [64, 64], one barrier per page slot for K and for V. With pages stored in a byte a value
    (stored_dtype int8 or uint8) TMA fills k_stored and v_stored [NUM_SLOTS, 64, d] instead and K
    and V hold the one block being widened; `scaled` adds the int8 scales [NUM_SLOTS, 2, 64]
    (float32) and a barrier per slot. At head_dim 256 that is 168 KiB (16-bit or int8 pages) of the
    227 KiB a Hopper block may have."""
    slots = NUM_SLOTS * (KEYS_PER_BLOCK // page_size)
    blocks = 1 if stored_dtype is not None else NUM_SLOTS
    buffers = dict(
        k=plgpu.SMEM((blocks, KEYS_PER_BLOCK, head_dim), dtype, **_tiled(plgpu, dtype, head_dim)),
        v=plgpu.SMEM((blocks, KEYS_PER_BLOCK, head_dim), dtype, **_tiled(plgpu, dtype, head_dim)),
        p=plgpu.SMEM((WGMMA_ROWS, KEYS_PER_BLOCK), dtype, **_tiled(plgpu, dtype, KEYS_PER_BLOCK)),
        k_barriers=plgpu.Barrier(num_barriers=slots),
        v_barriers=plgpu.Barrier(num_barriers=slots),
    )
    if stored_dtype is not None:
        for name in ("k_stored", "v_stored"):
            buffers[name] = plgpu.SMEM((NUM_SLOTS, KEYS_PER_BLOCK, head_dim), stored_dtype,
                                       **_tiled(plgpu, stored_dtype, head_dim))
    if scaled:
        buffers["scales"] = plgpu.SMEM((NUM_SLOTS, 2, KEYS_PER_BLOCK), jnp.float32)
        buffers["scale_barriers"] = plgpu.Barrier(num_barriers=NUM_SLOTS)
    return (plgpu.SMEM((WGMMA_ROWS, head_dim), dtype, **_tiled(plgpu, dtype, head_dim)),
            plgpu.SMEM((2, WGMMA_ROWS), jnp.float32), plgpu.Barrier(), buffers)


def launch(plgpu, body, out_type, *, grid: dict[str, int], name: str, interpret: bool, q, k_cache):
    """`plgpu.kernel` of a Mosaic attention kernel over q's dtype and k_cache's pages: one warpgroup
    per program over `grid` (axis name -> size), its inputs and outputs followed by `scratch`'s
    buffers, Mosaic GPU's interpreter (with race detection) when `interpret`."""
    pages = kv_quant.values(k_cache)
    buffers = scratch(plgpu, q.shape[-1], q.dtype, pages.shape[1],
                      stored_dtype=pages.dtype if quantized(k_cache) else None, scaled=kv_quant.is_scaled(k_cache))
    return plgpu.kernel(body, out_type=out_type, scratch_types=buffers, grid=tuple(grid.values()),
                        grid_names=tuple(grid), kernel_name=name,
                        interpret=compat.mosaic_interpret_params() if interpret else None,
                        compiler_params=plgpu.CompilerParams(approx_math=True))


def attend_pages(plgpu, q_smem, buffers, k_ref, v_ref, *, page_id, scales_of_block, head, first_block, num_blocks,
                 key_lo, key_hi, visible, scale, logit_soft_cap, page_size):
    """Online softmax attention of the 64 query rows in q_smem over key blocks
    [first_block, num_blocks) of one KV head. Returns (acc [64, d], row_max [64], row_sum [64]),
    float32 in wgmma's register layout (the caller divides, or merges splits).

    buffers: the page buffers of `scratch`; k_ref, v_ref: [num_pages, page_size, num_kv_heads, d]
    in GMEM, 16-bit or stored a byte a value (int8, fp8 bits); page_id(block, p): the page holding
    keys [block * 64 + p * page_size, ...) (a scalar read of the block table);
    scales_of_block(block): the GMEM [2, 64] of the block's K and V scales (int8 pages), else None;
    keys outside [key_lo, key_hi) have their V rows zeroed; visible(key_pos): the [64, 64] mask of
    query rows x keys at positions key_pos (int32 [64, 64], wgmma layout).
    """
    layout = plgpu.Layout.WGMMA
    dtype = q_smem.dtype
    head_dim = q_smem.shape[-1]
    pages_per_block = KEYS_PER_BLOCK // page_size
    stored = "k_stored" in buffers  # pages a byte a value: TMA fills the stored slots, K and V are widened
    k_copied, v_copied = (buffers["k_stored"], buffers["v_stored"]) if stored else (buffers["k"], buffers["v"])
    k_barriers, v_barriers, p_smem = buffers["k_barriers"], buffers["v_barriers"], buffers["p"]

    def issue_copies(block, slot):
        for p in range(pages_per_block):
            rows = pl.ds(p * page_size, page_size)
            page = page_id(block, p)
            plgpu.copy_gmem_to_smem(k_ref.at[page, :, head, :], k_copied.at[slot, rows],
                                    k_barriers.at[slot * pages_per_block + p])
            plgpu.copy_gmem_to_smem(v_ref.at[page, :, head, :], v_copied.at[slot, rows],
                                    v_barriers.at[slot * pages_per_block + p])
        if scales_of_block is not None:
            plgpu.copy_gmem_to_smem(scales_of_block(block), buffers["scales"].at[slot],
                                    buffers["scale_barriers"].at[slot])

    def wait_copies(barriers, slot):
        for p in range(pages_per_block):
            plgpu.barrier_wait(barriers.at[slot * pages_per_block + p])

    def operand(name, slot):
        """The 16-bit [64, d] block wgmma reads: the copied slot, or the stored bytes widened into
        the one block buffer (the previous block's wgmma on it has completed)."""
        if not stored:
            return buffers[name].at[slot]
        values = buffers[f"{name}_stored"].at[slot][...]
        if values.dtype == kv_quant.FP8_BITS:  # Hopper converts e4m3fn to float16 only (exact either way)
            values = lax.bitcast_convert_type(values, kv_quant.FP8).astype(jnp.float16)
        buffers[name].at[0][...] = values.astype(dtype)
        return buffers[name].at[0]

    def key_scales(which, slot):
        """[64, 64] float32: the block's K (0) or V (1) scale of each key, broadcast over the rows."""
        column = plgpu.load(buffers["scales"].at[slot, which], layout=layout.reduce(0))
        return lax.broadcast_in_dim(column, (WGMMA_ROWS, KEYS_PER_BLOCK), [1])

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
        k_smem = operand("k", slot)
        if stored:
            plgpu.commit_smem()

        def qk(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.T)
            return acc_ref[...]

        scores = pl.run_scoped(qk, plgpu.ACC((WGMMA_ROWS, KEYS_PER_BLOCK), jnp.float32))
        if scales_of_block is not None:
            plgpu.barrier_wait(buffers["scale_barriers"].at[slot])
            scores = scores * key_scales(0, slot)
        scores = scores * scale
        if logit_soft_cap is not None:
            scores = logit_soft_cap * jnp.tanh(scores / logit_soft_cap)
        scores = jnp.where(valid, scores, MASK_VALUE)
        new_max = jnp.maximum(row_max, scores.max(axis=1))
        correction = jnp.exp(row_max - new_max)
        weights = jnp.where(valid, jnp.exp(scores - lax.broadcast_in_dim(new_max, scores.shape, [0])), 0.0)
        row_sum = row_sum * correction + weights.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(correction, acc.shape, [0])
        if scales_of_block is not None:  # P V with V = V_int8 * v_scale is (P * v_scale) V_int8
            weights = jnp.where(valid, weights * key_scales(1, slot), 0.0)  # a key no row sees may have any scale
        p_smem[...] = weights.astype(dtype)  # wgmma's A operand comes from shared memory
        wait_copies(v_barriers, slot)
        v_smem = operand("v", slot)

        @pl.when((block_key < key_lo) | (block_key + KEYS_PER_BLOCK > key_hi))
        def _():  # a boundary block: zero the V rows of the keys no row reads (they may be NaN)
            v = plgpu.load(v_smem, layout=layout)
            v_pos = block_key + plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=layout)
            v_smem[...] = jnp.where((v_pos >= key_lo) & (v_pos < key_hi), v, 0).astype(dtype)

        plgpu.commit_smem()

        def pv(acc_ref):
            plgpu.wgmma(acc_ref, p_smem, v_smem)
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
