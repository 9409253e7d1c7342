"""Quantized KV pages: int8 with per-token-per-head scales, and fp8 (e4m3fn).

A K (or V) cache is either a float array [num_pages, page_size, num_kv_heads, head_dim] or, for
int8, a dict {"pages": int8 [num_pages, page_size, num_kv_heads, head_dim],
"scales": float32 [num_pages, page_size, num_kv_heads, 1]} with value = pages * scales.

Why per token and head: `write_kv` writes each new token once, into its own slot, so its scale
(max |x| / 127 over head_dim) is fixed at write time and a page never has to be requantized
when a later token is larger. The scale array has the page layout (and the head axis at the
same place), so kernels gather it with the same page ids and the tensor-parallel head split
shards both alike. Scale cost: 4 bytes per 64-128 values (3-6 %).

fp8 pages hold the values directly (saturated to +-448, the e4m3fn range): the format carries
its own exponent, so K and V activations need no scale. They are stored as their uint8 bit
patterns (a plain uint8 array means fp8 here): XLA on CPU cannot scatter float8 in place and
would copy the whole cache on every write; loads bitcast the bytes back (`to_float`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

INT8 = jnp.dtype(jnp.int8)
FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_BITS = jnp.dtype(jnp.uint8)  # storage of fp8 pages
FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448
INT8_MAX = 127.0
KV_CACHE_DTYPES = {"int8": INT8, "fp8": FP8}


def is_scaled(cache) -> bool:
    """True for an int8 cache (pages plus per-token scales)."""
    return isinstance(cache, dict)


def values(cache) -> jax.Array:
    """The page array of a cache (its shape is the page layout)."""
    return cache["pages"] if is_scaled(cache) else cache


def split(cache) -> tuple[jax.Array, jax.Array | None]:
    """(pages, scales or None)."""
    return (cache["pages"], cache["scales"]) if is_scaled(cache) else (cache, None)


def zeros(shape: tuple[int, ...], dtype):
    """An empty cache of `shape` [num_pages, page_size, num_kv_heads, head_dim]; dtype int8 gives
    the scaled dict, float8_e4m3fn a uint8 array of fp8 bits, a float dtype a plain array."""
    if jnp.dtype(dtype) == INT8:
        return {"pages": jnp.zeros(shape, jnp.int8), "scales": jnp.zeros((*shape[:-1], 1), jnp.float32)}
    return jnp.zeros(shape, FP8_BITS if jnp.dtype(dtype) == FP8 else dtype)  # fp8 +0.0 is 0x00


def quantize_rows(x: jax.Array, cache):
    """New K or V rows [num_tokens, num_kv_heads, head_dim] in the cache's storage form."""
    pages = values(cache)
    if is_scaled(cache):
        x32 = x.astype(jnp.float32)
        scales = jnp.max(jnp.abs(x32), axis=-1, keepdims=True) / INT8_MAX  # [T, kv, 1]
        safe = jnp.where(scales > 0, scales, 1.0)
        q = jnp.clip(jnp.round(x32 / safe), -INT8_MAX, INT8_MAX).astype(jnp.int8)
        return {"pages": q, "scales": scales}
    if pages.dtype == FP8_BITS:
        fp8 = jnp.clip(x.astype(jnp.float32), -FP8_MAX, FP8_MAX).astype(FP8)
        return jax.lax.bitcast_convert_type(fp8, FP8_BITS)
    return x.astype(pages.dtype)


def write_rows(cache, x: jax.Array, slot_mapping: jax.Array):
    """Scatters rows x [num_tokens, kv, d] into slots (page * page_size + offset) of the cache."""
    rows = quantize_rows(x, cache)

    def scatter(pages, new):
        num_pages, page_size = pages.shape[:2]
        if pages.shape[-1] == 1:  # scales: through a 1-D view, else XLA CPU copies [..., 1] arrays
            kv = pages.shape[2]
            index = (slot_mapping[:, None] * kv + jnp.arange(kv)).reshape(-1)  # [T * kv]
            return pages.reshape(-1).at[index].set(new.reshape(-1)).reshape(pages.shape)
        flat = pages.reshape(num_pages * page_size, *pages.shape[2:])
        return flat.at[slot_mapping].set(new).reshape(pages.shape)

    return jax.tree.map(scatter, cache, rows)


def to_float(pages: jax.Array, dtype) -> jax.Array:
    """Stored page values as `dtype` (fp8 bit patterns reinterpreted first)."""
    if pages.dtype == FP8_BITS:
        pages = jax.lax.bitcast_convert_type(pages, FP8)
    return pages.astype(dtype)


def dequantize(pages: jax.Array, scales: jax.Array | None, dtype) -> jax.Array:
    """pages (any page-shaped block) * scales, in `dtype` (computed in float32 when scaled)."""
    if scales is None:
        return to_float(pages, dtype)
    return (pages.astype(jnp.float32) * scales).astype(dtype)


def gather(cache, block_table: jax.Array) -> jax.Array:
    """cache[block_table] dequantized to float32: [num_seqs, max_pages, page_size, kv, d]."""
    pages, scales = split(cache)
    # mode="clip" skips the out-of-bounds handling of plain indexing: ~3x faster on XLA:CPU.
    # Block table entries are always valid page ids (padding points at the null page).
    take = lambda a: jnp.take(a, block_table, axis=0, mode="clip")
    return dequantize(take(pages), None if scales is None else take(scales), jnp.float32)
