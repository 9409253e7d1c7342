"""Quantized checkpoints: linear layers and routed experts stored as int8 / int4 (see
jaxserve.models.quantization; an expert's slot 'layers/w_up_exps[3]' is quantized as a matrix of
its own).

Conversion quantizes each layer's tensor as it streams in. GGUF Q8_0, Q4_0 and Q4_1 tensors are
copied block for block, with no float round trip: a block is 32 inputs of one output row with a
float16 scale (Q4_1: and a float16 minimum), so the copy is exact:

    requested   Q8_0          Q4_0                      Q4_1
    int4        -             int4_g32_sym (code - 8)   int4_g32 (zero = the block's minimum)
    int8        int8_g32      int8_g32 (code - 8)       int8_g32_zp (code - 128), when asked with _zp

This happens for a leaf whose every layer has that one type and when the requested format has
those bits and a group size of 32 (or none, for int8). Plain int8 (no zero point) cannot hold a
Q4_1 block, so "int8" from Q4_1 is quantized per output channel from the floats. Any other leaf
is dequantized and quantized in the requested format.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from checkpoints import ConversionError
from checkpoints.layout import ParamBuffers, split_slot
from jaxserve.config import ModelConfig
from jaxserve.models import quantization as qz
from jaxserve.models import weights

BLOCK_SIZE = 32
# GGML type name -> bytes of its float16 block header: scale [+ minimum]
HEADER_BYTES = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4}
# GGML type name -> {bits: the format its blocks copy into exactly}
COPY_FORMATS = {"Q8_0": {8: qz.QuantFormat(8, 32)},
                "Q4_0": {8: qz.QuantFormat(8, 32), 4: qz.QuantFormat(4, 32)},
                "Q4_1": {8: qz.QuantFormat(8, 32, zero_point=True), 4: qz.QuantFormat(4, 32, zero_point=True)}}


@dataclasses.dataclass
class GGUFBlocks:
    """One GGUF tensor kept in its blocks: data uint8 [rows (outputs), blocks per row, block bytes]."""
    kind: str
    data: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:  # [out, in], as the float tensor would be
        return self.data.shape[0], self.data.shape[1] * BLOCK_SIZE

    def with_rows(self, data: np.ndarray) -> "GGUFBlocks":
        return GGUFBlocks(self.kind, data)

    def to_weight(self, bits: int | None = None) -> qz.QuantArray:
        """The quantized weight (numpy arrays) for `x @ W` in COPY_FORMATS[kind][bits] (default:
        the kind's own bits): q [in, out] (int4: [in // 2, out]), scale/zero [blocks, out];
        KeyError if none."""
        fmt = COPY_FORMATS[self.kind][bits or (8 if self.kind == "Q8_0" else 4)]
        rows, num_blocks, _ = self.data.shape
        scale = np.ascontiguousarray(self.data[:, :, :2]).view(np.float16)[..., 0]  # [rows, blocks]
        codes = self.data[:, :, HEADER_BYTES[self.kind]:]  # Q8_0: int8 [rows, blocks, 32]; Q4: packed [.., 16]
        if self.kind == "Q8_0":
            codes = codes.view(np.int8)
        elif fmt.bits == 8:  # 4-bit codes u (low nibbles: inputs 0-15, high: 16-31) as int8 levels
            u = np.concatenate([codes & 0xF, codes >> 4], axis=-1).astype(np.int16)
            codes = (u - (qz.INT8_ZERO_OFFSET if fmt.zero_point else 8)).astype(np.int8)
        zero = np.ascontiguousarray(self.data[:, :, 2:4]).view(np.float16)[..., 0].T if fmt.zero_point else None
        return qz.QuantArray(codes.reshape(rows, -1).T, scale.T, zero)


def gguf_block_bytes(tensor) -> int:
    """Bytes of one block of a gguf ReaderTensor of a COPY_FORMATS type: header and codes."""
    kind = tensor.tensor_type.name
    return HEADER_BYTES[kind] + (BLOCK_SIZE if kind == "Q8_0" else BLOCK_SIZE // 2)


def gguf_blocks(tensor) -> GGUFBlocks:
    """A gguf ReaderTensor of a COPY_FORMATS type as GGUFBlocks."""
    data = np.asarray(tensor.data, np.uint8)
    return GGUFBlocks(tensor.tensor_type.name, data.reshape(data.shape[0], -1, gguf_block_bytes(tensor)))


def copy_format(kind: str | None, fmt: qz.QuantFormat) -> qz.QuantFormat | None:
    """The format blocks of GGML type `kind` copy into when `fmt` is requested (None: no copy)."""
    mapped = COPY_FORMATS.get(kind, {}).get(fmt.bits)
    if mapped is None or fmt.group_size not in (None, BLOCK_SIZE):
        return None
    if fmt.bits == 8 and mapped.zero_point and not fmt.zero_point:
        return None  # Q4_1 needs a zero point: plain int8 is quantized from the floats
    return mapped


def leaf_formats(source, fmt: qz.QuantFormat) -> tuple[dict[str, qz.QuantFormat], set[str]]:
    """Format of every linear leaf, and the slots ('layers/wq', ...) to copy as GGUF blocks."""
    kinds = source.tensor_kinds() if hasattr(source, "tensor_kinds") else {}
    formats, direct = {}, set()
    for leaf in weights.quantizable_leaves(source.config):
        slot_kinds = kinds.get(f"layers/{leaf}", set())
        kind = next(iter(slot_kinds)) if len(slot_kinds) == 1 else None
        mapped = copy_format(kind, fmt)
        if mapped is not None:
            formats[leaf] = mapped
            direct.add(f"layers/{leaf}")
        else:
            formats[leaf] = fmt
    return formats, direct


class QuantizedParamBuffers(ParamBuffers):
    """ParamBuffers whose linear leaves are stored quantized, one layer at a time."""

    def __init__(self, config: ModelConfig, dtype: np.dtype, source_file: str,
                 formats: dict[str, qz.QuantFormat]):
        super().__init__(config, dtype, source_file)
        self.formats = formats
        shapes = weights.param_shapes(config)["layers"]
        self._layer_shapes = shapes
        for leaf, fmt in formats.items():
            try:
                leaf_shapes = qz.quantized_shapes(shapes[leaf], fmt, leaf)
            except ValueError as e:
                raise ConversionError(f"{source_file}: {e}") from None
            dtypes = qz.quantized_dtypes(fmt)
            self.arrays["layers"][leaf] = {k: np.empty(s, dtypes[k]) for k, s in leaf_shapes.items()}

    def _quantized_leaf(self, name: str) -> tuple[str | None, int | None]:
        """(leaf, expert) of a slot of a quantized leaf ('layers/wq', 'layers/w_up_exps[3]'); leaf None otherwise."""
        path, expert = split_slot(name)
        leaf = path.split("/", 1)[-1]
        return (leaf if path.startswith("layers/") and leaf in self.formats else None), expert

    def slot_shape(self, name: str, layer: int | None) -> tuple[int, ...]:
        leaf, expert = self._quantized_leaf(name)
        if leaf is not None:
            return self._layer_shapes[leaf][1:] if expert is None else self._layer_shapes[leaf][2:]
        return super().slot_shape(name, layer)

    def store(self, name: str, layer: int | None, tensor, transpose: bool) -> None:
        leaf, expert = self._quantized_leaf(name)
        if leaf is None:
            return super().store(name, layer, tensor, transpose)
        fmt = self.formats[leaf]
        if isinstance(tensor, GGUFBlocks):
            if COPY_FORMATS[tensor.kind].get(fmt.bits) != fmt:
                raise ConversionError(f"{self.source_file}: layer {layer} of {name} is {tensor.kind}, "
                                      f"but the leaf is stored as {fmt.name}")
            weight = tensor.to_weight(fmt.bits)
        elif hasattr(tensor, "to_weight"):  # checkpoints.prequantized.PublishedWeight: its own codes
            weight = tensor.to_weight(fmt)
        else:
            value = np.asarray(tensor, np.float32)
            weight = qz.quantize_array(value.T if transpose else value, fmt, leaf)
        index = self.row(name, layer) if expert is None else (self.row(name, layer), expert)
        for key, array in weight.stored().items():  # the checkpoint's dict of the leaf's arrays
            self.arrays["layers"][leaf][key][index] = array
