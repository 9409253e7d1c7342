"""Checkpoints published already quantized: compressed-tensors, GPTQ and AWQ, read as stored.

A Hugging Face folder whose config.json has a `quantization_config` is read here: the integer
codes, scales, zero points and groups of every quantized linear layer are carried into jaxserve's
own weight formats (jaxserve.models.quantization) without a float round trip. Every published format is
an integer code u in [0, 2^bits) per weight, a scale and a zero point per (output, group):

    w[o, i] = (u[o, i] - zero[o, g(i)]) * scale[o, g(i)]

and the mapping is exact: the same integers and the same scale bits, computed as (u - zero) * scale
in float32, as the libraries' own dequantization does:

    source                                      stored as (jaxserve format)
    compressed-tensors pack-quantized int4/int8 int4_g{G}_sym / int8[_g{G}] (symmetric),
      (W4A16, W8A16; int32 words, low bits       int4_g{G}_izp / int8[_g{G}]_izp (asymmetric: the
      first, along the input)                    integer zero point kept as an integer)
    compressed-tensors naive-quantized int8     the same, codes copied
    compressed-tensors float8 e4m3 weights      fp8 (per output channel; a per-tensor scale is
                                                 repeated per channel)
    GPTQ qweight/qzeros/scales/g_idx (4, 8 bit) the same int formats; zero = (stored + 1) mod 2^bits
                                                 in the "gptq" (v1) checkpoint format (as AutoGPTQ's
                                                 kernels read it), as stored in gptq_v2
    AWQ GEMM qweight/qzeros/scales (4 bit)      int4_g{G}_izp, AWQ's interleaved nibble order undone

Packing orders differ (the published formats pack 32 / bits codes into an int32 along the input
or, AWQ, along the output in the order 0 2 4 6 1 3 5 7; jaxserve packs two codes per byte in GGUF's
Q4 order within each group): codes are moved, never changed. Scales keep their dtype (the format
name says _bf16 / _f32 when not float16). A group size jaxserve does not have (per channel, 256,
...) is stored in the largest of jaxserve's group sizes (128, 64, 32) that divides it, its scale
and zero repeated: the same numbers. GPTQ act-order (a g_idx that is not i // group_size) puts
inputs of one group far apart; the rows are stored sorted by group (a stable sort, so each group
is contiguous) with the permutation (`perm`), and the matmul gathers its input in that order
(jaxserve.models.quantization.linear): x[perm] @ W[perm] = x @ W exactly.

Layers the checkpoint leaves unquantized (`ignore`, `modules_to_not_convert`, lm_head) stay as
stored. A leaf ("layers/w_down", ...) is stacked over the layers in one format; when its layers
disagree (some quantized, some not; int and fp8; a group size not divisible by 32) it is stored
dequantized to float, exactly (u - zero) * scale rounded once to the conversion dtype.

Mixture-of-experts checkpoints (Mixtral, Qwen3-MoE, Qwen2-MoE) publish every routed expert as
its own linear modules (`mlp.experts.M.gate_proj` ..., Mixtral's `block_sparse_moe.experts.M.w1`
...), each quantized like a dense linear layer: each is read as above and stored at its [layer,
expert] of the expert leaf (w_gate_exps [L, E, D, F] -> q [L, E, D/2, F] in int4, ...), one
format for all its layers and experts. The routers (and Qwen2-MoE's shared-expert gate) are
left float by the published checkpoints (in `ignore`); a quantized one is stored dequantized.

Refused with a ConversionError naming the config field: activation quantization (W8A8, W4A8,
FP8 dynamic: `input_activations`), output activations, a KV-cache scheme, sparsity (2:4),
transforms, block / tensor-group strategies, dynamic weight scales, other bit widths, AWQ other
than GEMM, GPTQ `dynamic` overrides or another checkpoint_format, and any other quant_method.
"""
from __future__ import annotations

import dataclasses
import re

import ml_dtypes
import numpy as np

from checkpoints import ConversionError
from jaxserve.models import quantization as qz
from jaxserve.models import weights as model_weights

