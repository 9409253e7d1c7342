"""Weight-only quantization of the decoder's linear layers (int8 and int4), and `linear`.

A quantized weight replaces one stacked float leaf `[L, in, out]` with a `QuantArray`, a pytree
(jax.tree_util) of a few arrays, so the layer scan still slices it layer by layer, and `linear`
multiplies by it as by the float array (the one matmul entry point of the model):

    int8:  q     int8   [L, in, out]          w = q * scale
           with a zero point:     w = (q + 128) * scale + zero      (zero = the group's minimum)
    int4:  q     uint8  [L, in // 2, out]     two 4-bit codes u in [0, 15] per byte
           (in each group of g inputs, byte j holds input j in its low nibble and input j + g/2 in
           its high nibble: the GGUF Q4 block order, so Q4_0 / Q4_1 blocks copy over unchanged)
           symmetric:             w = (u - 8) * scale
           with a zero point:     w = u * scale + zero      (zero = the group's minimum, as Q4_1)
    scale, zero: float16 [L, groups, out]; groups = in // group_size, or 1 (per output channel).

A mixture-of-experts model's routed experts [L, E, in, out] quantize the same way with one more
leading axis (q [L, E, in, out], scale [L, E, groups, out], ...): every expert's matrix has its
own scales, and the grouped matmul multiplies one expert's slice at a time (jaxserve.models.moe).

Published checkpoints (compressed-tensors, GPTQ, AWQ; checkpoints/prequantized.py) keep their
own numbers, which adds a few stored-only variants (not choices of --quantization):

    _izp   integer zero point (uint8 for int4, int8 for int8) [L, groups, out]:
           w = (u - zero) * scale (int4),  w = (q - zero) * scale (int8)
    _actorder  perm int32 [L, in]: the rows are stored in the order perm gives the inputs
           (GPTQ act-order, sorted by group), and `linear` gathers x[..., perm] first
    fp8    q float8_e4m3fn [L, in, out], scale [L, 1, out]: w = q * scale (also --quantization=fp8,
           float16 scales: max |w| / 448 per output channel)
    _bf16, _f32  the scales' (and a float zero's) dtype, when not float16

(`dequantize` gives the rows in their stored order.) The format is self-describing (dtype of q,
scale and zero, shapes of scale, presence of zero and perm), so `linear` needs no side
information. Format names: "int8" (per output channel), "int8_g32|64|128" (groups along the
input), "_zp" for int8 with a zero point (e.g. "int8_g32_zp": the 16 levels of a GGUF Q4_1
block are 16 of its codes, so those blocks copy over exactly), "int4" = "int4_g32" (zero
point), "int4_g64|128", and "_sym" for symmetric int4. Embeddings, lm_head, norms and biases stay float
(`quantize_embedding`: the embedding in int8 rows, a `QuantEmbedding`, and lm_head in int8, an option).

On disk (orbax) a quantized leaf is the dict of its stored arrays by name (`QuantArray.stored`);
`to_stored` / `from_stored` convert a parameter tree at the save and restore boundary.

The CPU step adds layouts of the same numbers beside the stored one (jaxserve.models.cpu_layout
builds them; `linear` reads them): `TransposedLayout` (one-row products) and `KernelLayout`
(the C++ kernel's).
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
from jaxserve.models import prompt_matmul, weights

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
                         f"symmetric int4), e.g. int4_g64; or fp8 (float8 e4m3, per output channel)")
    if not stored and (suffix == "_izp" or match["act_order"] or match["scale_dtype"]):
        raise ValueError(f"unknown quantization {name!r}: a format published quantized checkpoints are "
                         f"stored in, not one to quantize into; use int8, int4 (e.g. int4_g64, int8_g32_zp) or fp8")
    scale_dtype = {v: k for k, v in _SCALE_SUFFIXES.items()}[match["scale_dtype"] or ""]
    if match["fp8"]:
        return QuantFormat(8, None, float8=True, scale_dtype=scale_dtype)
    bits = int(match["bits"])
    return QuantFormat(bits, group if bits == 8 else group or 32,
                       zero_point=suffix in ("_zp", "_izp") or (bits == 4 and suffix is None),
                       integer_zero=suffix == "_izp", act_order=bool(match["act_order"]), scale_dtype=scale_dtype)


# ---- the quantized weight types ------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TransposedLayout:
    """A quantized weight's numbers laid out for a one-row product on XLA:CPU (built by
    jaxserve.models.cpu_layout.transposed; `linear` reads it for a single row)."""
    q: Any  # [..., out, in] int8 / fp8 codes, or int4 codes unpacked to one uint8 each
    scale: Any  # [..., out, groups] float32
    zero: Any = None  # [..., out, groups]: float32, or the integer codes of an integer zero


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KernelLayout:
    """A quantized weight's levels, scales and zeros in the CPU kernel's layout (built by
    jaxserve.models.cpu_layout.with_kernel_layout; cpu_kernels.pack and pack_groups)."""
    packed: Any  # uint8 [..., S, K / 4, STRIP, 4] (int8 levels) or [..., S, K / 8, STRIP, 4] (int4)
    scale: Any  # float16 [..., S, groups, STRIP]
    zero: Any = None  # float16 [..., S, groups, STRIP]
    layer: Any = None  # int32 scalar: the layer of a stacked layout the kernel reads (set in the step)
    # What a prompt chunk (more rows than the kernel's) multiplies in: float32, bfloat16 or int8
    # (EngineConfig.cpu_prompt_dtype, decided by cpu_layout.layer_views; see prompt_matmul).
    prompt_dtype: str = dataclasses.field(default="float32", metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantArray:
    """A quantized `[..., in, out]` weight (the module doc gives the formats). Its stored arrays
    are q, scale, zero and perm; the CPU step may add `transposed` and `kernel` layouts of them."""
    q: Any  # [..., in, out] int8 / fp8 codes, or [..., in // 2, out] uint8 (two int4 codes a byte)
    scale: Any  # [..., groups, out]
    zero: Any = None  # [..., groups, out]: float (the group's minimum) or integer codes
    perm: Any = None  # int32 [..., in]: act-order, the inputs' order of the stored rows
    transposed: TransposedLayout | None = None
    kernel: KernelLayout | None = None
    # On an accelerator, what prompt chunks' activations are quantized to for this weight's matmul
    # ("int8" / "fp8": EngineConfig.gpu_prompt_dtype, set by prompt_activations.mark; "": none).
    prompt_activations: str = dataclasses.field(default="", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the float weight it stands for: [..., in, out]."""
        *lead, rows, out = self.q.shape
        return (*lead, rows * 2 if self.q.dtype == jnp.uint8 else rows, out)

    def stored(self) -> dict[str, Any]:
        """The stored arrays by name, as a checkpoint holds them (without the CPU layouts)."""
        names = ("q", "scale", "zero", "perm")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StripMatrix:
    """A float weight [..., in, out] as the CPU step reads it (jaxserve.models.cpu_layout), in
    the C++ kernel's strips of output columns (cpu_kernels, strip_matmul.cc):
    * bfloat16: the stored layout too, which prompt chunks multiply (prompt_matmul.bfloat16_linear),
      and the strips (cpu_kernels.pack_bf16) for up to cpu_kernels.MAX_ROWS float32 rows; an
      lm_head tied to the embedding has the strips only (w None: prompt rows unpack them);
    * float32: the strips only (cpu_kernels.pack_f32), which every row count multiplies in the
      kernel (w None; the stored layout is not kept)."""
    w: Any  # bfloat16 [..., in, out] as its uint16 bits (cpu_layout.bits_of; `matrix` reads it), or None
    kernel: KernelLayout  # packed: bfloat16 or float32 [..., S, in, STRIP]; scale None; layer as KernelLayout's
    out_features: int = dataclasses.field(metadata=dict(static=True), default=0)

    @property
    def matrix(self):
        """The stored bfloat16 weight [..., in, out] (None without one)."""
        if self.w is None or self.w.dtype != jnp.uint16:
            return self.w
        return jax.lax.bitcast_convert_type(self.w, jnp.bfloat16)

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's [..., in, out]."""
        if self.w is not None:
            return self.w.shape
        return (*self.kernel.packed.shape[:-3], self.kernel.packed.shape[-2], self.out_features)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantEmbedding:
    """A token embedding in int8 rows (`quantize_embedding`): w[v] = q[v] * scale[v]."""
    q: Any  # int8 [V, D]
    scale: Any  # float32 [V, 1]
    kernel: KernelLayout | None = None  # the tied lm_head [D, V] in the CPU kernel's layout


