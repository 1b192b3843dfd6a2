"""A file's tensors made into Linears: each tensor as the file stores it (`RawTensor`), the
format it is held in (`resolve_format`: the one asked for, stepping down where this CPU or the
shape does not allow it), and the conversion, a chunk of rows at a time so that a load's
temporaries stay small (`make_linear`); matrices that read one input held as one (`Fused`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from swarm.model import kernels
from swarm.model.linear import (
    BLOCKS,
    WEIGHT_FORMATS,
    Blocks,
    Dense,
    Int4,
    Int8,
    Linear,
    native_format,
)
from swarm.model.quant import (
    GROUP,
    INT4_NATIVE,
    Int4Groups,
    gguf_int4,
    quantize_int4,
    quantize_int8_rows,
)

_CHUNK_ROWS = 256  # rows converted at a time: bounds a load's temporaries (peak RSS)


@dataclass
class RawTensor:
    """One tensor as its file stores it, not yet converted: `data` is the bytes GGUFFile.read
    gave (uint8 [rows, bytes per row] for quantized types) or a torch tensor from safetensors."""

    name: str
    kind: str  # GGUF type name ("Q4_1", "Q8_0", "F32", ...) or "torch"
    data: np.ndarray | torch.Tensor

    def float32(self) -> torch.Tensor:
        if isinstance(self.data, torch.Tensor):
            return self.data.float().contiguous()
        import gguf

        arr = gguf.dequantize(self.data, gguf.GGMLQuantizationType[self.kind])
        return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))

    def rows(self, ids: list[int]) -> torch.Tensor:
        """Rows `ids` in float32, dequantizing only those rows (embedding look-ups)."""
        if isinstance(self.data, torch.Tensor):
            return self.data[torch.tensor(ids)].float()
        picked = self.data[np.asarray(ids)]
        if self.kind == "Q8_0":  # a first hop's every step: a few numpy calls, not gguf's many
            blocks = picked.reshape(len(ids), -1, 34)
            scales = blocks[..., :2].copy().view(np.float16).astype(np.float32)
            values = blocks[..., 2:].view(np.int8).astype(np.float32) * scales
            return torch.from_numpy(values.reshape(len(ids), -1))
        if picked.dtype.kind == "f":  # F32, F16, F64: the file's values
            return torch.from_numpy(picked.astype(np.float32))
        return RawTensor(self.name, self.kind, picked).float32()

    def float32_chunks(self, rows: int = _CHUNK_ROWS) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, float32 rows) a chunk at a time: converting a matrix never holds more
        than one chunk in float32 beside the result."""
        for start in range(0, self.shape[0], rows):
            part = RawTensor(self.name, self.kind, self.data[start : start + rows])
            yield start, part.float32()

    @property
    def shape(self) -> tuple[int, int]:
        if isinstance(self.data, torch.Tensor) or self.data.dtype != np.uint8:
            return tuple(self.data.shape)
        import gguf

        rows, row_bytes = self.data.shape
        block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.kind]]
        return rows, row_bytes // type_bytes * block


