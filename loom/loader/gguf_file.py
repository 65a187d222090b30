"""A fast GGUF reader: metadata parsed with `struct`, tensor data as views of one memory map.

The `gguf` package's `GGUFReader` builds a numpy view for every metadata element, which takes
seconds for a 49k-token vocabulary; this reads the same header in tens of milliseconds. Tensor
data is not read: each tensor is a view of a copy-on-write memory map (writable, so torch takes it
without a copy, and the file's pages stay shared). `GGUFReader` stays the reference: tests compare
the two on real files, and files this reader does not handle (byte-swapped, arrays of arrays) go
through it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
# GGUFValueType -> (struct format, numpy dtype), little-endian.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
    5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
# Tensor types GGUFReader exposes as typed elements; every other type is raw bytes per row.
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The bytes are not a well-formed GGUF file (bad magic, truncated, inconsistent offsets)."""


class _Unsupported(Exception):
    """Valid GGUF this reader leaves to `GGUFReader` (byte-swapped files, nested arrays)."""


@dataclass(frozen=True, slots=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # logical, row-major (GGUF lists dimensions innermost first)
    data: np.ndarray  # typed elements for float/int types, else uint8 [..., bytes per row]


_U64 = struct.Struct("<Q")
_LAZY_AT = 1024  # string arrays this long are decoded on first use (a vocabulary, its merges)


class _LazyStrings:
    """A string array's place in the file, decoded when first read: loading a model with its
    tokenizer cached never reads its vocabulary (Gemma 3's 262k tokens: ~0.5 s to decode)."""

    __slots__ = ("buf", "offset", "count")

    def __init__(self, buf: mmap.mmap, offset: int, count: int) -> None:
        self.buf, self.offset, self.count = buf, offset, count

    def items(self) -> Iterator[tuple[int, int]]:
        """(start, end) of each string's bytes."""
        buf, off, unpack = self.buf, self.offset, _U64.unpack_from
        for _ in range(self.count):
            (n,) = unpack(buf, off)
            yield off + 8, off + 8 + n
            off += 8 + n

    def decode(self) -> list[str]:
        view = memoryview(self.buf)
        return [str(view[a:b], "utf-8") for a, b in self.items()]

    def index(self, text: str) -> int | None:
        want = text.encode("utf-8")
        buf = self.buf
        for i, (a, b) in enumerate(self.items()):
            if b - a == len(want) and buf[a:b] == want:
                return i
        return None


class _Fields(dict):
    """The metadata dict; long string arrays (_LazyStrings) are decoded on first access."""

    def __getitem__(self, key: str) -> Any:
        value = super().__getitem__(key)
        if isinstance(value, _LazyStrings):
            value = value.decode()
            super().__setitem__(key, value)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def values(self) -> list[Any]:  # type: ignore[override]
        return [self[k] for k in self]

    def items(self) -> list[tuple[str, Any]]:  # type: ignore[override]
        return [(k, self[k]) for k in self]

    def __eq__(self, other: object) -> bool:
        return dict(self.items()) == other

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class GGUFFile:
    """Decoded metadata (`fields`, values as GGUFReader's `contents()` gives them) and tensors."""

    path: Path
    fields: dict[str, Any]
    tensors: list[GGUFTensor]

    def get(self, key: str, default: Any = None) -> Any:
        value = self.fields.get(key)
        return default if value is None else value

    def count(self, key: str) -> int:
        """How many items array `key` holds (0 where absent), without decoding its strings."""
        value = dict.get(self.fields, key)
        return value.count if isinstance(value, _LazyStrings) else len(value or ())

    def string_index(self, key: str, text: str) -> int | None:
        """The index of `text` in string array `key` (None: not there), without decoding it."""
        value = dict.get(self.fields, key)
        if isinstance(value, _LazyStrings):
            return value.index(text)
        return value.index(text) if value and text in value else None


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header; tensor data stays memory-mapped. Raises GGUFFormatError."""
    path = Path(path)
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except ValueError as e:  # an empty file cannot be mapped
            raise GGUFFormatError(f"{path}: {e}") from None
    try:
        return _Parser(path, buf).parse()
    except _Unsupported:
        return _from_gguf_reader(path)
    except (struct.error, UnicodeDecodeError, ValueError) as e:
        raise GGUFFormatError(f"{path}: {e}") from None


class _Parser:
    def __init__(self, path: Path, buf: mmap.mmap) -> None:
        self.path = path
        self.buf = buf
        self.size = len(buf)
        self.offset = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.offset)
        start = self.offset + 8
        if start + n > self.size:
            raise GGUFFormatError(f"string of {n} bytes at offset {self.offset} runs past the end")
        self.offset = start + n
        return self.buf[start : start + n].decode("utf-8")

    def skip_strings(self, count: int) -> _LazyStrings:
        """Step over `count` strings (their lengths checked), to be decoded when read."""
        buf, off, unpack, size = self.buf, self.offset, _U64.unpack_from, self.size
        start = off
        for _ in range(count):
            if off + 8 > size:
                raise GGUFFormatError(f"string array at offset {start} runs past the end")
            off += 8 + unpack(buf, off)[0]
        if off > size:
            raise GGUFFormatError(f"string array at offset {start} runs past the end")
        self.offset = off
        return _LazyStrings(buf, start, count)

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype][0])
        if vtype != _ARRAY:
            raise GGUFFormatError(f"unknown metadata value type {vtype} at offset {self.offset}")
        itype, count = self.unpack("<I"), self.unpack("<Q")
        if itype == _STRING and count >= _LAZY_AT:
            return self.skip_strings(count)
        if itype == _STRING:
            return [self.string() for _ in range(count)]
        if itype not in _SCALARS:
            raise _Unsupported(f"array of type {itype}")  # arrays of arrays: GGUFReader flattens
        dtype = np.dtype(_SCALARS[itype][1])
        if self.offset + count * dtype.itemsize > self.size:
            raise GGUFFormatError(f"array of {count} items at offset {self.offset} runs past the end")
        items = np.frombuffer(self.buf, dtype, count, self.offset)
        self.offset += count * dtype.itemsize
        return items.tolist()

    def parse(self) -> GGUFFile:
        if self.size < 24 or self.unpack("<I") != GGUF_MAGIC:
            raise GGUFFormatError("not a GGUF file (bad magic)")
        version = self.unpack("<I")
        if version & 0xFFFF == 0:
            raise _Unsupported("byte-swapped file")
        if version not in _VERSIONS:
            raise GGUFFormatError(f"GGUF version {version} is not supported (only 2 and 3)")
        tensor_count, kv_count = self.unpack("<Q"), self.unpack("<Q")
        fields: dict[str, Any] = _Fields({
            "GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count,
        })
        for _ in range(kv_count):
            key = self.string()
            if key in fields:
                raise GGUFFormatError(f"duplicate metadata key {key!r}")
            vtype = self.unpack("<I")
            if key == "general.alignment" and vtype != 4:
                raise GGUFFormatError("general.alignment must be a UINT32")
            fields[key] = self.value(vtype)
        infos = [self.tensor_info() for _ in range(tensor_count)]
        alignment = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if alignment == 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"alignment {alignment} is not a power of two")
        data_start = -(-self.offset // alignment) * alignment
        base = np.frombuffer(self.buf, dtype=np.uint8)
        return GGUFFile(self.path, fields, self.tensors(infos, base, data_start))

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        n_dims = self.unpack("<I")
        dims = struct.unpack_from(f"<{n_dims}Q", self.buf, self.offset)
        self.offset += 8 * n_dims
        return name, dims, self.unpack("<I"), self.unpack("<Q")

    def tensors(
        self, infos: list[tuple[str, tuple[int, ...], int, int]], base: np.ndarray, data_start: int
    ) -> list[GGUFTensor]:
        tensors, names = [], set()
        for name, dims, raw_type, rel_offset in infos:
            if name in names:
                raise GGUFFormatError(f"duplicate tensor {name!r}")
            names.add(name)
            qtype = GGMLQuantizationType(raw_type)
            shape = tuple(reversed(dims))
            n_elements = int(np.prod(dims, dtype=np.int64))
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            n_bytes = n_elements * type_size // block_size
            start = data_start + rel_offset
            if start + n_bytes > self.size:
                raise GGUFFormatError(
                    f"tensor {name!r} ({n_bytes} bytes at offset {start}) runs past the end of the "
                    f"file ({self.size} bytes): truncated?"
                )
            raw = base[start : start + n_bytes]
            if qtype in _ELEMENT_DTYPES:
                data = raw.view(_ELEMENT_DTYPES[qtype]).reshape(shape)
            else:
                data = raw.reshape(quant_shape_to_byte_shape(shape, qtype))
            tensors.append(GGUFTensor(name, qtype, shape, data))
        return tensors


def _from_gguf_reader(path: Path) -> GGUFFile:
    """The reference reader, for the files the fast path leaves to it."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    fields = {key: f.contents() for key, f in reader.fields.items()}
    tensors = [
        GGUFTensor(t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape.tolist())), t.data)
        for t in reader.tensors
    ]
    return GGUFFile(path, fields, tensors)
