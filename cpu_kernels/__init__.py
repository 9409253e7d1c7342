"""CPU kernels called from jitted code through XLA's FFI: C++ compiled on first use.

* `quantized_matmul`: x [R, K] float32 @ an int8 or int4 weight, with the rows of x quantized
  to int8 per BLOCK inputs and multiplied with the weight codes in integer dot products (AVX-512
  VNNI), as llama.cpp does: the codes are read once at their size (half a byte for int4), where
  XLA:CPU converts every code to float first (and fuses that conversion into a matrix-vector
  product only for one row, one byte per code). A prompt chunk's rows (past a decode step's 64)
  run in tiles of 6 rows, in tasks of (strip, 48 rows) on all threads. A weight stacked on a
  layer axis is read at a layer index given with it (the layer scan's). `quantized_matmul_group`:
  several weights on one x (a layer's q, k and v) in one call, x quantized once and the strips of
  all the weights one list of tasks. quantized_matmul.cc.
* `paged_decode_attention`: decode attention over float32 KV pages, every key and value read
  once from its page for all the query heads of its KV head, the next keys prefetched, in tasks
  of (sequence, KV head, 128 keys) on XLA's CPU threads, where XLA's loop pays a dozen ops per
  block of pages (SmolLM2's 30 layers at a ~500-token context: 0.6 ms at one row, 64 ms at 64
  rows). paged_attention.cc.
* `ragged_prefill_attention`: causal attention of prompt-chunk queries over float32 KV pages, in
  tasks of (sequence, KV head, 32 queries): the queries of all the group's heads transposed in
  the cache, each key and value read once per task from its page, scores and weighted values in
  AVX-512 register tiles, an online softmax down the lanes, keys past a block's last query
  skipped, where XLA's loops run small batched dots; optionally the products in bfloat16 pairs
  (AVX-512 BF16), for models whose prompt matmuls are 16 or 8 bits anyway. prefill_attention.cc.
* `lora_update`: the multi-LoRA update, each row through its own adapter's A and B only (rows
  grouped by slot, rows on slot 0 skipped), the slab's layer read in place, where XLA's one-hot
  form multiplies every row by every slot's matrices in thin dots. lora_update.cc.
* `bf16_matmul`: x [R, K] float32 @ a bfloat16 weight (`pack_bf16`'s strips), each weight widened
  to float32 exactly and summed in float32, the weight read once at 2 bytes a weight, where
  XLA:CPU converts it element by element (1 x [576, 49152]: 47 ms, 15x its float32 dot). A
  stacked weight is read at a layer index given with it. strip_matmul.cc.
* `f32_matmul`: x [R, K] float32 @ a float32 weight (`pack_f32`'s strips), any number of rows,
  in 6 x 64 register tiles, where XLA:CPU's dot falls short of the CPU's float32 rate at the few
  rows of a decode step. strip_matmul.cc.

All run on the threads of XLA's CPU client. The library is built with the machine's C++
compiler (`$CXX`, else `c++`) for this CPU (-march=native) against the FFI headers of the
installed jaxlib, into `$JAXSERVE_KERNEL_CACHE` (default `cpu_kernels/` under $JAXSERVE_CACHE, else
~/.cache/jaxserve), named by a hash of all that and the sources: a few seconds once per machine. Without a compiler, on a
CPU without AVX-512 VNNI, or with `JAXSERVE_CPU_KERNELS=0`, `available()` is False and callers
keep their XLA formulations.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

MAX_ROWS = 64  # a decode step's rows at most; more (prompt chunks): as EngineConfig.cpu_prompt_dtype says
STRIP = 64  # output columns per strip of the packed layout (kStrip in quantized_matmul.cc)
BLOCK = 32  # inputs per int8 scale of x (kBlock)
MAX_HEAD_DIM = 256  # the attention kernel's longest head (kLanes * kMaxVectors in paged_attention.cc)
SCALE_DTYPE = jnp.float16
_SOURCES = [os.path.join(os.path.dirname(__file__), name) for name in ("quantized_matmul.cc", "paged_attention.cc",
                                                                       "lora_update.cc", "strip_matmul.cc",
                                                                       "prefill_attention.cc")]
_HEADERS = [os.path.join(os.path.dirname(__file__), "parallel_for.h")]  # part of the library's hash
_TARGETS = {"jaxserve_quantized_matmul": "JaxserveQuantizedMatmul",
            "jaxserve_quantized_matmul_group": "JaxserveQuantizedMatmulGroup",
            "jaxserve_paged_decode_attention": "JaxservePagedDecodeAttention",
            "jaxserve_ragged_prefill_attention": "JaxserveRaggedPrefillAttention",
            "jaxserve_ragged_prefill_attention_key_limit": "JaxserveRaggedPrefillAttentionKeyLimit",
            "jaxserve_lora_update": "JaxserveLoraUpdate",
            "jaxserve_bf16_matmul": "JaxserveBf16Matmul",
            "jaxserve_f32_matmul": "JaxserveF32Matmul"}  # target: handler symbol
_FLAGS = ["-O3", "-march=native", "-ffp-contract=fast", "-fPIC", "-shared", "-std=c++17", "-w"]

_lock = threading.Lock()
_state: dict[str, bool] = {}


def available() -> bool:
    """Whether the kernels are built and registered with XLA (builds them on the first call)."""
    with _lock:
        if "available" not in _state:
            _state["available"] = _load()
        return _state["available"]


def _require() -> None:
    """Registers the kernels with XLA (before a call to one is traced); RuntimeError without them."""
    if not available():
        raise RuntimeError("the CPU kernels are not available (see the warning logged when loading them)")


class _Environment(NamedTuple):
    enabled: bool  # $JAXSERVE_CPU_KERNELS is not 0
    cache: str  # $JAXSERVE_KERNEL_CACHE, else cpu_kernels/ under $JAXSERVE_CACHE, else ~/.cache/jaxserve
    compiler: str | None  # $CXX


def _environment() -> _Environment:
    """The variables this package reads, read here and only here, at each call: it sits below
    jaxserve and may not import jaxserve.environment (which lists them with the others); so the
    cache's default restates jaxserve.environment.cache_root's rule."""
    root = os.path.expanduser(os.environ.get("JAXSERVE_CACHE") or "~/.cache/jaxserve")
    return _Environment(enabled=os.environ.get("JAXSERVE_CPU_KERNELS", "1") != "0",
                        cache=os.environ.get("JAXSERVE_KERNEL_CACHE", os.path.join(root, "cpu_kernels")),
                        compiler=os.environ.get("CXX"))


def _load() -> bool:
    if not _environment().enabled or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        library = ctypes.cdll.LoadLibrary(_build())
        for target, symbol in _TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    except (OSError, subprocess.CalledProcessError, AttributeError) as error:
        log.warning("CPU kernels unavailable, XLA's formulations run instead: %s", error)
        return False
    return True


def _build() -> str:
    """The compiled library's path; compiles it when this machine has no copy yet."""
    environment = _environment()
    compiler = environment.compiler or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler (set CXX)")
    include = jax.ffi.include_dir()
    key = hashlib.sha256()
    for source in _SOURCES + _HEADERS:
        with open(source, "rb") as file:
            key.update(file.read())
    key.update(" ".join([compiler, *_FLAGS, include, jax.__version__, cpu_flags()]).encode())
    cache = environment.cache
    path = os.path.join(cache, f"cpu_kernels-{key.hexdigest()[:16]}.so")
    if not os.path.exists(path):
        os.makedirs(cache, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as scratch:  # renamed into place: safe for concurrent builds
            built = os.path.join(scratch, "library.so")
            result = subprocess.run([compiler, *_FLAGS, "-I", include, *_SOURCES, "-o", built],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                raise OSError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
            os.replace(built, path)
    return path


def cpu_flags() -> str:
    """This CPU's feature flags line of /proc/cpuinfo (the library is compiled for them), or the
    processor's name where there is none."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def pack(levels: jax.Array, bits: int) -> jax.Array:
    """Unsigned weight levels [..., K, N] uint8 (< 2**bits) -> the kernel's layout of them:
    uint8 [..., S, K / 4, STRIP, 4] (bits 8) or [..., S, K / 8, STRIP, 4] (bits 4, two levels a
    byte), S = ceil(N / STRIP) strips of output columns (see quantized_matmul.cc)."""
    *lead, k, n = levels.shape
    strips = -(-n // STRIP)
    levels = jnp.pad(levels, [(0, 0)] * len(lead) + [(0, 0), (0, strips * STRIP - n)])
    if bits == 4:  # [..., K/8, 2, 4, N]: inputs 8i + t (low nibble) and 8i + 4 + t (high nibble)
        pairs = levels.reshape(*lead, k // 8, 2, 4, strips, STRIP)
        quads = pairs[..., 0, :, :, :] | (pairs[..., 1, :, :, :] << 4)  # [..., K/8, 4, S, STRIP]
    else:
        quads = levels.reshape(*lead, k // 4, 4, strips, STRIP)
    lead_axes = tuple(range(len(lead)))
    n_lead = len(lead)
    return jnp.transpose(quads, (*lead_axes, n_lead + 2, n_lead, n_lead + 3, n_lead + 1))


def pack_groups(values: jax.Array) -> jax.Array:
    """Per-group values [..., G, N] (scales, zeros) -> [..., S, G, STRIP] in the strips of `pack`
    (zero-padded), so that a strip reads its groups' values in one sequence."""
    *lead, groups, n = values.shape
    strips = -(-n // STRIP)
    values = jnp.pad(values, [(0, 0)] * len(lead) + [(0, 0), (0, strips * STRIP - n)])
    return jnp.moveaxis(values.reshape(*lead, groups, strips, STRIP), -2, -3)


def quantized_matmul(x: jax.Array, packed: jax.Array, scale: jax.Array, zero: jax.Array | None,
                     offset_scale: float, n: int, layer: jax.Array | None = None) -> jax.Array:
    """x [..., K] @ w -> [..., n] in x's dtype, for w = level * scale + offset,
    offset = scale * offset_scale + zero (zero: 0 when None): `packed` levels (`pack`), scale
    and zero float16 [groups, n] in strips (`pack_groups`). x is quantized to int8 per BLOCK
    inputs (see quantized_matmul.cc). With `layer` (an int32 scalar, traced or not) the three
    are stacked on a leading layer axis and w is that layer's slice, read in place (an index
    outside the stack fails the call)."""
    _require()
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k).astype(jnp.float32)  # [R, K]
    stacked = layer is not None
    if scale.ndim != (4 if stacked else 3):
        raise ValueError(f"quantized_matmul: scale of shape {scale.shape} with layer={layer!r}")
    layer = jnp.zeros(1, jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32).reshape(1)
    y = jax.ffi.ffi_call("jaxserve_quantized_matmul", jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32))(
        rows, packed, scale, zero if zero is not None else jnp.zeros((1, 1), SCALE_DTYPE), layer,
        bits=np.int64(8 if packed.shape[-3] * 4 == k else 4), has_zero=np.int64(zero is not None),
        offset_scale=np.float32(offset_scale))
    return y.reshape(*lead, n).astype(x.dtype)


def quantized_matmul_group(x: jax.Array, weights, offset_scale: float,
                           layer: jax.Array | None = None) -> list[jax.Array]:
    """[x @ w for w in weights] (each as `quantized_matmul`) in one call that quantizes x once and
    shares the strips of all the weights among the threads: a layer's q, k and v projections.
    weights: (packed, scale, zero or None, n) each, all of one format (bits, zero or not, groups
    count) and stacked alike."""
    _require()
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k).astype(jnp.float32)  # [R, K]
    stacked = layer is not None
    if not weights or any(scale.ndim != (4 if stacked else 3) for _, scale, _, _ in weights):
        raise ValueError(f"quantized_matmul_group: scales {[w[1].shape for w in weights]} with layer={layer!r}")
    bits = {8 if packed.shape[-3] * 4 == k else 4 for packed, _, _, _ in weights}
    has_zero = {zero is not None for _, _, zero, _ in weights}
    if len(bits) != 1 or len(has_zero) != 1 or len({scale.shape[-2] for _, scale, _, _ in weights}) != 1:
        raise ValueError("quantized_matmul_group: the weights must share one format")
    layer = jnp.zeros(1, jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32).reshape(1)
    no_zero = jnp.zeros((1, 1), SCALE_DTYPE)
    operands = [a for packed, scale, zero, _ in weights for a in (packed, scale, no_zero if zero is None else zero)]
    ys = jax.ffi.ffi_call("jaxserve_quantized_matmul_group",
                          [jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32) for *_, n in weights])(
        rows, layer, *operands, bits=np.int64(bits.pop()), has_zero=np.int64(has_zero.pop()),
        offset_scale=np.float32(offset_scale))
    return [y.reshape(*lead, n).astype(x.dtype) for y, (*_, n) in zip(ys, weights)]