class Fused:
    """Matrices that read the same input (q, k, v; gate, up), held stacked by rows as one
    Linear where they share a format: one pass over the input and one kernel call instead of
    several. Where formats differ (a Q4_K_M file keeps some v in Q6_K) each multiplies alone."""

    def __init__(self, linears: list[Linear], sizes: list[int]):
        self.linears, self.sizes = linears, sizes

    @classmethod
    def load(
        cls,
        raws: list[RawTensor],
        weights: str,
        biases: list[torch.Tensor | None],
        usable=None,
        terms: int | None = None,
    ) -> Fused:
        """`raws` as make_linear holds each (its arguments), stacked where they share a format."""
        sizes = [raw.shape[0] for raw in raws]
        if len({_holding(raw, weights, usable) for raw in raws}) == 1:
            return cls([make_linear(raws, weights, biases, usable, terms)], sizes)
        linears = [make_linear(r, weights, b, usable, terms) for r, b in zip(raws, biases)]
        return cls(linears, sizes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> every matrix's output side by side [..., sum(sizes)]."""
        if len(self.linears) == 1:
            return self.linears[0](x)
        return torch.cat([lin(x) for lin in self.linears], dim=-1)


def resolve_format(raw: RawTensor, weights: str, usable=None) -> str:
    """The format `raw` is held in when asked for `weights` (its native one for "auto"),
    stepping down to int8 and then bfloat16 where a format is not `usable` here or the shape
    does not fit it. MXFP4's auto is swarm's kernels, or else bfloat16 (exact, 3.8x its bytes):
    int4 or int8 requantize it, only where asked for."""
    fmt = native_format(raw.kind) if weights == "auto" else weights
    if _blocks_kernels(raw, fmt, usable) is not None:
        return fmt  # the file's blocks, whatever their shape and torch's kernels
    usable = usable if usable is not None else WEIGHT_FORMATS
    if weights == "auto" and raw.kind == "MXFP4":
        return "bfloat16"  # torch's int4 would round its codes again; bfloat16 holds them exactly
    if fmt == "int4" and not (Int4.fits(*raw.shape) and "int4" in usable):
        fmt = "int8"
    if fmt == "int8" and "int8" not in usable:
        fmt = "bfloat16"
    return fmt


def _blocks_kernels(raw: RawTensor, fmt: str, usable=None) -> kernels.Kernels | None:
    """swarm's kernels where `raw` keeps its file's blocks in format `fmt` (its native one, of a
    type they multiply, BLOCKS being usable), else None."""
    if raw.kind not in kernels.FORMATS or fmt != native_format(raw.kind):
        return None
    if usable is not None and BLOCKS not in usable:
        return None
    return kernels.load()


def _holding(raw: RawTensor, weights: str, usable=None) -> tuple[str, str | None]:
    """What `raw` becomes: its format, and its GGUF type where it keeps the file's blocks."""
    fmt = resolve_format(raw, weights, usable)
    return fmt, raw.kind if _blocks_kernels(raw, fmt, usable) is not None else None


def held_bytes(raw: RawTensor, weights: str, usable=None) -> int:
    """The bytes `make_linear(raw, weights, usable)` holds, known before it is made."""
    fmt, kind = _holding(raw, weights, usable)
    rows, cols = raw.shape
    if kind is not None:
        return raw.data.nbytes  # the file's blocks as they are
    if fmt == "int4":
        return rows * cols // 2 + 4 * (rows * cols // GROUP)  # a bfloat16 scale, zero a group
    if fmt == "int8":
        return rows * cols + 2 * rows
    return rows * cols * (4 if fmt == "float32" else 2)


def make_linear(
    raw: RawTensor | list[RawTensor],
    weights: str,
    bias: torch.Tensor | None | list[torch.Tensor | None] = None,
    usable=None,
    terms: int | None = None,
) -> Linear:
    """`raw` as a Linear in format `weights` (see `resolve_format`). Given several tensors of
    the same width (and bias for each), one Linear holding them stacked by rows. A GGUF tensor
    in its native format keeps its blocks (`Blocks`) where swarm's kernels load and `usable`
    (None: everything) has BLOCKS; their matmuls take inputs in `terms` int8 terms (a node's
    --input-terms; None: the instruction set's, `kernels.input_terms`)."""
    raws = raw if isinstance(raw, list) else [raw]
    biases = bias if isinstance(bias, list) else [bias]
    fmt = resolve_format(raws[0], weights, usable)
    rows, cols = sum(r.shape[0] for r in raws), raws[0].shape[1]
    if any(b is not None for b in biases):
        bias = torch.cat(
            [torch.zeros(r.shape[0]) if b is None else b for r, b in zip(raws, biases)]
        )
    else:
        bias = None
    lib = _blocks_kernels(raws[0], fmt, usable)
    if lib is not None and len({r.kind for r in raws}) == 1:
        data = raws[0].data if len(raws) == 1 else np.concatenate([r.data for r in raws])
        linear = Blocks(raws[0].kind, data, cols, bias, lib, terms)
    elif fmt == "int4":
        linear = Int4(_regrouped(_int4_chunks(r) for r in raws), bias, (rows, cols))
    elif fmt == "int8":
        codes, scales = torch.empty(rows, cols, dtype=torch.int8), torch.empty(rows)
        for start, w in _float32_chunks(raws):
            codes[start : start + len(w)], scales[start : start + len(w)] = quantize_int8_rows(w)
        linear = Int8(codes, scales, bias)
    else:
        dtype = torch.float32 if fmt == "float32" else torch.bfloat16
        weight = torch.empty(rows, cols, dtype=dtype)
        for start, w in _float32_chunks(raws):
            weight[start : start + len(w)] = w
        linear = Dense(weight, bias)
    linear.matrices = len(raws)
    return linear


def _float32_chunks(raws: list[RawTensor]) -> Iterator[tuple[int, torch.Tensor]]:
    done = 0
    for raw in raws:
        for start, w in raw.float32_chunks():
            yield done + start, w
        done += raw.shape[0]


def _int4_chunks(raw: RawTensor) -> Iterator[Int4Groups]:
    for r in range(0, raw.shape[0], _CHUNK_ROWS):
        if raw.kind in INT4_NATIVE:
            yield gguf_int4(raw.data[r : r + _CHUNK_ROWS], raw.kind)
        else:
            part = RawTensor(raw.name, raw.kind, raw.data[r : r + _CHUNK_ROWS])
            yield quantize_int4(part.float32().numpy())


def _regrouped(parts: Iterable[Iterator[Int4Groups]]) -> Iterator[Int4Groups]:
    """Chunks of several matrices, in order, as chunks of exactly _CHUNK_ROWS rows (the last
    shorter): one matrix's short last chunk joins the next one's first (see Int4)."""
    pending: list[Int4Groups] = []
    have = 0
    for chunks in parts:
        for g in chunks:
            pending.append(g)
            have += g.codes.shape[0]
            while have >= _CHUNK_ROWS:
                whole = _concat(pending)
                yield _rows(whole, 0, _CHUNK_ROWS)
                rest = _rows(whole, _CHUNK_ROWS, have)
                pending, have = [rest], have - _CHUNK_ROWS
    if have:
        yield _concat(pending)


def _concat(groups: list[Int4Groups]) -> Int4Groups:
    if len(groups) == 1:
        return groups[0]
    return Int4Groups(*(np.concatenate([getattr(g, f) for g in groups]) for f in Int4Groups.FIELDS))


def _rows(g: Int4Groups, start: int, end: int) -> Int4Groups:
    return Int4Groups(g.codes[start:end], g.scale[start:end], g.offset[start:end])


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc keeps them after a load's temporaries:
    measured, 0.6x of an int4 layer's file bytes stayed in RSS without this)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to ask