def to_stored(params: dict) -> dict:
    """`params` with every QuantArray of its layers as the dict a checkpoint stores."""
    layers = {name: w.stored() if isinstance(w, QuantArray) else w for name, w in params["layers"].items()}
    return {**params, "layers": layers}


def from_stored(params: dict) -> dict:
    """`params` as a checkpoint stores them (quantized layers as dicts of arrays by name) with
    QuantArrays in place of the dicts."""
    layers = {name: QuantArray(**w) if isinstance(w, dict) else w for name, w in params["layers"].items()}
    return {**params, "layers": layers}


def weight_format(weight: QuantArray) -> QuantFormat:
    """The format a quantized weight is stored in, read from its arrays."""
    bits = 4 if weight.q.dtype == jnp.uint8 else 8
    in_features = weight.shape[-2]
    groups = weight.scale.shape[-2]
    group = None if groups == 1 and bits == 8 else in_features // groups
    zero = weight.zero
    return QuantFormat(bits, group, zero_point=zero is not None,
                       integer_zero=zero is not None and jnp.issubdtype(zero.dtype, jnp.integer),
                       act_order=weight.perm is not None, float8=weight.q.dtype == jnp.float8_e4m3fn,
                       scale_dtype=jnp.dtype(weight.scale.dtype).name)


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


