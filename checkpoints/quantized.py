"""Quantized checkpoints: linear layers stored as int8 / int4 (see jaxserve.quantization).

Conversion quantizes each layer's tensor as it streams in. GGUF Q8_0, Q4_0 and Q4_1 tensors are
copied block for block, with no float round trip: a block is 32 inputs of one output row with a
float16 scale, so Q8_0 -> int8 groups of 32, Q4_0 -> symmetric int4 groups of 32 (code - 8),
Q4_1 -> int4 groups of 32 with a zero point (the block's minimum). This happens for a leaf whose
every layer has that one type and when the requested format has the same bits and a group size
of 32 (or none, for int8); any other leaf is dequantized and quantized in the requested format.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from checkpoints import ConversionError
from checkpoints.layout import ParamBuffers
from jaxserve import quantization as qz
from jaxserve.config import ModelConfig

BLOCK_SIZE = 32
# GGML type name -> (format its blocks map to, bytes of float16 header: scale [+ minimum])
DIRECT_KINDS = {"Q8_0": (qz.QuantFormat(8, 32), 2), "Q4_0": (qz.QuantFormat(4, 32), 2),
                "Q4_1": (qz.QuantFormat(4, 32, zero_point=True), 4)}


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

    def to_weight(self) -> dict[str, np.ndarray]:
        """The quantized weight for `x @ W`: q [in, out] (int4: [in // 2, out]), scale/zero [blocks, out]."""
        fmt, header = DIRECT_KINDS[self.kind]
        rows, num_blocks, _ = self.data.shape
        scale = np.ascontiguousarray(self.data[:, :, :2]).view(np.float16)[..., 0]  # [rows, blocks]
        codes = self.data[:, :, header:]  # Q8_0: int8 [rows, blocks, 32]; Q4: packed [rows, blocks, 16]
        if fmt.bits == 8:
            codes = codes.view(np.int8)
        weight = {"q": codes.reshape(rows, -1).T, "scale": scale.T}
        if fmt.zero_point:
            weight["zero"] = np.ascontiguousarray(self.data[:, :, 2:4]).view(np.float16)[..., 0].T
        return weight


def gguf_blocks(tensor) -> GGUFBlocks:
    """A gguf ReaderTensor of a DIRECT_KINDS type as GGUFBlocks."""
    _, header = DIRECT_KINDS[tensor.tensor_type.name]
    block_bytes = header + (BLOCK_SIZE if tensor.tensor_type.name == "Q8_0" else BLOCK_SIZE // 2)
    data = np.asarray(tensor.data, np.uint8)
    return GGUFBlocks(tensor.tensor_type.name, data.reshape(data.shape[0], -1, block_bytes))


def leaf_formats(source, fmt: qz.QuantFormat) -> tuple[dict[str, qz.QuantFormat], set[str]]:
    """Format of every linear leaf, and the slots ('layers/wq', ...) to copy as GGUF blocks."""
    kinds = source.tensor_kinds() if hasattr(source, "tensor_kinds") else {}
    formats, direct = {}, set()
    for leaf in qz.LINEAR_LEAVES:
        slot_kinds = kinds.get(f"layers/{leaf}", set())
        kind = next(iter(slot_kinds)) if len(slot_kinds) == 1 else None
        mapped = DIRECT_KINDS.get(kind, (None,))[0]
        if mapped is not None and mapped.bits == fmt.bits and fmt.group_size in (None, BLOCK_SIZE):
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
        shapes = config.param_shapes()["layers"]
        for leaf, fmt in formats.items():
            try:
                leaf_shapes = qz.quantized_shapes(shapes[leaf], fmt, leaf)
            except ValueError as e:
                raise ConversionError(f"{source_file}: {e}") from None
            dtypes = qz.quantized_dtypes(fmt)
            self.arrays["layers"][leaf] = {k: np.empty(s, dtypes[k]) for k, s in leaf_shapes.items()}

    def slot_shape(self, name: str, layer: int | None) -> tuple[int, ...]:
        leaf = name.split("/", 1)[-1]
        if name.startswith("layers/") and leaf in self.formats:
            return self.config.param_shapes()["layers"][leaf][1:]
        return super().slot_shape(name, layer)

    def store(self, name: str, layer: int | None, tensor, transpose: bool) -> None:
        leaf = name.split("/", 1)[-1]
        if not (name.startswith("layers/") and leaf in self.formats):
            return super().store(name, layer, tensor, transpose)
        fmt = self.formats[leaf]
        if isinstance(tensor, GGUFBlocks):
            if DIRECT_KINDS[tensor.kind][0] != fmt:
                raise ConversionError(f"{self.source_file}: layer {layer} of {name} is {tensor.kind}, "
                                      f"but the leaf is stored as {fmt.name}")
            weight = tensor.to_weight()
        else:
            value = np.asarray(tensor, np.float32)
            weight = qz.quantize_array(value.T if transpose else value, fmt, leaf)
        for key, array in weight.items():
            self.arrays["layers"][leaf][key][layer] = array