def takes_decode_attention(q, k_pages, v_pages) -> bool:
    """Whether `paged_decode_attention` serves these operands: float32 queries and pages (not
    an int8 / fp8 cache), head_dim up to MAX_HEAD_DIM, and the kernels built."""
    return all(getattr(a, "dtype", None) == jnp.float32 for a in (q, k_pages, v_pages)) \
        and q.shape[-1] <= MAX_HEAD_DIM and available()


def paged_decode_attention(q, k_pages, v_pages, block_table, seq_lens, *, window, scale: float,
                           soft_cap: float | None) -> jax.Array:
    """Decode attention (pallas_kernels.xla_paged.paged_decode_attention's inputs and result):
    q [S, Hq, D] float32, pages [P, page_size, Hkv, D] float32, block_table int32 [S, W],
    seq_lens int32 [S], window an int32 scalar (<= 0: none) -> [S, Hq, D] float32."""
    _require()
    return jax.ffi.ffi_call("jaxserve_paged_decode_attention", jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q, k_pages, v_pages, block_table.astype(jnp.int32), seq_lens.astype(jnp.int32),
        jnp.asarray(window, jnp.int32).reshape(1), scale=np.float32(scale), soft_cap=np.float32(soft_cap or 0.0))


def takes_prefill_attention(q, k_pages, v_pages) -> bool:
    """Whether `ragged_prefill_attention` serves these operands: float32 queries and pages (not
    an int8 / fp8 cache), head_dim up to MAX_HEAD_DIM, and the kernels built."""
    return takes_decode_attention(q, k_pages, v_pages)


