"""Minimal memory-mapped reader of one `.safetensors` file (bfloat16 included, no framework)."""
from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

from checkpoints import ConversionError

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    # the codes, zero points and shapes of quantized checkpoints (checkpoints.prequantized)
    "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "I16": np.dtype(np.int16), "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsFile:
    """Tensor names, shapes and lazily mapped data of one safetensors file."""

    def __init__(self, path: str):
        self.path = path
        try:
            file_size = os.path.getsize(path)
            with open(path, "rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise ConversionError(f"{path}: truncated safetensors file (no header)")
                (header_size,) = struct.unpack("<Q", prefix)
                if header_size > min(_MAX_HEADER_BYTES, file_size - 8):
                    raise ConversionError(f"{path}: truncated or corrupt safetensors header")
                header = json.loads(f.read(header_size))
        except OSError as e:
            raise ConversionError(f"{path}: cannot read ({e.strerror or e})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConversionError(f"{path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise ConversionError(f"{path}: corrupt safetensors header")
        header.pop("__metadata__", None)
        self._data_start = 8 + header_size
        self._entries = header
        for name, entry in header.items():
            try:
                begin, end = entry["data_offsets"]
                shape, dtype = tuple(entry["shape"]), entry["dtype"]
            except (KeyError, TypeError, ValueError):
                raise ConversionError(f"{path}: corrupt header entry for tensor {name!r}") from None
            if self._data_start + end > file_size:
                raise ConversionError(
                    f"{path}: truncated file: tensor {name!r} ends at byte {self._data_start + end}, "
                    f"file has {file_size}")
            if dtype in _DTYPES and end - begin != int(np.prod(shape)) * _DTYPES[dtype].itemsize:
                raise ConversionError(f"{path}: tensor {name!r} byte size does not match shape {shape}")

    def names(self) -> list[str]:
        return list(self._entries)

    def dtype(self, name: str) -> np.dtype:
        kind = self._entries[name]["dtype"]
        if kind not in _DTYPES:
            raise ConversionError(
                f"{self.path}: tensor {name!r} has dtype {kind}; supported: {', '.join(_DTYPES)}")
        return _DTYPES[kind]

    def raw_dtype(self, name: str) -> str:
        """The safetensors dtype name ("F32", "I32", "F8_E4M3", ...), supported or not."""
        return self._entries[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def read(self, name: str) -> np.ndarray:
        """The tensor as a read-only memory map (no copy until used)."""
        dtype, shape = self.dtype(name), self.shape(name)
        begin, _ = self._entries[name]["data_offsets"]
        if int(np.prod(shape)) == 0:
            return np.zeros(shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=self._data_start + begin, shape=shape)
