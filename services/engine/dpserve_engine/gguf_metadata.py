"""A GGUF file's key-value metadata, read fast: the header and the KV section only, no tensors.

gguf-py's GGUFReader builds a numpy view per array element: on Gemma 3's 262k-token vocabulary (three such arrays)
it takes ~30 s before the first key can be read, where this takes well under a second. Values come back as
gguf's `ReaderField.contents()` gives them: numbers and strings as Python values, arrays as lists.
"""

from __future__ import annotations

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


def read_gguf_metadata(path: str) -> GgufMetadata:
    """The file's metadata; ValueError naming the file when it is not a GGUF file this reads (version 2 or 3)."""
    with open(path, "rb") as f:
        buf = _KvBuffer(f)
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

    def _need(self, n: int) -> None:
        if self._pos + n > len(self._data):
            more = self._f.read(max(n, self._chunk))
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