def ragged_prefill_attention(q, k_pages, v_pages, block_table, seq_lens, query_start_loc, *, window,
                             scale: float, soft_cap: float | None, key_limit=None,
                             bf16_products: bool = False) -> jax.Array:
    """Causal attention of ragged query tokens (pallas_kernels.xla_paged.ragged_paged_attention's
    inputs and result): q [T, Hq, D] float32, pages [P, page_size, Hkv, D] float32, block_table
    int32 [S, W], seq_lens int32 [S], query_start_loc int32 [S + 1] (non-decreasing), window an
    int32 scalar (<= 0: none) -> [T, Hq, D] float32 (zeros for tokens of no sequence).
    key_limit (int32 [T] or None): each query's highest visible key position (bidirectional image
    spans: a query at p sees k <= max(p, key_limit[t]), the window's rule unchanged); given, the
    call goes to the handler that takes it as one more buffer, so that the causal call is the one
    it always was. bf16_products: the scores' and the weighted values' products in bfloat16
    (queries, keys, values and softmax weights rounded to it; sums in float32) where the CPU has
    AVX-512 BF16 (twice float32's rate), else float32 as without it."""
    _require()
    operands = [q, k_pages, v_pages, block_table.astype(jnp.int32), seq_lens.astype(jnp.int32),
                query_start_loc.astype(jnp.int32), jnp.asarray(window, jnp.int32).reshape(1)]
    target = "jaxserve_ragged_prefill_attention"
    if key_limit is not None:
        if key_limit.shape != (q.shape[0],):
            raise ValueError(f"ragged_prefill_attention: key_limit {key_limit.shape} for {q.shape[0]} tokens")
        operands.append(key_limit.astype(jnp.int32))
        target += "_key_limit"
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        *operands, scale=np.float32(scale), soft_cap=np.float32(soft_cap or 0.0), bf16=np.int64(bf16_products))


