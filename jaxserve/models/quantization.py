"""Weight-only quantization of the decoder's linear layers (int8 and int4), and `linear`.

A quantized weight replaces one stacked float leaf `[L, in, out]` with a small dict, so the layer
scan still slices it layer by layer:

    int8:  q     int8   [L, in, out]          w = q * scale
           with a zero point:     w = (q + 128) * scale + zero      (zero = the group's minimum)
    int4:  q     uint8  [L, in // 2, out]     two 4-bit codes u in [0, 15] per byte
           (in each group of g inputs, byte j holds input j in its low nibble and input j + g/2 in
           its high nibble: the GGUF Q4 block order, so Q4_0 / Q4_1 blocks copy over unchanged)
           symmetric:             w = (u - 8) * scale
           with a zero point:     w = u * scale + zero      (zero = the group's minimum, as Q4_1)
    scale, zero: float16 [L, groups, out]; groups = in // group_size, or 1 (per output channel).

Published checkpoints (compressed-tensors, GPTQ, AWQ; checkpoints/prequantized.py) keep their
own numbers, which adds a few stored-only variants (not choices of --quantization):

    _izp   integer zero point (uint8 for int4, int8 for int8) [L, groups, out]:
           w = (u - zero) * scale (int4),  w = (q - zero) * scale (int8)
    _actorder  perm int32 [L, in]: the rows are stored in the order perm gives the inputs
           (GPTQ act-order, sorted by group), and `linear` gathers x[..., perm] first
    fp8    q float8_e4m3fn [L, in, out], scale [L, 1, out]: w = q * scale
    _bf16, _f32  the scales' (and a float zero's) dtype, when not float16

(`dequantize` gives the rows in their stored order.) The format is self-describing (dtype of q,
scale and zero, shapes of scale, presence of zero and perm), so `linear` needs no side
information. Format names: "int8" (per output channel), "int8_g32|64|128" (groups along the
input), "_zp" for int8 with a zero point (e.g. "int8_g32_zp": the 16 levels of a GGUF Q4_1
block are 16 of its codes, so those blocks copy over exactly), "int4" = "int4_g32" (zero
point), "int4_g64|128", and "_sym" for symmetric int4. Embeddings, lm_head, norms and biases stay float
(`quantize_embedding`: the embedding and lm_head in int8, an option).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import cpu_kernels
from jaxserve.config import ModelConfig
from jaxserve.models import weights

GROUP_SIZES = (32, 64, 128)
SCALE_DTYPE = jnp.float16
_FORMAT_NAME = re.compile(r"(?:int(?P<bits>[48])|(?P<fp8>fp8))(?:_g(?P<group>\d+))?(?P<suffix>_sym|_zp|_izp)?"
                          r"(?P<act_order>_actorder)?(?P<scale_dtype>_bf16|_f32)?")
_SCALE_SUFFIXES = {"float16": "", "bfloat16": "_bf16", "float32": "_f32"}
INT8_ZERO_OFFSET = 128  # int8 with a zero point: code q in [-128, 127] stands for level q + 128


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    bits: int  # 8 or 4
    group_size: int | None  # inputs per scale; None: one scale per output channel (int8 only)
    zero_point: bool = False  # w = level * scale + zero (level: u for int4, q + 128 for int8)
    # Stored-only variants of published checkpoints (see the module doc):
    integer_zero: bool = False  # with zero_point: zero is an integer code, w = (level - zero) * scale
    act_order: bool = False  # a perm array: rows stored in the inputs' order perm gives
    float8: bool = False  # q float8_e4m3fn, w = q * scale (bits 8, per output channel)
    scale_dtype: str = "float16"  # of scale (and of a float zero)

    @property
    def name(self) -> str:
        group = "" if self.group_size is None else f"_g{self.group_size}"
        tail = ("_actorder" if self.act_order else "") + _SCALE_SUFFIXES[self.scale_dtype]
        if self.float8:
            return f"fp8{group}{tail}"
        if self.integer_zero:
            return f"int{self.bits}{group}_izp{tail}"
        if self.bits == 4:
            return f"int4{group}{'' if self.zero_point else '_sym'}{tail}"
        return f"int8{group}{'_zp' if self.zero_point else ''}{tail}"


def parse_format(name: str, stored: bool = False) -> QuantFormat:
    """'int8', 'int8_g32', 'int8_g32_zp', 'int4', 'int4_g64_sym', ... -> QuantFormat; ValueError otherwise.
    `stored`: also the stored-only variants of published checkpoints (_izp, _actorder, fp8, _bf16, _f32)."""
    match = _FORMAT_NAME.fullmatch(name.strip().lower())
    group = None if match is None or match["group"] is None else int(match["group"])
    suffix = None if match is None else match["suffix"]
    if match is not None and match["fp8"]:
        valid = not (suffix or match["act_order"] or group)
    else:
        valid = (match is not None and (group is None or group in GROUP_SIZES)
                 and suffix != ("_sym" if match["bits"] == "8" else "_zp"))
    if not valid:
        raise ValueError(f"unknown quantization {name!r}; use int8 or int4, optionally with a group "
                         f"size _g32, _g64 or _g128 (and _zp for int8 with a zero point, _sym for "
                         f"symmetric int4), e.g. int4_g64")
    if not stored and (match["fp8"] or suffix == "_izp" or match["act_order"] or match["scale_dtype"]):
        raise ValueError(f"unknown quantization {name!r}: a format published quantized checkpoints are "
                         f"stored in, not one to quantize into; use int8 or int4 (e.g. int4_g64, int8_g32_zp)")
    scale_dtype = {v: k for k, v in _SCALE_SUFFIXES.items()}[match["scale_dtype"] or ""]
    if match["fp8"]:
        return QuantFormat(8, None, float8=True, scale_dtype=scale_dtype)
    bits = int(match["bits"])
    return QuantFormat(bits, group if bits == 8 else group or 32,
                       zero_point=suffix in ("_zp", "_izp") or (bits == 4 and suffix is None),
                       integer_zero=suffix == "_izp", act_order=bool(match["act_order"]), scale_dtype=scale_dtype)


def is_quantized(weight: Any) -> bool:
    return isinstance(weight, dict) and ("q" in weight or "q_t" in weight)


def weight_format(weight: dict) -> QuantFormat:
    """The format a quantized weight is stored in, read from its arrays."""
    bits = 4 if weight["q"].dtype == jnp.uint8 else 8
    in_features = weight["q"].shape[-2] * (2 if bits == 4 else 1)
    groups = weight["scale"].shape[-2]
    group = None if groups == 1 and bits == 8 else in_features // groups
    zero = weight.get("zero")
    return QuantFormat(bits, group, zero_point=zero is not None,
                       integer_zero=zero is not None and jnp.issubdtype(zero.dtype, jnp.integer),
                       act_order="perm" in weight, float8=weight["q"].dtype == jnp.float8_e4m3fn,
                       scale_dtype=jnp.dtype(weight["scale"].dtype).name)


def quantized_shapes(shape: tuple[int, ...], fmt: QuantFormat, name: str = "weight") -> dict[str, tuple]:
    """Shapes of the arrays of a `[..., in, out]` weight stored in `fmt`; ValueError when the
    group size does not divide the input size."""
    *lead, in_features, out_features = shape
    group = fmt.group_size or in_features
    if in_features % group:
        raise ValueError(f"{fmt.name}: group size {group} does not divide the input size {in_features} "
                         f"of {name}; choose another group size")
    rows = in_features // 2 if fmt.bits == 4 else in_features
    shapes = {"q": (*lead, rows, out_features), "scale": (*lead, in_features // group, out_features)}
    if fmt.zero_point:
        shapes["zero"] = shapes["scale"]
    if fmt.act_order:
        shapes["perm"] = (*lead, in_features)
    return shapes


def quantized_dtypes(fmt: QuantFormat) -> dict[str, Any]:
    q = jnp.uint8 if fmt.bits == 4 else (jnp.float8_e4m3fn if fmt.float8 else jnp.int8)
    dtypes = {"q": jnp.dtype(q), "scale": jnp.dtype(fmt.scale_dtype)}
    if fmt.zero_point:
        integer = jnp.uint8 if fmt.bits == 4 else jnp.int8
        dtypes["zero"] = jnp.dtype(integer if fmt.integer_zero else fmt.scale_dtype)
    if fmt.act_order:
        dtypes["perm"] = jnp.dtype(jnp.int32)
    return dtypes


def pack_int4(codes: jax.Array, group_size: int) -> jax.Array:
    """uint8 codes in [0, 15], [..., in, out] -> packed [..., in // 2, out] (see module doc)."""
    *lead, in_features, out = codes.shape
    groups = codes.reshape(*lead, in_features // group_size, 2, group_size // 2, out)
    packed = groups[..., 0, :, :] | (groups[..., 1, :, :] << 4)
    return packed.reshape(*lead, in_features // 2, out)


def int4_halves(weight: dict) -> tuple[jax.Array, jax.Array]:
    """Float32 values of a packed int4 weight: (first, second) half of every input group, each
    [..., groups, group_size // 2, out], straight from the low and high nibbles."""
    q, scale = weight["q"], weight["scale"].astype(jnp.float32)[..., None, :]  # scale: [..., G, 1, out]
    *lead, rows, out = q.shape
    num_groups = scale.shape[-3]
    packed = q.reshape(*lead, num_groups, rows // num_groups, out)
    halves = []
    for codes in (packed & 0xF, packed >> 4):
        codes = codes.astype(jnp.float32)
        if "zero" in weight and jnp.issubdtype(weight["zero"].dtype, jnp.integer):  # (u - zero) * scale
            halves.append((codes - weight["zero"].astype(jnp.float32)[..., None, :]) * scale)
        elif "zero" in weight:
            halves.append(codes * scale + weight["zero"].astype(jnp.float32)[..., None, :])
        else:
            halves.append((codes - 8.0) * scale)
    return halves[0], halves[1]


def quantize(weight: jax.Array, fmt: QuantFormat, name: str = "weight") -> dict[str, jax.Array]:
    """A float `[..., in, out]` weight -> its quantized dict (round to nearest, float16 scales)."""
    shapes = quantized_shapes(weight.shape, fmt, name)
    *lead, in_features, out = weight.shape
    num_groups = shapes["scale"][-2]
    w = jnp.asarray(weight, jnp.float32).reshape(*lead, num_groups, in_features // num_groups, out)
    if fmt.zero_point:  # levels (w - zero) / scale in [0, 255] or [0, 15]; int8 stores level - 128
        levels = 255 if fmt.bits == 8 else 15
        low, high = jnp.min(w, axis=-2), jnp.max(w, axis=-2)
        scale, zero = _to_scale((high - low) / levels), low.astype(SCALE_DTYPE)
        codes = jnp.clip(jnp.round((w - zero.astype(jnp.float32)[..., None, :]) / _safe(scale)), 0, levels)
        codes = codes - INT8_ZERO_OFFSET if fmt.bits == 8 else codes
    else:  # w / scale in [-127, 127] or [-8, 7]; int4 stores it + 8
        top = 127 if fmt.bits == 8 else 7
        scale = _to_scale(jnp.max(jnp.abs(w), axis=-2) / top)
        codes = jnp.clip(jnp.round(w / _safe(scale)), -top if fmt.bits == 8 else -8, top)
        codes = codes if fmt.bits == 8 else codes + 8
    codes = codes.reshape(*lead, in_features, out)
    if fmt.bits == 8:
        result = {"q": codes.astype(jnp.int8), "scale": scale}
    else:
        result = {"q": pack_int4(codes.astype(jnp.uint8), in_features // num_groups), "scale": scale}
    if fmt.zero_point:
        result["zero"] = zero
    return result


def _to_scale(value: jax.Array) -> jax.Array:
    return jnp.minimum(value, float(jnp.finfo(SCALE_DTYPE).max)).astype(SCALE_DTYPE)


def _safe(scale: jax.Array) -> jax.Array:
    """Scales as float32 [..., groups, 1, out], 1 where a group is all zeros (its codes are 0)."""
    s = scale.astype(jnp.float32)
    return jnp.where(s > 0, s, 1.0)[..., None, :]


def dequantize(weight: dict, dtype=jnp.float32) -> jax.Array:
    """The float `[..., in, out]` weight a quantized dict stands for (computed in float32)."""
    q, num_groups = weight["q"], weight["scale"].shape[-2]
    if q.dtype == jnp.uint8:
        values = jnp.concatenate(int4_halves(weight), axis=-2)  # [..., G, g, out]
    else:
        *lead, rows, out = q.shape
        values = q.reshape(*lead, num_groups, rows // num_groups, out).astype(jnp.float32)
        if "zero" in weight and jnp.issubdtype(weight["zero"].dtype, jnp.integer):  # (q - zero) * scale
            values = (values - weight["zero"].astype(jnp.float32)[..., None, :])
            values = values * weight["scale"].astype(jnp.float32)[..., None, :]
        elif "zero" in weight:
            values = (values + INT8_ZERO_OFFSET) * weight["scale"].astype(jnp.float32)[..., None, :]
            values = values + weight["zero"].astype(jnp.float32)[..., None, :]
        else:
            values = values * weight["scale"].astype(jnp.float32)[..., None, :]
    *lead, groups, group, out = values.shape
    return values.reshape(*lead, groups * group, out).astype(dtype)


def linear(x: jax.Array, weight) -> jax.Array:
    """x [..., in] @ weight [in, out] for a float or quantized weight (2-D: one layer's slice).

    A weight with `with_kernel_layout`'s codes (the CPU step's, see llama.layer_views)
    multiplies up to cpu_kernels.MAX_ROWS rows in the C++ kernel (cpu_kernels); with a "layer"
    entry (an int32 scalar) its kernel-layout arrays are stacked on a layer axis and the kernel
    reads that layer's slice of them in place.
    Otherwise the dequantization is elementwise work that XLA fuses into the jitted step. int4
    runs as two dots over the low-nibble and high-nibble halves of every group (the inputs split
    to match), which spares XLA an interleave of the unpacked codes (2.5x faster on CPU, measured)."""
    if not is_quantized(weight):
        return x @ weight
    if "packed" in weight and math.prod(x.shape[:-1]) <= cpu_kernels.MAX_ROWS:
        int4 = weight["q"].dtype == jnp.uint8
        offset_scale = 0.0 if "zero" in weight else (-8.0 if int4 else -float(INT8_ZERO_OFFSET))
        return cpu_kernels.quantized_matmul(x, weight["packed"], weight["packed_scale"], weight.get("packed_zero"),
                                            offset_scale, weight["q"].shape[-1], layer=weight.get("layer"))
    if "perm" in weight:  # act-order: the rows are stored in this order of the inputs
        x = jnp.take(x, weight["perm"], axis=-1)
    if "q_t" in weight and math.prod(x.shape[:-1]) == 1:  # one row: see `transposed`
        return _linear_transposed(x, weight)
    if weight["q"].dtype != jnp.uint8:
        return x @ dequantize(weight, x.dtype)
    first, second = int4_halves(weight)  # [G, g/2, out] each
    num_groups, half, out = first.shape
    lead = x.shape[:-1]
    x_halves = x.reshape(*lead, num_groups, 2, half)
    x_first = x_halves[..., 0, :].reshape(*lead, num_groups * half)
    x_second = x_halves[..., 1, :].reshape(*lead, num_groups * half)
    return (x_first @ first.reshape(num_groups * half, out).astype(x.dtype)
            + x_second @ second.reshape(num_groups * half, out).astype(x.dtype))


def with_kernel_layout(weight: dict) -> dict:
    """`weight` (stored layout, `cpu_kernels.supports` it) with its levels, scales and zeros
    also in the CPU kernel's layout ("packed", "packed_scale", "packed_zero"; `cpu_kernels.pack`
    and `pack_groups`): a copy at their own size. Every weight is  level * scale + offset, with
    level u = the int4 code, or q + 128 for int8."""
    q = weight["q"]
    if q.dtype == jnp.uint8:
        packed = cpu_kernels.pack(_int4_codes(q, weight["scale"].shape[-2]), 4)
    else:
        packed = cpu_kernels.pack(q.view(jnp.uint8) ^ jnp.uint8(0x80), 8)
    result = {**weight, "packed": packed, "packed_scale": cpu_kernels.pack_groups(weight["scale"])}
    if "zero" in weight:
        result["packed_zero"] = cpu_kernels.pack_groups(weight["zero"])
    return result


KERNEL_LAYOUT = ("packed", "packed_scale", "packed_zero")  # the entries with_kernel_layout adds


def _int4_codes(q: jax.Array, num_groups: int) -> jax.Array:
    """Packed int4 codes [..., in / 2, out] -> one code a byte [..., in, out], in the inputs' order."""
    *lead, rows, out = q.shape
    packed = q.reshape(*lead, num_groups, rows // num_groups, out)
    return jnp.concatenate([packed & 0xF, packed >> 4], axis=-2).reshape(*lead, 2 * rows, out)


def transposable(weight) -> bool:
    """Whether `transposed` applies: a quantized weight in its stored layout."""
    return is_quantized(weight) and "q" in weight


def transposed(weight: dict) -> dict:
    """A quantized weight in the layout whose dequantization XLA:CPU fuses into a matrix-vector
    product: q_t [..., out, in] (int8 / fp8 codes, or int4 codes unpacked to one uint8 each),
    scale_t (and zero_t) [..., out, groups] (float scales and zeros as float32; perm unchanged).
    `linear` reads it.

    XLA:CPU never fuses a producer into a matrix-matrix dot, so `linear` on the stored [in, out]
    layout writes the weight out in float32 and multiplies that (4 bytes written and read again
    per weight, on top of the 1 read). For a single row, though, XLA emits `x @ w.T` with w
    [out, in] as one loop over the output (a dot per contiguous row of w) and fuses w's
    elementwise producers into it: the codes are read once and converted in registers
    (tests/test_quantization.py checks the compiled HLO). Packed int4 codes in that loop run
    slower than the stored layout's two dots (the nibble unpacking does not vectorize there),
    so int4 codes are unpacked here: the step reads a byte per int4 weight, as for int8.
    With several rows the stored layout is as fast or faster (2, 4, 8 rows measured), so the
    CPU step keeps both (`llama.layer_views`) and `linear` reads this one for a single row."""
    swap = lambda a: jnp.swapaxes(a, -1, -2)
    floats = lambda a: a if jnp.issubdtype(a.dtype, jnp.integer) else a.astype(jnp.float32)
    q = weight["q"]
    if q.dtype == jnp.uint8:
        q = _int4_codes(q, weight["scale"].shape[-2])
    result = {"q_t": swap(q), "scale_t": floats(swap(weight["scale"]))}
    if "zero" in weight:
        result["zero_t"] = floats(swap(weight["zero"]))
    if "perm" in weight:
        result["perm"] = weight["perm"]
    return result


def _linear_transposed(x: jax.Array, weight: dict) -> jax.Array:
    """x [..., in] @ a `transposed` weight: x @ (dequantized q_t).T."""
    q, scale = weight["q_t"], weight["scale_t"].astype(jnp.float32)  # [out, in], [out, G]
    out, in_features = q.shape
    num_groups = scale.shape[-1]
    values = q.reshape(out, num_groups, in_features // num_groups).astype(jnp.float32)
    zero = weight.get("zero_t")
    int4 = q.dtype == jnp.uint8  # unpacked int4 codes u in [0, 15]
    if zero is not None and jnp.issubdtype(zero.dtype, jnp.integer):  # (code - zero) * scale
        values = (values - zero.astype(jnp.float32)[..., None]) * scale[..., None]
    elif zero is not None:  # level * scale + zero; the level of an int8 code q is q + 128
        values = (values if int4 else values + INT8_ZERO_OFFSET) * scale[..., None] + zero.astype(jnp.float32)[..., None]
    else:
        values = (values - 8.0 if int4 else values) * scale[..., None]
    return (x @ values.reshape(out, in_features).T.astype(x.dtype)).astype(x.dtype)


# ---- the token embedding (and the lm_head tied to it) -------------------------------------------

EMBEDDING_CHUNK_ROWS = 4096  # vocabulary rows dequantized at a time for logits of several rows


def quantize_embedding(params: dict) -> dict:
    """`params` with the token embedding [V, D] in int8, one float32 scale per vocabulary row
    ({"q": int8 [V, D], "scale": float32 [V, 1]}, symmetric) and an untied lm_head [D, V] in
    per-output-channel int8: an option next to the linear layers' formats, for a model whose
    embedding is a large part of its bytes (SmolLM2-135M: 113 MiB of 513 in float32, read whole
    by every step through the tied lm_head). Unsharded weights only."""
    params = dict(params)
    params["embed"] = _quantize_rows_jit(params["embed"])
    if "lm_head" in params and not is_quantized(params["lm_head"]):
        params["lm_head"] = _quantize_jit(params["lm_head"], QuantFormat(8, None), "lm_head")
    return params


@jax.jit
def _quantize_rows_jit(embed):
    w = embed.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=-1, keepdims=True) / 127
    q = jnp.clip(jnp.round(w / jnp.where(scale > 0, scale, 1.0)), -127, 127).astype(jnp.int8)
    return {"q": q, "scale": scale}


def lm_head_kernel_weight(embed: dict) -> dict:
    """The tied lm_head of a quantize_embedding embedding as a per-output-channel int8 weight
    [D, V] (float16 scales) for the CPU kernel: `cpu_kernels.supports` tells whether it takes it."""
    return {"q": embed["q"].T, "scale": embed["scale"].T.astype(SCALE_DTYPE)}


def embedding_with_kernel_layout(embed: dict) -> dict:
    """A quantize_embedding embedding with its tied lm_head also in the CPU kernel's layout
    ("packed" and "packed_scale": a copy of the codes and their scales), which `embedding_logits`
    reads for up to cpu_kernels.MAX_ROWS rows (see llama.layer_views)."""
    head = with_kernel_layout(lm_head_kernel_weight(embed))
    return {**embed, "packed": head["packed"], "packed_scale": head["packed_scale"]}


def embedding_rows(embed: dict, token_ids: jax.Array) -> jax.Array:
    """Rows [T, D] float32 of a quantize_embedding embedding."""
    return embed["q"][token_ids].astype(jnp.float32) * embed["scale"][token_ids]


def embedding_logits(x: jax.Array, embed: dict) -> jax.Array:
    """x [R, D] @ embedding.T -> logits [R, V] float32 for a quantize_embedding embedding.

    One row (a decode step of one sequence): `x @ q.T` with the conversion fused into XLA:CPU's
    matrix-vector loop, which reads the int8 codes once (see `transposed`). Several rows: the
    dequantized float32 embedding would be V x D x 4 bytes written and read again, so it is
    dequantized EMBEDDING_CHUNK_ROWS vocabulary rows at a time under a loop, each chunk
    multiplied while it is in the cache."""
    q, scale = embed["q"], embed["scale"]
    x = x.astype(jnp.float32)
    if "packed" in embed and x.shape[0] <= cpu_kernels.MAX_ROWS:  # see embedding_with_kernel_layout
        return cpu_kernels.quantized_matmul(x, embed["packed"], embed["packed_scale"], None, -float(INT8_ZERO_OFFSET),
                                            q.shape[0])
    if x.shape[0] == 1:
        return (x @ q.T.astype(jnp.float32)) * scale[:, 0]
    vocab, dim = q.shape
    chunk = min(EMBEDDING_CHUNK_ROWS, vocab)
    num_chunks = -(-vocab // chunk)
    pad = num_chunks * chunk - vocab  # zero rows: logits 0, cut off below
    q, scale = (jnp.pad(q, ((0, pad), (0, 0))), jnp.pad(scale, ((0, pad), (0, 0)))) if pad else (q, scale)
    chunks = jax.lax.map(lambda qs: (x @ qs[0].astype(jnp.float32).T) * qs[1][:, 0],
                         (q.reshape(num_chunks, chunk, dim), scale.reshape(num_chunks, chunk, 1)))
    return chunks.transpose(1, 0, 2).reshape(x.shape[0], num_chunks * chunk)[:, :vocab]  # [R, V]


# ---- whole parameter trees ---------------------------------------------------------------------

def quantize_params(params: dict, quantization: str | QuantFormat, config: ModelConfig) -> dict:
    """`params` (of `config`'s model) with every float linear leaf quantized (on its device, one
    leaf at a time; the linear leaves are those jaxserve.models.weights declares with role "linear").

    Leaves already quantized are kept when they have the requested number of bits; a different
    number of bits is a ValueError (convert the model again instead)."""
    fmt = parse_format(quantization) if isinstance(quantization, str) else quantization
    layers = dict(params["layers"])
    for name in weights.linear_leaves(config):
        weight = layers[name]
        if is_quantized(weight):
            stored = weight_format(weight)
            if stored.bits != fmt.bits:
                raise ValueError(f"the checkpoint's weights are already quantized as {stored.name}; "
                                 f"cannot serve them as {fmt.name} (convert the model again)")
            continue
        quantized_shapes(weight.shape, fmt, name)  # group-size check with the leaf's name
        layers[name] = _quantize_jit(weight, fmt, name)
    return {**params, "layers": layers}


@jax.jit
def _dequantize_jit(weight):
    return dequantize(weight)


_quantize_jit = jax.jit(quantize, static_argnums=(1, 2))


def quantize_array(weight: np.ndarray, fmt: QuantFormat, name: str = "weight") -> dict[str, np.ndarray]:
    """`quantize` on the host, numpy in and out (checkpoint conversion, one layer at a time)."""
    with jax.default_device(jax.devices("cpu")[0]):
        return {k: np.asarray(v) for k, v in _quantize_jit(weight, fmt, name).items()}


def params_formats(params: dict) -> dict[str, str]:
    """{linear leaf name: format name} of the quantized leaves of `params`."""
    return {name: weight_format(w).name for name, w in params["layers"].items() if is_quantized(w)}


def dequantize_params(params: dict) -> dict:
    """Float (float32) weights of a tree with quantized leaves (tests and comparisons)."""
    layers = {name: _dequantize_jit(w) if is_quantized(w) else w for name, w in params["layers"].items()}
    return {**params, "layers": layers}


def tree_bytes(tree) -> int:
    """Bytes of every array of a pytree (whole arrays, all shards together)."""
    return int(sum(np.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)))


def checkpoint_structs(float_shapes: dict, dtype, formats: dict[str, str], sharding=None) -> dict:
    """Abstract arrays (jax.ShapeDtypeStruct) of a checkpoint whose linear leaves named in
    `formats` ({leaf: format name}) are quantized; float leaves in `dtype`."""
    def struct(shape, leaf_dtype):
        return jax.ShapeDtypeStruct(shape, leaf_dtype, sharding=sharding)

    tree = {k: struct(v, dtype) for k, v in float_shapes.items() if k != "layers"}
    layers = {}
    for name, shape in float_shapes["layers"].items():
        if name in formats:
            fmt = parse_format(formats[name], stored=True)
            dtypes = quantized_dtypes(fmt)
            layers[name] = {k: struct(s, dtypes[k]) for k, s in quantized_shapes(shape, fmt, name).items()}
        else:
            layers[name] = struct(shape, dtype)
    tree["layers"] = layers
    return tree
