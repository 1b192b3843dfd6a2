"""A lean GGUF reader: the metadata a node needs and one tensor's bytes at a time.

gguf's own reader keeps every metadata value as numpy arrays (the tokenizer's ~100k strings
among them, ~150 MiB for the default model) and serves tensors from a memory map, whose pages
then count in the node's RSS for as long as it runs. A node needs neither: this reads the
header once, keeps scalars, strings and the short numeric arrays of a model's per-layer
values (Gemma 4's layer kinds, kv heads), skips the others (the tokenizer's), and reads each
tensor with pread into memory the converted weights replace.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS |= {11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_KEPT_ARRAY = 4096  # numeric arrays up to this long are kept: one value a layer or expert
_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: shape[0] is the row length
    kind: str  # GGUF type name: "Q4_1", "F32", ...
    offset: int  # from the file's start
    nbytes: int


class GGUFFile:
    def __init__(self, path: str | os.PathLike):
        import gguf  # only for its table of type sizes

        self.path = Path(path)
        self.fields: dict[str, object] = {}
        self.lengths: dict[str, int] = {}  # arrays' lengths, their values skipped
        self.tensors: dict[str, TensorInfo] = {}
        with open(self.path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"{self.path.name} is not a GGUF file")
            version, n_tensors, n_fields = struct.unpack("<IQQ", f.read(20))
            if version < 2:
                raise ValueError(f"{self.path.name}: GGUF version {version} is too old")
            for _ in range(n_fields):
                key = _string(f)
                (vtype,) = struct.unpack("<I", f.read(4))
                if vtype == _ARRAY and not key.startswith("tokenizer."):
                    self.lengths[key], kept = _array(f)
                    if kept is not None:
                        self.fields[key] = kept
                elif vtype == _ARRAY:
                    self.lengths[key] = _skip_array(f)
                else:
                    self.fields[key] = _value(f, vtype)
            infos = []
            for _ in range(n_tensors):
                name = _string(f)
                (dims,) = struct.unpack("<I", f.read(4))
                shape = struct.unpack(f"<{dims}Q", f.read(8 * dims))
                kind, offset = struct.unpack("<IQ", f.read(12))
                infos.append((name, shape, gguf.GGMLQuantizationType(kind), offset))
            align = int(self.fields.get("general.alignment", 32))
            start = -(-f.tell() // align) * align
        for name, shape, qtype, offset in infos:
            block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(shape)) // block * type_bytes
            self.tensors[name] = TensorInfo(name, shape, qtype.name, start + offset, nbytes)

    def read(self, name: str) -> np.ndarray:
        """The tensor's bytes, owned by the caller: uint8 [rows, bytes per row] for quantized
        types, a float array [rows, row length] (or 1-D) for float ones."""
        t = self.tensors[name]
        fd = os.open(self.path, os.O_RDONLY)
        try:
            buf = bytearray(t.nbytes)
            view, done = memoryview(buf), 0
            while done < t.nbytes:
                n = os.preadv(fd, [view[done:]], t.offset + done)
                if n == 0:
                    raise ValueError(f"{self.path.name} ends inside tensor {name}")
                done += n
        finally:
            os.close(fd)
        if t.kind in _FLOAT_TYPES:
            return np.frombuffer(buf, dtype=_FLOAT_TYPES[t.kind]).reshape(t.shape[::-1])
        rows = int(np.prod(t.shape[1:]))
        return np.frombuffer(buf, dtype=np.uint8).reshape(rows, -1)

    def mapped(self, name: str) -> np.ndarray:
        """The tensor's bytes as `read` shapes them, mapped from the file rather than read:
        for a table a process keeps for life but touches a few rows at a time (the client's
        embeddings), whose pages the kernel may then drop and read again (`unmap_pages`)."""
        t = self.tensors[name]
        with open(self.path, "rb") as f:
            whole = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if t.kind in _FLOAT_TYPES:
            dtype = _FLOAT_TYPES[t.kind]
            count = t.nbytes // np.dtype(dtype).itemsize
            arr = np.frombuffer(whole, dtype=dtype, count=count, offset=t.offset)
            return arr.reshape(t.shape[::-1])
        arr = np.frombuffer(whole, dtype=np.uint8, count=t.nbytes, offset=t.offset)
        return arr.reshape(int(np.prod(t.shape[1:])), -1)


def unmap_pages(data) -> None:
    """Let go of the resident pages of a `mapped` array (after converting all of it once, say):
    they stay in the page cache, off this process's RSS, and come back on the next touch."""
    base = data
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    if isinstance(base, mmap.mmap):
        base.madvise(mmap.MADV_DONTNEED)


def _string(f) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", errors="replace")


def _value(f, vtype: int):
    """A scalar or string; arrays are skipped (None): a node needs none of them."""
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        _skip_array(f)
        return None
    raise ValueError(f"unknown GGUF value type {vtype}")


def _array(f) -> tuple[int, tuple | None]:
    """An array's length, and its values where they are a short run of numbers."""
    etype, count = struct.unpack("<IQ", f.read(12))
    if etype not in _SCALARS or count > _KEPT_ARRAY:
        f.seek(-12, os.SEEK_CUR)
        return _skip_array(f), None
    fmt = _SCALARS[etype]
    return count, struct.unpack(f"<{count}{fmt[1:]}", f.read(count * struct.calcsize(fmt)))


def _skip_array(f) -> int:
    """Past an array's values; its length."""
    etype, count = struct.unpack("<IQ", f.read(12))
    if etype in _SCALARS:
        f.seek(count * struct.calcsize(_SCALARS[etype]), os.SEEK_CUR)
    else:
        for _ in range(count):
            _value(f, etype)
    return count