def takes_lora_update(x, a, b) -> bool:
    """Whether `lora_update` serves these operands: float32 rows and slab (a bfloat16 slab keeps
    the XLA form), and the kernels built."""
    return all(getattr(t, "dtype", None) == jnp.float32 for t in (x, a, b)) and available()


def lora_update(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array,
                layer: jax.Array | None = None) -> jax.Array:
    """Each row's (x[t] @ a[slots[t]]) @ b[slots[t]] (pallas_kernels.reference.lora_update's
    result, float32 sums): x [T, K] float32, a [S, K, R] and b [S, R, N] float32 (slot 0 the
    zero adapter, its rows get zeros), slots int32 [T] in [0, S) -> [T, N] float32. With `layer`
    (an int32 scalar, traced or not) a and b are stacked on a leading layer axis ([L, S, ...])
    and that layer's slices are read in place. A slot or layer outside the slab fails the call."""
    _require()
    stacked = layer is not None
    if a.ndim != (4 if stacked else 3) or b.ndim != a.ndim:
        raise ValueError(f"lora_update: a {a.shape} and b {b.shape} with layer={layer!r}")
    layer = jnp.zeros(1, jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32).reshape(1)
    return jax.ffi.ffi_call("jaxserve_lora_update", jax.ShapeDtypeStruct((x.shape[0], b.shape[-1]), jnp.float32))(
        x, a, b, slots.astype(jnp.int32), layer)