METHODS = ("compressed-tensors", "gptq", "awq")
# compressed-tensors formats whose weights this module reads
CT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized", "dense")
_CT_ZERO_POINT_PARTS = ("weight_scale", "weight_zero_point", "weight_g_idx", "weight_global_scale")
# tensor names (after "<module>.") each layout stores, the code tensor first
LAYOUT_PARTS = {
    "ct-packed": ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx"),
    "ct-naive": ("weight", "weight_scale", "weight_zero_point", "weight_g_idx"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
    "awq": ("qweight", "qzeros", "scales"),
}
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of each 8 is nibble AWQ_REVERSE_ORDER[c]


@dataclasses.dataclass(frozen=True)
class WeightScheme:
    """How one module's weight is quantized, from the config."""
    kind: str  # "int" or "float8"
    bits: int
    group_size: int | None  # None: per output channel (or per tensor, strategy "tensor")
    symmetric: bool


class PublishedQuantization:
    """The `quantization_config` of a Hugging Face folder, checked (ConversionError naming the field
    otherwise); `module_weight(module, ...)` gives each module's stored weight."""

    def __init__(self, qconfig: dict, where: str):
        self.where = where
        self.method = qconfig.get("quant_method")
        if self.method not in METHODS:
            raise ConversionError(f"{where}: quantization_config.quant_method {self.method!r} is not supported; "
                                  f"supported: {', '.join(METHODS)}")
        {"compressed-tensors": self._read_ct, "gptq": self._read_gptq, "awq": self._read_awq}[self.method](qconfig)

    def _refuse(self, field: str, value, why: str):
        raise ConversionError(f"{self.where}: quantization_config.{field} = {value!r}: {why}")

    # ---- compressed-tensors (llm-compressor) ---------------------------------------------------

    def _read_ct(self, qc: dict) -> None:
        for field, why in (("sparsity_config", "sparse (e.g. 2:4) checkpoints are not supported"),
                           ("transform_config", "transformed (rotated) checkpoints are not supported"),
                           ("kv_cache_scheme", "a quantized KV cache with stored scales is not supported "
                                               "(jaxserve quantizes the KV cache itself: --kv_cache_dtype)")):
            if qc.get(field):
                self._refuse(field, qc[field], why)
        status = qc.get("quantization_status", "compressed")
        top_format = qc.get("format")
        if status != "compressed" and top_format not in (None, "dense"):
            self._refuse("quantization_status", status, "only compressed checkpoints are supported")
        self.ignore = list(qc.get("ignore") or [])
        self.groups = []
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict) or not groups:
            self._refuse("config_groups", groups, "no quantization groups")
        for name, group in groups.items():
            field = f"config_groups.{name}"
            for act in ("input_activations", "output_activations"):
                if group.get(act):
                    self._refuse(f"{field}.{act}", group[act],
                                 "activation quantization (W8A8, W4A8, FP8 dynamic, ...) is not supported; "
                                 "jaxserve runs weight-only quantized checkpoints (W4A16, W8A16, FP8 weights)")
            fmt = group.get("format") or top_format
            if fmt not in CT_FORMATS:
                self._refuse(f"{field}.format" if group.get("format") else "format", fmt,
                             f"supported compressed-tensors formats: {', '.join(CT_FORMATS)}")
            weights = group.get("weights")
            if not weights:
                self._refuse(f"{field}.weights", weights, "no weight quantization")
            self.groups.append((list(group.get("targets") or []), self._ct_scheme(weights, f"{field}.weights"), fmt))

    def _ct_scheme(self, w: dict, field: str) -> WeightScheme:
        kind, bits = w.get("type", "int"), w.get("num_bits", 8)
        strategy = w.get("strategy")
        if w.get("dynamic"):
            self._refuse(f"{field}.dynamic", w["dynamic"], "dynamic weight scales are not supported")
        if kind == "int" and bits not in (4, 8):
            self._refuse(f"{field}.num_bits", bits, "int weights of 4 or 8 bits are supported")
        if kind == "float" and bits != 8:
            self._refuse(f"{field}.num_bits", bits, "float weights of 8 bits (e4m3) are supported")
        if kind not in ("int", "float"):
            self._refuse(f"{field}.type", kind, "int or float weights are supported")
        if strategy not in ("channel", "group", "tensor"):
            self._refuse(f"{field}.strategy", strategy, "channel, group and tensor strategies are supported")
        if kind == "float" and strategy == "group":
            self._refuse(f"{field}.strategy", strategy, "fp8 weights per channel or per tensor are supported")
        if kind == "float" and not w.get("symmetric", True):
            self._refuse(f"{field}.symmetric", False, "asymmetric fp8 weights are not supported")
        for dtype_field in ("scale_dtype", "zp_dtype"):
            if w.get(dtype_field) not in (None, "torch.float16", "torch.bfloat16", "torch.float32", "torch.int8"):
                self._refuse(f"{field}.{dtype_field}", w[dtype_field], "not supported")
        group = w.get("group_size") if strategy == "group" else None
        if strategy == "group" and (not isinstance(group, int) or group <= 0):
            self._refuse(f"{field}.group_size", group, "a positive group size is required")
        return WeightScheme("float8" if kind == "float" else "int", bits, group, bool(w.get("symmetric", True)))

    def _ct_match(self, module: str, is_linear: bool):
        """(scheme, format) of the config group that targets `module` (None when ignored or none)."""
        if any(_ct_target_matches(t, module, is_linear) for t in self.ignore):
            return None
        best = None
        for targets, scheme, fmt in self.groups:
            for target in targets:
                rank = _ct_target_matches(target, module, is_linear)
                if rank and (best is None or rank > best[0]):
                    best = (rank, scheme, fmt)
        return None if best is None else best[1:]

    # ---- GPTQ (AutoGPTQ / GPTQModel / optimum) -------------------------------------------------

    def _read_gptq(self, qc: dict) -> None:
        bits = qc.get("bits", 4)
        if bits not in (4, 8):
            self._refuse("bits", bits, "GPTQ checkpoints of 4 or 8 bits are supported")
        fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
        if fmt not in ("gptq", "gptq_v2"):
            self._refuse("checkpoint_format", fmt, "the gptq and gptq_v2 checkpoint formats are supported")
        if qc.get("dynamic"):
            self._refuse("dynamic", qc["dynamic"], "per-module GPTQ overrides are not supported")
        if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
            self._refuse("pack_dtype", qc["pack_dtype"], "qweight packed in int32 is supported")
        group = qc.get("group_size", 128)
        if not isinstance(group, int) or group == 0 or group < -1:
            self._refuse("group_size", group, "a positive group size or -1 (per channel) is required")
        self.gptq_v1 = fmt == "gptq"
        self.uniform = WeightScheme("int", bits, None if group == -1 else group, bool(qc.get("sym", True)))

    # ---- AWQ (AutoAWQ GEMM) ---------------------------------------------------------------------

    def _read_awq(self, qc: dict) -> None:
        bits = qc.get("bits", qc.get("w_bit", 4))
        if bits != 4:
            self._refuse("bits", bits, "AWQ checkpoints of 4 bits are supported")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            self._refuse("version", qc.get("version"), "AWQ's GEMM layout is supported (not GEMV, Marlin, ExLlama, ...)")
        group = qc.get("group_size", qc.get("q_group_size", 128))
        if not isinstance(group, int) or group == 0 or group < -1:
            self._refuse("group_size", group, "a positive group size or -1 (per channel) is required")
        self.uniform = WeightScheme("int", 4, None if group == -1 else group, not qc.get("zero_point", True))

    # ---- per module ------------------------------------------------------------------------------

    def describe(self) -> str:
        if self.method == "compressed-tensors":
            parts = sorted({f"{fmt} {_scheme_text(s)}" for _, s, fmt in self.groups})
            return f"compressed-tensors ({'; '.join(parts)})"
        return f"{self.method} ({_scheme_text(self.uniform)})"

    def module_weight(self, module: str, is_linear: bool, names: set, owner: dict) -> "PublishedWeight | None":
        """The quantized weight of `module` (the tensors `<module>.*` in `names`), None when it is
        stored as a plain float `weight`. ConversionError when the tensors do not match the config."""
        def has(part):
            return f"{module}.{part}" in names

        if self.method == "compressed-tensors":
            match = self._ct_match(module, is_linear)
            if has("weight_packed"):
                layout = "ct-packed"
            elif has("weight") and has("weight_scale") and owner[f"{module}.weight"].raw_dtype(
                    f"{module}.weight") in ("I8", "F8_E4M3"):
                layout = "ct-naive"
            else:
                return None
            if match is None:
                raise ConversionError(f"{self.where}: {module} is stored quantized, but no config group of "
                                      f"quantization_config.config_groups targets it (or it is in ignore)")
            scheme, fmt = match
            if fmt == "dense":
                raise ConversionError(f"{self.where}: {module} is stored compressed, but its config group's "
                                      f"format is 'dense'")
        else:
            if not has("qweight"):
                return None
            layout, scheme = self.method, self.uniform
        parts = {p: (owner[f"{module}.{p}"], f"{module}.{p}") for p in LAYOUT_PARTS[layout] if has(p)}
        return PublishedWeight(module, layout, scheme, parts, self)

    def aux_parts(self, weight: "PublishedWeight | None") -> tuple[str, ...]:
        """Tensor names (after the module) read with a module's weight, or skipped beside its float
        weight (the scales a dense compressed-tensors checkpoint keeps)."""
        if weight is not None:
            return LAYOUT_PARTS[weight.layout][1:]
        return _CT_ZERO_POINT_PARTS if self.method == "compressed-tensors" else ()


