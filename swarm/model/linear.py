"""A model's matrices as a node keeps them: float32, bfloat16, int8 or packed int4.

Where swarm's own kernels load (swarm/model/kernels: AVX2 or AVX-512 VNNI CPUs, built with a
C compiler at setup), a GGUF matrix in its native format keeps the file's blocks (`Blocks`:
Q4_0, Q4_1, Q4_K as int4; Q8_0, Q6_K as int8) and they multiply it at every row count: decode
memory-bound, prompts in integers faster than torch's bfloat16 GEMM (figures in
docs/benchmarks.md, issue 36). Elsewhere, and for other types, torch's kernels below.

The int8 and int4 kernels are weight-only: they read quantized weights and take bfloat16
activations (given float32 they fall back to a loop 20-50x slower), so quantized matmuls run
in bfloat16 activations and hand back bfloat16. A CPU without avx512_bf16 multiplies bfloat16
matrices in a slow emulation, 5-7x slower than float32 GEMM (measured on an avx2-only machine);
with it, 4x faster than float32. `bfloat16_gemm_is_fast` measures which at first use: where it is
slow, from `expand_from` rows on (prompt passes) a bfloat16 or int8 matrix is expanded to float32
for the pass, which costs one cheap pass over the matrix. Packed int4 stays on its kernel at
every size: unpacking it in torch costs more than the kernel does.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from swarm.model import kernels
from swarm.model.quant import (
    GROUP,
    INT4_NATIVE,
    Int4Groups,
    gguf_int4,
    quantize_int4,
    quantize_int8_rows,
)

log = logging.getLogger("swarm.model")

WEIGHT_FORMATS = ("auto", "int4", "int8", "bfloat16", "float32")
BLOCKS = "blocks"  # in `usable`: swarm's kernels may multiply the file's own blocks
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
        return RawTensor(self.name, self.kind, self.data[np.asarray(ids)]).float32()

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


class Linear:
    """y = x W^T (+ b) for x [..., in]; subclasses hold W in one format."""

    format: str
    expand_from: int | None = None  # rows from which to multiply by dequantized() weights
    matrices: int = 1  # the model's matrices this one holds, stacked by rows (see `fuse`)

    def __init__(self, out_features: int, in_features: int, bias: torch.Tensor | None):
        self.out_features, self.in_features, self.bias = out_features, in_features, bias

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] in float32, as this format holds it."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        if self.expand_from is not None and x2d.shape[0] >= self.expand_from:
            dtype = torch.bfloat16 if bfloat16_gemm_is_fast() else torch.float32
            y = F.linear(x2d.to(dtype), self.dequantized().to(dtype))
        else:
            y = self._matmul(x2d)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*lead, self.out_features)


@functools.cache
def bfloat16_gemm_is_fast() -> bool:
    """Whether this CPU multiplies a prompt pass's rows by a bfloat16 matrix faster than by
    the same matrix in float32 (avx512_bf16 does, 4x; avx2 emulates bfloat16, 5-7x slower)."""
    w, x = torch.randn(512, 512), torch.randn(64, 512)
    wb, xb = w.bfloat16(), x.bfloat16()

    def seconds(fn) -> float:
        fn()
        start = time.perf_counter()
        for _ in range(10):
            fn()
        return time.perf_counter() - start

    return seconds(lambda: F.linear(xb, wb)) < seconds(lambda: F.linear(x, w))


class Dense(Linear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(*weight.shape, None if bias is None else bias.to(weight.dtype))
        self.weight = weight
        self.format = "float32" if weight.dtype == torch.float32 else "bfloat16"
        if self.format == "bfloat16" and not bfloat16_gemm_is_fast():
            self.expand_from = 16

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        return F.linear(x2d.to(self.weight.dtype), self.weight)

    def dequantized(self) -> torch.Tensor:
        return self.weight.float()

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class Int8(Linear):
    """Weight-only int8, one scale per output row."""

    format = "int8"
    expand_from = 64  # measured: the kernel wins below ~64 rows, float32 GEMM above

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__(*codes.shape, None if bias is None else bias.bfloat16())
        self.codes, self.scales = codes, scales.bfloat16()

    @classmethod
    def quantize(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> Int8:
        return cls(*quantize_int8_rows(w), bias)

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x2d.bfloat16(), self.codes, self.scales)

    def dequantized(self) -> torch.Tensor:
        return self.codes.float() * self.scales.float()[:, None]

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + 2 * self.scales.numel()


class Int4(Linear):
    """Weight-only int4 in torch's packed CPU layout, a scale and zero per 32 inputs."""

    format = "int4"

    def __init__(
        self,
        g: Int4Groups | Iterable[Int4Groups],
        bias: torch.Tensor | None = None,
        shape: tuple[int, int] | None = None,
    ):
        """From one matrix's groups, or from its row chunks' in order and the matrix's `shape`,
        packed into place chunk by chunk. Every chunk but the last must be a multiple of 256
        rows: the packed layout works in blocks of up to 64 rows, and a chunk packed apart
        must end where a block of the whole matrix would."""
        if isinstance(g, Int4Groups):
            g, shape = [g], g.codes.shape
        rows, cols = shape
        super().__init__(rows, cols, None if bias is None else bias.bfloat16())
        self.packed = torch.empty(rows, cols // 2, dtype=torch.uint8)
        scales, zeros, done = [], [], 0
        for c in g:
            n = c.codes.shape[0]
            self.packed[done : done + n] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                torch.from_numpy(c.codes.astype(np.int32)), 1
            )
            scales.append(c.scale)
            zeros.append(c.offset + 8.0 * c.scale)
            done += n
        # [groups, rows, (scale, zero)], contiguous: the kernel reads it ignoring strides
        sz = np.stack([np.concatenate(scales).T, np.concatenate(zeros).T], axis=-1)
        self.scales_zeros = torch.from_numpy(np.ascontiguousarray(sz)).bfloat16()

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x2d.bfloat16(), self.packed, GROUP, self.scales_zeros
        )

    def codes(self) -> torch.Tensor:
        """The 4-bit codes [out, in] back out of the packed layout, whatever it is on this CPU
        (blocks of 32 rows under avx2, of 64 under avx512): the kernel itself multiplies the
        identity by the weights with scale 1 and zero 8, which gives each code exactly."""
        groups = self.in_features // GROUP
        unit = torch.tensor([1.0, 8.0]).expand(groups, self.out_features, 2)
        unit = unit.bfloat16().contiguous()
        out = torch.empty(self.out_features, self.in_features, dtype=torch.uint8)
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        for start in range(0, self.in_features, 1024):
            part = torch.ops.aten._weight_int4pack_mm_for_cpu(
                eye[start : start + 1024], self.packed, GROUP, unit
            )  # [inputs, out]
            out[:, start : start + 1024] = part.t().round().to(torch.uint8)
        return out

    def dequantized(self) -> torch.Tensor:
        groups = self.in_features // GROUP
        q = self.codes().view(self.out_features, groups, GROUP).float()
        scale = self.scales_zeros[..., 0].t().float().unsqueeze(-1)  # [out, groups, 1]
        zero = self.scales_zeros[..., 1].t().float().unsqueeze(-1)
        return ((q - 8.0) * scale + zero).view(self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + 2 * self.scales_zeros.numel()

    @staticmethod
    def fits(rows: int, cols: int) -> bool:
        # the packing op wants rows % 16; codes() reads whole blocks of 32 rows
        return rows % 32 == 0 and cols % GROUP == 0


class Blocks(Linear):
    """A GGUF matrix in the file's own blocks, multiplied by swarm's kernels (see kernels/):
    the codes and scales are the file's, moved so that the kernels' vectors hold 8 or 16 rows.
    Outputs are float32."""

    def __init__(
        self, kind: str, data: np.ndarray, k: int, bias: torch.Tensor | None, lib: kernels.Kernels
    ):
        super().__init__(data.shape[0], k, bias)
        self.kind, self.lib = kind, lib
        self.format = native_format(kind)
        self.packed = lib.pack(kind, data, k)

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        threads = torch.get_num_threads()  # the node's --threads
        return self.lib.matmul(
            self.kind, self.packed, self.out_features, self.in_features, x2d, threads
        )

    def blocks(self) -> np.ndarray:
        """The file's bytes back, uint8 [out, bytes per row]."""
        return self.lib.unpack(self.kind, self.packed, self.out_features, self.in_features)

    def dequantized(self) -> torch.Tensor:
        import gguf

        w = gguf.dequantize(self.blocks(), gguf.GGMLQuantizationType[self.kind])
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))

    @property
    def nbytes(self) -> int:
        return self.packed.numel()