def pack_bf16(w: jax.Array) -> jax.Array:
    """A bfloat16 weight [..., K, N] -> the kernel's layout of it: bfloat16 [..., S, K, STRIP],
    S = ceil(N / STRIP) strips of output columns (the last one zero-padded), each half of 32
    columns of a strip's row interleaved (element 2i: column i, 2i + 1: column 16 + i; see
    strip_matmul.cc). Leading axes (a layer stack) are kept."""
    *lead, k, n = w.shape
    strips = -(-n // STRIP)
    w = jnp.pad(w.astype(jnp.bfloat16), [(0, 0)] * len(lead) + [(0, 0), (0, strips * STRIP - n)])
    w = w.reshape(*lead, k, strips, 2, 2, 16)  # column s*64 + h*32 + j*16 + i
    n_lead = len(lead)
    w = jnp.transpose(w, (*range(n_lead), n_lead + 1, n_lead, n_lead + 2, n_lead + 4, n_lead + 3))
    return w.reshape(*lead, strips, k, STRIP)


def unpack_bf16(packed: jax.Array, n: int) -> jax.Array:
    """`pack_bf16`'s inverse: bfloat16 [..., S, K, STRIP] -> the weight [..., K, n]."""
    *lead, strips, k, _ = packed.shape
    w = packed.reshape(*lead, strips, k, 2, 16, 2)  # [..., s, k, h, i, j]: column s*64 + h*32 + j*16 + i
    n_lead = len(lead)
    w = jnp.transpose(w, (*range(n_lead), n_lead + 1, n_lead, n_lead + 2, n_lead + 4, n_lead + 3))
    return w.reshape(*lead, k, strips * STRIP)[..., :n]


def takes_bf16_matmul(x, packed, layer=None) -> bool:
    """Whether `bf16_matmul` serves these operands: a `pack_bf16` weight (4-D with `layer`, else
    3-D), at most MAX_ROWS rows of x, and the kernels built."""
    rows = int(np.prod(x.shape[:-1]))
    return getattr(packed, "dtype", None) == jnp.bfloat16 and packed.ndim == (4 if layer is not None else 3) \
        and packed.shape[-1] == STRIP and packed.shape[-2] == x.shape[-1] and rows <= MAX_ROWS and available()


def bf16_matmul(x: jax.Array, packed: jax.Array, n: int, layer: jax.Array | None = None) -> jax.Array:
    """x [..., K] (float32, or cast to it) @ w -> [..., n] float32, for w bfloat16 [K, n] as
    `pack_bf16` lays it out, prod(x.shape[:-1]) <= MAX_ROWS: float32 products and sums of the
    exact weights, as x @ w.astype(float32). With `layer` (an int32 scalar, traced or not) the
    weight is stacked on a leading layer axis ([L, S, K, STRIP]) and w is that layer's slice,
    read in place (an index outside the stack fails the call)."""
    _require()
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k).astype(jnp.float32)  # [R, K]
    if packed.ndim != (4 if layer is not None else 3) or packed.shape[-2:] != (k, STRIP):
        raise ValueError(f"bf16_matmul: packed {packed.shape} for x {x.shape} with layer={layer!r}")
    if rows.shape[0] > MAX_ROWS:
        raise ValueError(f"bf16_matmul: {rows.shape[0]} rows, at most {MAX_ROWS}")
    layer = jnp.zeros(1, jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32).reshape(1)
    y = jax.ffi.ffi_call("jaxserve_bf16_matmul", jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32))(
        rows, packed.astype(jnp.bfloat16), layer)
    return y.reshape(*lead, n)