def _scheme_text(s: WeightScheme) -> str:
    kind = "fp8" if s.kind == "float8" else f"int{s.bits}"
    group = f"group {s.group_size}" if s.group_size else "per channel"
    return f"{kind} {group}{'' if s.symmetric else ' asymmetric'}"


def _ct_target_matches(target: str, module: str, is_linear: bool) -> int:
    """How specifically a compressed-tensors target or ignore entry names `module`: 3 its exact
    name, 2 a "re:" pattern (matched from the start, as compressed-tensors does), 1 its class
    (Linear), 0 no match."""
    if target.startswith("re:"):
        return 2 if re.match(target[3:], module) else 0
    if target == module:
        return 3
    return 1 if target == "Linear" and is_linear else 0


@dataclasses.dataclass
class PublishedWeight:
    """One quantized linear weight of a published checkpoint, its tensors read on demand.

    Like a float tensor it has the [out, in] `shape` of the weight; `to_weight(fmt)` gives the
    QuantArray of jaxserve's format, `dequantize()` the float32 values."""
    module: str
    layout: str
    scheme: WeightScheme
    parts: dict  # part name -> (SafetensorsFile, tensor name)
    source: PublishedQuantization

    def _read(self, part: str) -> np.ndarray | None:
        if part not in self.parts:
            return None
        file, name = self.parts[part]
        return np.asarray(file.read(name))

    def _fail(self, why: str):
        raise ConversionError(f"{self.source.where}: {self.module}: {why}")

    # ---- shapes and the per-layer summary (headers, plus g_idx) --------------------------------

    @property
    def shape(self) -> tuple[int, int]:
        """[out, in] of the float weight."""
        if "_shape" not in self.__dict__:
            self.__dict__["_shape"] = self._compute_shape()
        return self.__dict__["_shape"]

    def _compute_shape(self) -> tuple[int, int]:
        bits = self.scheme.bits
        code_file, code_name = self.parts[LAYOUT_PARTS[self.layout][0]]
        packed = code_file.shape(code_name)
        if len(packed) != 2:
            self._fail(f"{code_name} has shape {packed}, expected 2 dimensions")
        if self.layout == "ct-naive":
            return tuple(packed)
        if self.layout == "ct-packed":
            stored = self._read("weight_shape")
            if stored is None or stored.size != 2:
                self._fail("weight_shape is missing or not [out, in]")
            out, inp = (int(v) for v in stored)
            if packed != (out, -(-inp * bits // 32)):
                self._fail(f"weight_packed has shape {packed}, expected {(out, -(-inp * bits // 32))} for "
                           f"weight_shape {(out, inp)} at {bits} bits")
            return out, inp
        if self.layout == "gptq":
            return packed[1], packed[0] * 32 // bits
        return packed[1] * 32 // bits, packed[0]  # awq: qweight [in, out * bits / 32]

    def num_groups(self) -> int:
        file, name = self.parts["scales" if self.layout in ("gptq", "awq") else "weight_scale"]
        shape = file.shape(name)
        if self.layout in ("gptq", "awq"):
            return shape[0]
        return shape[1] if len(shape) == 2 else 1

    def group_size(self) -> int:
        """Inputs per scale (the input size when per channel or per tensor)."""
        groups = self.num_groups()
        if groups <= 0 or self.shape[1] % groups:
            self._fail(f"{groups} scale groups do not divide the input size {self.shape[1]}")
        group = self.shape[1] // groups
        if self.scheme.group_size not in (None, group):
            self._fail(f"its scales give groups of {group} inputs, the config says {self.scheme.group_size}")
        return group

    def scale_dtype(self) -> str:
        file, name = self.parts["scales" if self.layout in ("gptq", "awq") else "weight_scale"]
        dtype = file.dtype(name)
        if dtype.name not in ("float16", "bfloat16", "float32"):
            self._fail(f"{name} has dtype {dtype.name}; float16, bfloat16 or float32 scales are supported")
        return dtype.name

    def act_order(self) -> np.ndarray | None:
        """The inputs' group indices when they are not contiguous groups (GPTQ act-order), else None."""
        g_idx = self._read("weight_g_idx" if self.layout.startswith("ct") else "g_idx")
        if g_idx is None or (g_idx < 0).all():  # older compressed-tensors store -1 when unused
            return None
        groups, group = self.num_groups(), self.group_size()
        g_idx = g_idx.astype(np.int64)
        if g_idx.shape != (self.shape[1],) or g_idx.min() < 0 or g_idx.max() >= groups:
            self._fail(f"g_idx must hold a group in [0, {groups}) for each of the {self.shape[1]} inputs")
        if (g_idx == np.arange(self.shape[1]) // group).all():
            return None
        if (np.bincount(g_idx, minlength=groups) != group).any():
            self._fail(f"g_idx does not give every group {group} inputs")
        return g_idx

    # ---- values ----------------------------------------------------------------------------------

    def codes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(u uint8 [out, in] in [0, 2^bits), scale [out, groups] in its dtype, zero int16 [out,
        groups] or None for symmetric (zero 2^(bits-1))): w = (u - zero) * scale."""
        bits, (out, inp) = self.scheme.bits, self.shape
        mid = 1 << (bits - 1)
        if self.layout == "ct-packed":
            u = _unpack_rows(self._read("weight_packed"), bits, inp)  # [out, in]
            scale = self._read("weight_scale")
            zero = self._read("weight_zero_point")
            if zero is not None:
                if zero.dtype == np.int32:  # packed along the output (dim 0), as the codes' words
                    zero = _unpack_rows(np.ascontiguousarray(zero.T), bits, out).T.astype(np.int16)
                else:  # older versions: signed int8 [out, groups]
                    zero = zero.astype(np.int16) + mid
        elif self.layout == "ct-naive":
            q = self._read("weight")
            if q.dtype != np.int8:
                self._fail(f"weight has dtype {q.dtype}, expected int8")
            u = (q.astype(np.int16) + mid).astype(np.uint8)
            scale, zero = self._read("weight_scale"), self._read("weight_zero_point")
            if zero is not None:
                zero = zero.astype(np.int16) + mid
        elif self.layout == "gptq":
            u = _unpack_rows(np.ascontiguousarray(self._read("qweight").T), bits, inp)  # packed along in
            scale = np.ascontiguousarray(self._read("scales").T)
            qzeros = self._read("qzeros")
            zero = None if qzeros is None else _unpack_rows(qzeros, bits, out).T.astype(np.int16)
            if zero is not None and self.source.gptq_v1:  # the "gptq" (v1) format stores zero - 1 in
                zero = (zero + 1) & ((1 << bits) - 1)     # `bits` bits; AutoGPTQ's kernels add 1 and mask
        else:  # awq: packed along the output, 8 nibbles per int32 in the order 0 2 4 6 1 3 5 7
            order = (np.arange(out).reshape(-1, 8)[:, list(AWQ_REVERSE_ORDER)]).reshape(-1)
            u = np.ascontiguousarray(_unpack_rows(self._read("qweight"), 4, out)[:, order].T)
            scale = np.ascontiguousarray(self._read("scales").T)
            qzeros = self._read("qzeros")
            zero = None if qzeros is None else _unpack_rows(qzeros, 4, out)[:, order].T.astype(np.int16)
        scale = scale.reshape(out, -1) if scale.size != 1 else np.full((out, 1), scale.reshape(()), scale.dtype)
        groups = self.num_groups()
        if scale.shape != (out, groups) or (zero is not None and zero.shape != (out, groups)):
            self._fail(f"scales {scale.shape} / zero points {None if zero is None else zero.shape} do not "
                       f"match {out} outputs in {groups} groups")
        if zero is not None and self.scheme.symmetric:
            if (zero != mid).any():
                self._fail(f"the config says symmetric, but the zero points are not all {mid}")
            zero = None
        return u, scale, zero

    def float8(self) -> tuple[np.ndarray, np.ndarray]:
        """(q float8_e4m3fn [out, in], scale [out, 1]) of an fp8 weight: w = q * scale."""
        q = self._read("weight")
        if q.dtype != ml_dtypes.float8_e4m3fn:
            self._fail(f"weight has dtype {q.dtype}, expected float8_e4m3fn")
        scale = self._read("weight_scale")
        out = q.shape[0]
        if scale.size == 1:
            scale = np.full((out, 1), scale.reshape(()), scale.dtype)
        if scale.shape not in ((out, 1), (out,)):
            self._fail(f"weight_scale has shape {scale.shape}; per-tensor or per-channel fp8 scales are supported")
        return q, scale.reshape(out, 1)

    def dequantize(self) -> np.ndarray:
        """Float32 [out, in]: (u - zero) * scale in float32, as the libraries compute it."""
        if self.scheme.kind == "float8":
            q, scale = self.float8()
            return q.astype(np.float32) * scale.astype(np.float32)
        u, scale, zero = self.codes()
        g = self._group_of_inputs()
        levels = u.astype(np.float32) - (float(1 << (self.scheme.bits - 1)) if zero is None
                                         else zero[:, g].astype(np.float32))
        return levels * scale.astype(np.float32)[:, g]

    def _group_of_inputs(self) -> np.ndarray:
        g_idx = self.act_order()
        return np.arange(self.shape[1]) // self.group_size() if g_idx is None else g_idx

    def to_weight(self, fmt: qz.QuantFormat) -> qz.QuantArray:
        """The weight in `fmt` (numpy arrays; one layer, for x @ W): the same codes, scales and
        zero points."""
        out, inp = self.shape
        if fmt.float8:
            q, scale = self.float8()
            return qz.QuantArray(np.ascontiguousarray(q.T), scale.T.astype(fmt.scale_dtype))
        u, scale, zero = self.codes()
        src_mid = 1 << (self.scheme.bits - 1)
        g_idx = self.act_order()
        perm = np.arange(inp, dtype=np.int32)
        if g_idx is not None:  # rows sorted by group; x is gathered in the same order by `linear`
            if not fmt.act_order:
                self._fail(f"act-order weights need an _actorder format, not {fmt.name}")
            perm = np.argsort(g_idx, kind="stable").astype(np.int32)
            u = u[:, perm]
        group = fmt.group_size or inp
        source_group = self.group_size()
        if source_group % group:
            self._fail(f"its group size {source_group} cannot be stored in {fmt.name}")
        repeat = source_group // group
        scale = np.repeat(scale, repeat, axis=1)
        if zero is not None:
            zero = np.repeat(zero, repeat, axis=1)
        if fmt.bits == 4:
            if self.scheme.bits != 4:
                self._fail(f"{self.scheme.bits}-bit codes cannot be stored in {fmt.name}")
            q = np.asarray(qz.pack_int4(np.ascontiguousarray(u.T), group))
            zero_codes = zero  # levels u, zero in [0, 16]
            zero_dtype = np.uint8
        else:  # int8 q = u - 2^(bits-1): symmetric w = q * scale; zero shifted alike
            q = np.ascontiguousarray((u.astype(np.int16) - src_mid).astype(np.int8).T)
            zero_codes = None if zero is None else zero - src_mid
            zero_dtype = np.int8
        stored_zero = None
        if fmt.zero_point:
            if not fmt.integer_zero:
                self._fail(f"integer zero points cannot be stored in {fmt.name}")
            if zero_codes is None:  # a symmetric layer in an asymmetric leaf: the midpoint
                zero_codes = np.full(scale.shape, src_mid if fmt.bits == 4 else 0, np.int16)
            info = np.iinfo(zero_dtype)
            if zero_codes.min() < info.min or zero_codes.max() > info.max:
                self._fail(f"zero points outside [{info.min}, {info.max}] cannot be stored in {fmt.name}")
            stored_zero = np.ascontiguousarray(zero_codes.T).astype(zero_dtype)
        elif zero is not None:
            self._fail(f"asymmetric weights cannot be stored in the symmetric {fmt.name}")
        return qz.QuantArray(q, np.ascontiguousarray(scale.T).astype(fmt.scale_dtype), stored_zero,
                             perm if fmt.act_order else None)


def _unpack_rows(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """int32 [rows, words] holding `32 // bits` codes each, lowest bits first -> uint8 [rows, count]."""
    data = np.ascontiguousarray(words).astype("<i4", copy=False).view(np.uint8)  # little-endian bytes
    if bits == 4:
        data = np.stack([data & 0xF, data >> 4], axis=-1).reshape(words.shape[0], -1)
    if data.shape[1] < count:
        raise ConversionError(f"packed tensor of shape {words.shape} holds fewer than {count} codes per row")
    return np.ascontiguousarray(data[:, :count])


# ---- one format per stacked leaf ------------------------------------------------------------------

def leaf_format(layer_weights: list) -> qz.QuantFormat | None:
    """The format a stacked leaf is stored in, given its layers' tensors (PublishedWeight or a float
    array); None: float (dequantized), when the layers cannot share one exact format."""
    if not all(isinstance(w, PublishedWeight) for w in layer_weights):
        return None
    kinds = {w.scheme.kind for w in layer_weights}
    dtypes = {w.scale_dtype() for w in layer_weights}
    scale_dtype = dtypes.pop() if len(dtypes) == 1 else "float32"  # float32 holds them all exactly
    if kinds == {"float8"}:
        return qz.QuantFormat(8, None, float8=True, scale_dtype=scale_dtype)
    if kinds != {"int"}:
        return None
    bits = max(w.scheme.bits for w in layer_weights)
    groups = {w.group_size() for w in layer_weights}
    inputs = layer_weights[0].shape[1]
    if bits == 8 and groups == {inputs}:
        group = None
    else:
        fits = [g for g in sorted(qz.GROUP_SIZES, reverse=True) if all(s % g == 0 for s in groups)]
        if not fits:
            return None
        group = fits[0]
    asymmetric = any(not w.scheme.symmetric for w in layer_weights)
    act_order = any(w.act_order() is not None for w in layer_weights)
    return qz.QuantFormat(bits, group, zero_point=asymmetric, integer_zero=asymmetric, act_order=act_order,
                          scale_dtype=scale_dtype)


def leaf_formats(source) -> tuple[dict[str, qz.QuantFormat], list[str]]:
    """For an HFSource of a published quantized checkpoint: {leaf: format} of the linear leaves and
    the routed experts' leaves stored quantized, and those that have quantized layers but are
    stored float (leaf_format). An expert leaf [L, E, in, out] takes one format for the per-expert
    modules of all its layers (`model.layers.N.mlp.experts.M.gate_proj`, ...), each stored like a
    dense linear layer's weight at its [layer, expert]."""
    published = source.published_weights()
    formats, dequantized = {}, []
    for info in model_weights.weight_infos(source.config).values():
        if info.role not in ("linear", "experts"):
            continue
        experts = [info.hf.format(expert=e) for e in range(info.shape[1])] if info.per_expert else [info.hf]
        layers = [published.get(f"model.layers.{i}.{name}") for i in info.stack_layers for name in experts]
        if not any(layers):
            continue
        fmt = leaf_format(layers)
        if fmt is None:
            dequantized.append(info.name)
        else:
            formats[info.name] = fmt
    return formats, dequantized
