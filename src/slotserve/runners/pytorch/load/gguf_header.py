"""A GGUF file's header — its key/value metadata and its tensor table — read in one pass over
the file's memory map, as plain Python values and numpy views of the tensors' bytes.

``gguf.GGUFReader`` builds a numpy view for every item of every array, and a vocabulary's
tokens and merges are hundreds of thousands of items: seconds for each open, once to choose
the runner, once to size its memory and once more to load. This reader walks the same bytes
with ``struct`` and decodes a string array only when its values are asked for; the tensors'
data are the same views ``gguf``'s reader gives, which its ``quants`` module dequantizes."""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from gguf.constants import GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# A scalar value type → its struct code.
_SCALARS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
# The element types a tensor's data is read as; every other type is blocks of bytes.
_TENSOR_DTYPES = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: GGMLQuantizationType
    # ggml's order, as the file lists it: the length of a row first.
    shape: tuple[int, ...]
    # numpy's order (rows first); a quantized type's rows are their blocks' bytes.
    data: np.ndarray


class _Strings:
    """An array of strings, decoded at the first look: (offset, length) of each item."""

    def __init__(self, buffer: memoryview, spans: list[tuple[int, int]]) -> None:
        self._buffer = buffer
        self._spans = spans
        self._values: list[str] | None = None

    def __len__(self) -> int:
        return len(self._spans)

    def values(self) -> list[str]:
        if self._values is None:
            data = self._buffer
            self._values = [
                bytes(data[start : start + size]).decode("utf-8", errors="replace")
                for start, size in self._spans
            ]
        return self._values


class GgufHeader:
    """Raises ``ValueError`` for a file that is not GGUF or whose header is cut short."""

    def __init__(self, path: Path) -> None:
        self.path = path
        raw = np.memmap(path, mode="r")
        # A plain view: slicing numpy's memmap subclass costs several times a plain array's.
        self._bytes = raw.view(np.ndarray)
        self._buffer = self._bytes.data.cast("B")
        if bytes(self._buffer[:4]) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        self._order: Literal["<", ">"] = "<"
        (version,) = struct.unpack_from("<I", self._buffer, 4)
        if version & 0xFFFF == 0:  # written on a big-endian machine
            self._order = ">"
            (version,) = struct.unpack_from(">I", self._buffer, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is too old (2 or later is read)")
        try:
            tensor_count, field_count = self._unpack("QQ", 8)
            offset = 24
            self._fields: dict[str, Any] = {}
            for _ in range(field_count):
                key, offset = self._string(offset)
                (value_type,) = self._unpack("I", offset)
                self._fields[key], offset = self._value(GGUFValueType(value_type), offset + 4)
            infos = []
            for _ in range(tensor_count):
                name, offset = self._string(offset)
                (dims,) = self._unpack("I", offset)
                shape = self._unpack("Q" * dims, offset + 4)
                offset += 4 + 8 * dims
                kind, start = self._unpack("IQ", offset)
                offset += 12
                infos.append((name, tuple(int(d) for d in shape), kind, int(start)))
        except (struct.error, ValueError) as exc:
            raise ValueError(f"{path}: the GGUF header is cut short or damaged ({exc})") from None
        alignment = int(self._fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-offset // alignment) * alignment
        self.tensors = [self._tensor(*info, data_start) for info in infos]

    @property
    def fields(self) -> Mapping[str, Any]:
        """Each key's value: a number, a bool, a string, or a list of them."""
        return _FieldValues(self._fields)

    def array_length(self, key: str) -> int | None:
        """How many items the array ``key`` holds, without decoding them; None when absent."""
        value = self._fields.get(key)
        return None if value is None else len(value)

    def _unpack(self, codes: str, offset: int) -> tuple[Any, ...]:
        return struct.unpack_from(self._order + codes, self._buffer, offset)

    def _string(self, offset: int) -> tuple[str, int]:
        (size,) = self._unpack("Q", offset)
        start = offset + 8
        text = bytes(self._buffer[start : start + size]).decode("utf-8", errors="replace")
        return text, start + size

    def _value(self, value_type: GGUFValueType, offset: int) -> tuple[Any, int]:
        if value_type == GGUFValueType.STRING:
            return self._string(offset)
        if value_type in _SCALARS:
            code = _SCALARS[value_type]
            return self._unpack(code, offset)[0], offset + struct.calcsize(code)
        if value_type != GGUFValueType.ARRAY:
            raise ValueError(f"unknown GGUF value type {value_type}")
        item_type, count = self._unpack("IQ", offset)
        offset += 12
        item_type = GGUFValueType(item_type)
        if item_type in _SCALARS:
            code = _SCALARS[item_type]
            dtype = np.dtype(code).newbyteorder(self._order)
            values = np.frombuffer(self._bytes, dtype, count, offset)
            return values.tolist(), offset + dtype.itemsize * count
        if item_type == GGUFValueType.STRING:
            return self._string_array(count, offset)
        items = []
        for _ in range(count):  # arrays of arrays: rare and small
            item, offset = self._value(item_type, offset)
            items.append(item)
        return items, offset

    def _string_array(self, count: int, offset: int) -> tuple[_Strings, int]:
        unpack = struct.Struct(self._order + "Q").unpack_from
        buffer, spans = self._buffer, []
        for _ in range(count):
            (size,) = unpack(buffer, offset)
            spans.append((offset + 8, size))
            offset += 8 + size
        if offset > len(buffer):
            raise ValueError("a string array runs past the end of the file")
        return _Strings(buffer, spans), offset

    def _tensor(
        self, name: str, shape: tuple[int, ...], kind: int, start: int, data_start: int
    ) -> GgufTensor:
        tensor_type = GGMLQuantizationType(kind)
        rows_first = tuple(reversed(shape))
        dtype = _TENSOR_DTYPES.get(tensor_type)
        if dtype is None:  # raises ValueError for a row that is not whole blocks
            rows_first = quant_shape_to_byte_shape(rows_first, tensor_type)
            dtype = np.uint8
        item = np.dtype(dtype).newbyteorder(self._order)
        count = int(np.prod(rows_first))
        begin = data_start + start
        if begin + count * item.itemsize > len(self._bytes):
            raise ValueError(f"{self.path}: tensor {name} runs past the end of the file")
        data = self._bytes[begin : begin + count * item.itemsize].view(item).reshape(rows_first)
        return GgufTensor(name, tensor_type, shape, data)


class _FieldValues(Mapping[str, Any]):
    """The fields with their string arrays decoded as they are read."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self._fields = fields

    def __getitem__(self, key: str) -> Any:
        value = self._fields[key]
        return value.values() if isinstance(value, _Strings) else value

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)