def pack_f32(w: jax.Array) -> jax.Array:
    """A float32 weight [..., K, N] -> the kernel's layout of it: float32 [..., S, K, STRIP],
    S = ceil(N / STRIP) strips of output columns in order (the last one zero-padded; see
    strip_matmul.cc). Leading axes (a layer stack) are kept."""
    *lead, k, n = w.shape
    strips = -(-n // STRIP)
    w = jnp.pad(w.astype(jnp.float32), [(0, 0)] * len(lead) + [(0, 0), (0, strips * STRIP - n)])
    return jnp.swapaxes(w.reshape(*lead, k, strips, STRIP), -3, -2)


def unpack_f32(packed: jax.Array, n: int) -> jax.Array:
    """`pack_f32`'s inverse: float32 [..., S, K, STRIP] -> the weight [..., K, n]."""
    *lead, strips, k, _ = packed.shape
    return jnp.swapaxes(packed, -3, -2).reshape(*lead, k, strips * STRIP)[..., :n]


def f32_matmul(x: jax.Array, packed: jax.Array, n: int, layer: jax.Array | None = None) -> jax.Array:
    """x [..., K] (float32, or cast to it) @ w -> [..., n] float32, for w float32 [K, n] as
    `pack_f32` lays it out: float32 products summed in order over K (each output one chain of
    FMAs), as x @ w up to the order of the sums. With `layer` (an int32 scalar, traced or not) the
    weight is stacked on a leading layer axis ([L, S, K, STRIP]) and w is that layer's slice, read
    in place (an index outside the stack fails the call)."""
    _require()
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k).astype(jnp.float32)  # [R, K]
    if packed.ndim != (4 if layer is not None else 3) or packed.shape[-2:] != (k, STRIP):
        raise ValueError(f"f32_matmul: packed {packed.shape} for x {x.shape} with layer={layer!r}")
    layer = jnp.zeros(1, jnp.int32) if layer is None else jnp.asarray(layer, jnp.int32).reshape(1)
    y = jax.ffi.ffi_call("jaxserve_f32_matmul", jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32))(
        rows, packed.astype(jnp.float32), layer)
    return y.reshape(*lead, n)