def int4_halves(weight: QuantArray) -> tuple[jax.Array, jax.Array]:
    """Float32 values of a packed int4 weight: (first, second) half of every input group, each
    [..., groups, group_size // 2, out], straight from the low and high nibbles."""
    q, scale, zero = weight.q, weight.scale.astype(jnp.float32)[..., None, :], weight.zero  # scale: [..., G, 1, out]
    *lead, rows, out = q.shape
    num_groups = scale.shape[-3]
    packed = q.reshape(*lead, num_groups, rows // num_groups, out)
    halves = []
    for codes in (packed & 0xF, packed >> 4):
        codes = codes.astype(jnp.float32)
        if zero is not None and jnp.issubdtype(zero.dtype, jnp.integer):  # (u - zero) * scale
            halves.append((codes - zero.astype(jnp.float32)[..., None, :]) * scale)
        elif zero is not None:
            halves.append(codes * scale + zero.astype(jnp.float32)[..., None, :])
        else:
            halves.append((codes - 8.0) * scale)
    return halves[0], halves[1]


def quantize(weight: jax.Array, fmt: QuantFormat, name: str = "weight") -> QuantArray:
    """A float `[..., in, out]` weight -> its QuantArray (round to nearest, float16 scales)."""
    shapes = quantized_shapes(weight.shape, fmt, name)
    *lead, in_features, out = weight.shape
    num_groups = shapes["scale"][-2]
    w = jnp.asarray(weight, jnp.float32).reshape(*lead, num_groups, in_features // num_groups, out)
    if fmt.float8:  # w / scale in [-448, 448], rounded to e4m3 (3 significant bits)
        scale = _to_scale(jnp.max(jnp.abs(w), axis=-2) / prompt_matmul.FP8_MAX)
        codes = jnp.clip(w / _safe(scale), -prompt_matmul.FP8_MAX, prompt_matmul.FP8_MAX)
        return QuantArray(codes.reshape(*lead, in_features, out).astype(jnp.float8_e4m3fn), scale)
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
        q = codes.astype(jnp.int8)
    else:
        q = pack_int4(codes.astype(jnp.uint8), in_features // num_groups)
    return QuantArray(q, scale, zero if fmt.zero_point else None)


def _to_scale(value: jax.Array) -> jax.Array:
    return jnp.minimum(value, float(jnp.finfo(SCALE_DTYPE).max)).astype(SCALE_DTYPE)


def _safe(scale: jax.Array) -> jax.Array:
    """Scales as float32 [..., groups, 1, out], 1 where a group is all zeros (its codes are 0)."""
    s = scale.astype(jnp.float32)
    return jnp.where(s > 0, s, 1.0)[..., None, :]


def dequantize(weight: QuantArray, dtype=jnp.float32) -> jax.Array:
    """The float `[..., in, out]` weight a QuantArray stands for (computed in float32)."""
    q, zero, num_groups = weight.q, weight.zero, weight.scale.shape[-2]
    scale = weight.scale.astype(jnp.float32)[..., None, :]  # [..., G, 1, out]
    if q.dtype == jnp.uint8:
        values = jnp.concatenate(int4_halves(weight), axis=-2)  # [..., G, g, out]
    else:
        *lead, rows, out = q.shape
        values = q.reshape(*lead, num_groups, rows // num_groups, out).astype(jnp.float32)
        if zero is not None and jnp.issubdtype(zero.dtype, jnp.integer):  # (q - zero) * scale
            values = (values - zero.astype(jnp.float32)[..., None, :])
            values = values * scale
        elif zero is not None:
            values = (values + INT8_ZERO_OFFSET) * scale
            values = values + zero.astype(jnp.float32)[..., None, :]
        else:
            values = values * scale
    *lead, groups, group, out = values.shape
    return values.reshape(*lead, groups * group, out).astype(dtype)


def dequantize_in_input_order(weight: QuantArray, dtype=jnp.float32) -> jax.Array:
    """The float `[..., in, out]` weight with its rows in the inputs' order: `dequantize`, and an
    act-order weight's stored rows put back where its `perm` says (stored row i is input perm[i])."""
    values = dequantize(weight, dtype)
    if weight.perm is None:
        return values
    inverse = jnp.argsort(weight.perm, axis=-1)  # [..., in]: the stored row of each input
    return jnp.take_along_axis(values, inverse[..., None], axis=-2)


def linear(x: jax.Array, weight, out_dtype=None) -> jax.Array:
    """x [..., in] @ weight [in, out] for a float array or a QuantArray (2-D: one layer's slice),
    in x's dtype, or accumulated and returned in `out_dtype`.

    A weight with a `kernel` layout (the CPU step's, see jaxserve.models.cpu_layout) multiplies
    up to cpu_kernels.MAX_ROWS rows in the C++ kernel (cpu_kernels); with its `layer` set (an
    int32 scalar) the kernel layout is stacked on a layer axis and the kernel reads that layer's
    slice of it in place. One row with a `transposed` layout: see cpu_layout.transposed.
    Otherwise the dequantization is elementwise work that XLA fuses into the jitted step. int4
    runs as two dots over the low-nibble and high-nibble halves of every group (the inputs split
    to match), which spares XLA an interleave of the unpacked codes (2.5x faster on CPU, measured)."""
    if isinstance(weight, StripMatrix):
        y = _strip_linear(x, weight)
        return y if out_dtype is None else y.astype(out_dtype)
    if not isinstance(weight, QuantArray):
        return jnp.matmul(x, weight, preferred_element_type=out_dtype)
    y = _quantized_linear(x, weight)
    return y if out_dtype is None else y.astype(out_dtype)


def linear_group(x: jax.Array, weights) -> list[jax.Array]:
    """[linear(x, w) for w in weights] (one input, several projections: a layer's q, k and v), in
    one call of the C++ kernel (cpu_kernels.quantized_matmul_group: x quantized once) where each
    would take it in the same format and layer, else one `linear` each. Same results either way."""
    calls = [_kernel_call(x, w) for w in weights]
    if None in calls or len({(k.packed.dtype, k.packed.shape[-3], k.zero is None, k.scale.shape[-2], offset)
                             for k, offset in calls}) != 1 or any(k.layer is not calls[0][0].layer for k, _ in calls):
        return [linear(x, w) for w in weights]  # (stacked: one layer index, the scan's, for all)
    return cpu_kernels.quantized_matmul_group(x, [(k.packed, k.scale, k.zero, w.q.shape[-1]) for (k, _), w in
                                                  zip(calls, weights)], calls[0][1], layer=calls[0][0].layer)


def _kernel_call(x: jax.Array, weight) -> tuple[KernelLayout, float] | None:
    """(kernel layout, offset_scale) of a weight that `linear` multiplies in the C++ kernel, else None."""
    if not isinstance(weight, QuantArray) or weight.kernel is None:
        return None
    if not (math.prod(x.shape[:-1]) <= cpu_kernels.MAX_ROWS or weight.kernel.prompt_dtype == "int8"):
        return None  # the kernel takes decode rows, and prompt chunks in int8
    int4 = weight.q.dtype == jnp.uint8
    return weight.kernel, 0.0 if weight.zero is not None else (-8.0 if int4 else -float(INT8_ZERO_OFFSET))


def _quantized_linear(x: jax.Array, weight: QuantArray) -> jax.Array:
    """x [..., in] @ a QuantArray [in, out] -> [..., out] in x's dtype (see `linear`)."""
    rows = math.prod(x.shape[:-1])
    kernel_call = _kernel_call(x, weight)
    if kernel_call is not None:  # decode rows, or int8 prompt chunks
        kernel, offset_scale = kernel_call
        return cpu_kernels.quantized_matmul(x, kernel.packed, kernel.scale, kernel.zero, offset_scale,
                                            weight.q.shape[-1], layer=kernel.layer)
    if weight.prompt_activations and rows > cpu_kernels.MAX_ROWS:  # a prompt chunk on an accelerator
        return prompt_matmul.quantized_activations_linear(x, weight.q, weight.scale, weight.prompt_activations)
    prompt_dtype = "float32" if weight.kernel is None else weight.kernel.prompt_dtype  # a prompt chunk on the CPU
    if prompt_dtype == "bfloat16":
        return prompt_matmul.bfloat16_linear(x, dequantize(weight, jnp.bfloat16))
    if weight.perm is not None:  # act-order: the rows are stored in this order of the inputs
        x = jnp.take(x, weight.perm, axis=-1)
    if weight.transposed is not None and rows == 1:  # one row: see cpu_layout.transposed
        return _linear_transposed(x, weight.transposed)
    if weight.q.dtype != jnp.uint8:
        return x @ dequantize(weight, x.dtype)
    first, second = int4_halves(weight)  # [G, g/2, out] each
    num_groups, half, out = first.shape
    lead = x.shape[:-1]
    x_halves = x.reshape(*lead, num_groups, 2, half)
    x_first = x_halves[..., 0, :].reshape(*lead, num_groups * half)
    x_second = x_halves[..., 1, :].reshape(*lead, num_groups * half)
    return (x_first @ first.reshape(num_groups * half, out).astype(x.dtype)
            + x_second @ second.reshape(num_groups * half, out).astype(x.dtype))


def _strip_linear(x: jax.Array, weight: StripMatrix) -> jax.Array:
    """x [..., in] @ a StripMatrix (one layer's: `kernel.layer` set when stacked) -> x's dtype."""
    rows, packed = math.prod(x.shape[:-1]), weight.kernel.packed
    if packed.dtype == jnp.float32:
        return cpu_kernels.f32_matmul(x, packed, weight.out_features, layer=weight.kernel.layer).astype(x.dtype)
    if rows <= cpu_kernels.MAX_ROWS:
        return cpu_kernels.bf16_matmul(x, packed, weight.out_features, layer=weight.kernel.layer).astype(x.dtype)
    w = weight.matrix
    if w is None:  # the kernel's layout back to [in, out] (see cpu_kernels.pack_bf16)
        if weight.kernel.layer is not None:
            packed = jax.lax.dynamic_index_in_dim(packed, weight.kernel.layer, keepdims=False)
        w = cpu_kernels.unpack_bf16(packed, weight.out_features)
    if weight.kernel.prompt_dtype == "float32":
        return x @ w.astype(x.dtype)
    return prompt_matmul.bfloat16_linear(x, w)


def _linear_transposed(x: jax.Array, layout: TransposedLayout) -> jax.Array:
    """x [..., in] @ a weight's transposed layout: x @ (dequantized q).T."""
    q, scale = layout.q, layout.scale.astype(jnp.float32)  # [out, in], [out, G]
    out, in_features = q.shape
    num_groups = scale.shape[-1]
    values = q.reshape(out, num_groups, in_features // num_groups).astype(jnp.float32)
    zero = layout.zero
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
    (a QuantEmbedding, symmetric) and an untied lm_head [D, V] in per-output-channel int8: an
    option next to the linear layers' formats, for a model whose embedding is a large part of its
    bytes (SmolLM2-135M: 113 MiB of 513 in float32, read whole by every step through the tied
    lm_head). Unsharded weights only."""
    params = dict(params)
    params["embed"] = _quantize_rows_jit(params["embed"])
    if "lm_head" in params and not isinstance(params["lm_head"], QuantArray):
        params["lm_head"] = _quantize_jit(params["lm_head"], QuantFormat(8, None), "lm_head")
    return params


@jax.jit
def _quantize_rows_jit(embed) -> QuantEmbedding:
    w = embed.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=-1, keepdims=True) / 127
    q = jnp.clip(jnp.round(w / jnp.where(scale > 0, scale, 1.0)), -127, 127).astype(jnp.int8)
    return QuantEmbedding(q, scale)


def embedding_rows(embed, token_ids: jax.Array, dtype) -> jax.Array:
    """Rows [T, D] of a float embedding [V, D] or a QuantEmbedding at `token_ids` [T]; those
    of a QuantEmbedding (computed in float32) cast to `dtype`."""
    if not isinstance(embed, QuantEmbedding):
        return embed[token_ids].astype(dtype)
    return (embed.q[token_ids].astype(jnp.float32) * embed.scale[token_ids]).astype(dtype)


def embedding_logits(x: jax.Array, embed) -> jax.Array:
    """x [R, D] @ embedding.T -> logits [R, V] float32: the lm_head tied to a float embedding
    [V, D] or a QuantEmbedding.

    Of a QuantEmbedding: with its `kernel` layout (the CPU step's, see cpu_layout), up to
    cpu_kernels.MAX_ROWS rows in the C++ kernel. One row (a decode step of one sequence):
    `x @ q.T` with the conversion fused into XLA:CPU's matrix-vector loop, which reads the int8
    codes once (see cpu_layout.transposed). Several rows: the dequantized float32 embedding would
    be V x D x 4 bytes written and read again, so it is dequantized EMBEDDING_CHUNK_ROWS
    vocabulary rows at a time under a loop, each chunk multiplied while it is in the cache."""
    if not isinstance(embed, QuantEmbedding):
        return jnp.dot(x, embed.T, preferred_element_type=jnp.float32)
    q, scale = embed.q, embed.scale
    x = x.astype(jnp.float32)
    if embed.kernel is not None and x.shape[0] <= cpu_kernels.MAX_ROWS:
        return cpu_kernels.quantized_matmul(x, embed.kernel.packed, embed.kernel.scale, None,
                                            -float(INT8_ZERO_OFFSET), q.shape[0])
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
    """`params` (of `config`'s model) with every float quantizable leaf quantized (on its device,
    one leaf at a time; jaxserve.models.weights.quantizable_leaves: the decoder matrices and the
    routed experts, each expert's [in, out] matrix with its own scales).

    Leaves already quantized are kept when they have the requested number of bits; a different
    number of bits is a ValueError (convert the model again instead)."""
    fmt = parse_format(quantization) if isinstance(quantization, str) else quantization
    layers = dict(params["layers"])
    for name in weights.quantizable_leaves(config):
        weight = layers[name]
        if isinstance(weight, QuantArray):
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


def quantize_array(weight: np.ndarray, fmt: QuantFormat, name: str = "weight") -> QuantArray:
    """`quantize` on the host, numpy in and out (checkpoint conversion, one layer at a time)."""
    with jax.default_device(jax.devices("cpu")[0]):
        return jax.tree.map(np.asarray, _quantize_jit(weight, fmt, name))


def params_formats(params: dict) -> dict[str, str]:
    """{linear leaf name: format name} of the quantized leaves of `params`."""
    return {name: weight_format(w).name for name, w in params["layers"].items() if isinstance(w, QuantArray)}


def dequantize_params(params: dict) -> dict:
    """Float (float32) weights of a tree with quantized leaves (tests and comparisons)."""
    layers = {name: _dequantize_jit(w) if isinstance(w, QuantArray) else w for name, w in params["layers"].items()}
    return {**params, "layers": layers}


def tree_bytes(tree) -> int:
    """Bytes of every array of a pytree (whole arrays, all shards together)."""
    return int(sum(np.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)))


def checkpoint_structs(float_shapes: dict, dtype, formats: dict[str, str], sharding=None) -> dict:
    """Abstract arrays (jax.ShapeDtypeStruct) of a checkpoint whose linear leaves named in
    `formats` ({leaf: format name}) are quantized (QuantArrays of them); float leaves in `dtype`."""
    def struct(shape, leaf_dtype):
        return jax.ShapeDtypeStruct(shape, leaf_dtype, sharding=sharding)

    tree = {k: struct(v, dtype) for k, v in float_shapes.items() if k != "layers"}
    layers = {}
    for name, shape in float_shapes["layers"].items():
        if name in formats:
            fmt = parse_format(formats[name], stored=True)
            dtypes = quantized_dtypes(fmt)
            layers[name] = QuantArray(**{k: struct(s, dtypes[k]) for k, s in quantized_shapes(shape, fmt, name).items()})
        else:
            layers[name] = struct(shape, dtype)
    tree["layers"] = layers
    return tree