class Fused:
    """Matrices that read the same input (q, k, v; gate, up), held stacked by rows as one
    Linear where they share a format: one pass over the input and one kernel call instead of
    several. Where formats differ (a Q4_K_M file keeps some v in Q6_K) each multiplies alone."""

    def __init__(self, linears: list[Linear], sizes: list[int]):
        self.linears, self.sizes = linears, sizes

    @classmethod
    def load(
        cls, raws: list[RawTensor], weights: str, biases: list[torch.Tensor | None], usable=None
    ) -> Fused:
        sizes = [raw.shape[0] for raw in raws]
        if len({_holding(raw, weights, usable) for raw in raws}) == 1:
            return cls([make_linear(raws, weights, biases, usable)], sizes)
        return cls([make_linear(r, weights, b, usable) for r, b in zip(raws, biases)], sizes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> every matrix's output side by side [..., sum(sizes)]."""
        if len(self.linears) == 1:
            return self.linears[0](x)
        return torch.cat([lin(x) for lin in self.linears], dim=-1)


def native_format(kind: str) -> str:
    """The format `auto` keeps a tensor of GGUF type `kind` in."""
    if kind in INT4_NATIVE:
        return "int4"
    if kind.startswith(("Q", "IQ")):  # Q8_0, Q5_*, Q6_K ...: 5-8 bit codes
        return "int8"
    return "bfloat16"  # F32, F16, BF16, and safetensors


def resolve_format(raw: RawTensor, weights: str, usable=None) -> str:
    """The format `raw` is held in when asked for `weights` (its native one for "auto"),
    stepping down to int8 and then bfloat16 where a format is not `usable` here or the shape
    does not fit it."""
    fmt = native_format(raw.kind) if weights == "auto" else weights
    if _blocks_kernels(raw, fmt, usable) is not None:
        return fmt  # the file's blocks, whatever their shape and torch's kernels
    usable = usable if usable is not None else WEIGHT_FORMATS
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


def make_linear(
    raw: RawTensor | list[RawTensor],
    weights: str,
    bias: torch.Tensor | None | list[torch.Tensor | None] = None,
    usable=None,
) -> Linear:
    """`raw` as a Linear in format `weights` (see `resolve_format`). Given several tensors of
    the same width (and bias for each), one Linear holding them stacked by rows. A GGUF tensor
    in its native format keeps its blocks (`Blocks`) where swarm's kernels load and `usable`
    (None: everything) has BLOCKS."""
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
        linear = Blocks(raws[0].kind, data, cols, bias, lib)
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


def usable_formats(say: Callable[[str], None] = log.warning) -> tuple[str, ...]:
    """The formats whose kernels run, and run fast, on this CPU: each of torch's weight-only
    kernels is tried on a small matrix and timed against a bfloat16 matmul of the same shape;
    one that fails or is more than 4x slower is left out (and `say` is told why). BLOCKS is in
    where swarm's kernels load and multiply a Q4_0 and a Q8_0 matrix right; `say` is told
    which kernels the node's quantized matmuls use."""
    rows, cols = 256, 1024
    w = torch.randn(rows, cols) * 0.02
    x = torch.randn(4, cols)
    reference = Dense(w.bfloat16())
    usable = ["float32", "bfloat16"]
    for name, make in (
        ("int8", lambda: Int8.quantize(w)),
        ("int4", lambda: Int4(quantize_int4(w.numpy()))),
    ):
        try:
            linear = make()
            _check(linear, x)
            ratio = _seconds(linear, x) / _seconds(reference, x)
        except Exception as exc:  # a kernel missing from this build or CPU
            say(f"{name} weights unavailable on this CPU ({type(exc).__name__}: {exc})")
            continue
        if ratio > 4.0:
            say(f"{name} weights left out: its kernel runs {ratio:.1f}x slower than bfloat16 here")
            continue
        usable.append(name)
    lib = kernels.load()
    if lib is None:
        say("quantized matmuls: torch's int4/int8 kernels (swarm's kernels did not load)")
        return tuple(usable)
    try:
        import gguf

        for kind in ("Q4_0", "Q8_0"):
            blocks = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[kind])
            _check(Blocks(kind, blocks, cols, None, lib), x)
    except Exception as exc:
        say(f"swarm's {lib.isa} kernels left out ({type(exc).__name__}: {exc})")
        return tuple(usable)
    say(
        f"quantized matmuls: swarm's {lib.isa} kernels on the file's blocks"
        f" ({', '.join(kernels.FORMATS)}), {torch.get_num_threads()} thread(s), inputs in"
        f" {kernels.input_terms(lib.isa)} int8 term(s)"
    )
    return (*usable, BLOCKS)


def _check(linear: Linear, x: torch.Tensor) -> None:
    want = x @ linear.dequantized().T  # what the weights it holds give in float32
    err = (linear(x).float() - want).abs().max().item() / want.abs().max().item()
    if not err < 0.02:
        raise RuntimeError(f"wrong results (relative error {err:.3g})")


def _seconds(linear: Linear, x: torch.Tensor, repeats: int = 20) -> float:
    linear(x)
    start = time.perf_counter()
    for _ in range(repeats):
        linear(x)
    return time.perf_counter() - start
