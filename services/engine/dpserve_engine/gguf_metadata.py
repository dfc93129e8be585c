"""A GGUF file's key-value metadata and tensor index, read fast.

gguf-py's GGUFReader builds a numpy view per array element: on Gemma 3's 262k-token vocabulary (three such arrays)
it takes 15-30 s before the first key can be read, where this takes well under a second. Values come back as
gguf's `ReaderField.contents()` gives them: numbers and strings as Python values, arrays as lists; tensors as
GGUFReader's do (`name`, `tensor_type`, `shape`, and `data`: a read-only memmap in the same numpy shape and dtype,
so that gguf.quants.dequantize takes it as it is).
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
# GGUF value types -> (struct format, numpy dtype) for the fixed-size ones
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}  # fmt: skip
_STRING, _ARRAY = 8, 9


class GgufMetadata(dict):
    """key -> value of one GGUF file (a dict; `get` as usual)."""

    tensor_count: int = 0


@dataclasses.dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order (innermost first), as GGUFReader's `shape`
    data: np.ndarray


def read_gguf_metadata(path: str) -> GgufMetadata:
    """The file's metadata; ValueError naming the file when it is not a GGUF file this reads (version 2 or 3)."""
    with open(path, "rb") as f:
        return _read_kv(_KvBuffer(f), path)


GGUF_ARCHITECTURES = ("llama",)  # what model.py computes from a GGUF file


def check_architecture(meta: GgufMetadata, path: str) -> str:
    """The file's `general.architecture`; ValueError naming it when the model does not compute it."""
    arch = meta.get("general.architecture") or "llama"
    if arch not in GGUF_ARCHITECTURES:
        supported = ", ".join(map(repr, GGUF_ARCHITECTURES))
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported (only {supported})")
    return arch


def read_gguf(path: str) -> tuple[GgufMetadata, list[GgufTensor]]:
    """The file's metadata and its tensors (their data memory-mapped, not read)."""
    import gguf

    with open(path, "rb") as f:
        buf = _KvBuffer(f)
        meta = _read_kv(buf, path)
        infos = []
        for _ in range(meta.tensor_count):
            name = buf.string()
            dims = tuple(buf.unpack("<Q") for _ in range(buf.unpack("<I")))
            infos.append((name, gguf.GGMLQuantizationType(buf.unpack("<I")), dims, buf.unpack("<Q")))
        end = buf.offset
    alignment = int(meta.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment {alignment} is not a power of two")
    start = end + (-end % alignment)
    mapped = np.memmap(path, mode="r")
    tensors, seen = [], set()
    for name, kind, dims, offset in infos:
        if name in seen:
            raise ValueError(f"{path}: tensor {name!r} appears twice")
        seen.add(name)
        n = int(np.prod(dims))
        block, size = gguf.GGML_QUANT_SIZES[kind]
        dtype = _PLAIN_TYPES.get(kind.name)
        np_dims = tuple(reversed(dims))
        if dtype is None:  # quantized (and BF16): bytes, [rows, bytes a row]
            count, dtype, np_dims = n * size // block, np.uint8, gguf.quant_shape_to_byte_shape(np_dims, kind)
        else:
            count = n
        first = start + offset
        data = mapped[first : first + count * np.dtype(dtype).itemsize].view(dtype).reshape(np_dims)
        tensors.append(GgufTensor(name, kind, dims, data))
    return meta, tensors


_PLAIN_TYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}  # fmt: skip


def _read_kv(buf: _KvBuffer, path: str) -> GgufMetadata:
    """The header and the KV section; `buf` is left at the tensor index."""
    if buf.take(4) != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    version = buf.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    meta = GgufMetadata()
    meta.tensor_count = buf.unpack("<Q")
    for _ in range(buf.unpack("<Q")):
        key = buf.string()
        meta[key] = buf.value(buf.unpack("<I"))
    return meta


class _KvBuffer:
    """Reads the file forward in chunks (the KV section is a few MB even for a 262k vocabulary)."""

    def __init__(self, f, chunk: int = 1 << 22):
        self._f, self._chunk = f, chunk
        self._data, self._pos = b"", 0
        self._read = 0  # bytes read from the file so far

    @property
    def offset(self) -> int:
        """The file offset of the next byte this buffer hands out."""
        return self._read - (len(self._data) - self._pos)

    def _need(self, n: int) -> None:
        if self._pos + n > len(self._data):
            more = self._f.read(max(n, self._chunk))
            self._read += len(more)
            self._data = self._data[self._pos :] + more
            self._pos = 0
            if n > len(self._data):
                raise ValueError("GGUF file ends inside its metadata")

    def take(self, n: int) -> bytes:
        self._need(n)
        out = self._data[self._pos : self._pos + n]
        self._pos += n
        return out

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self._data, self._pos)
        self._pos += size
        return value

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind][0])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALARS:
                dtype = np.dtype(_SCALARS[item][1]).newbyteorder("<")
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
            return [self.value(item) for _ in range(count)]
        raise ValueError(f"GGUF metadata value type {kind} is not one of GGUF's")
