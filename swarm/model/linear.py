"""A model's matrices as a node keeps them: float32, bfloat16, int8 or packed int4.

Where swarm's own kernels load (swarm/model/kernels: AVX2 or AVX-512 VNNI CPUs, built with a
C compiler at setup), a GGUF matrix in its native format keeps the file's blocks (`Blocks`:
Q4_0, Q4_1, Q4_K, MXFP4 as int4; Q8_0, Q6_K as int8) and they multiply it at every row count: decode
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

import functools
import time
from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F

from swarm.model import kernels
from swarm.model.quant import GROUP, INT4_NATIVE, Int4Groups, quantize_int8_rows

WEIGHT_FORMATS = ("auto", "int4", "int8", "bfloat16", "float32")
BLOCKS = "blocks"  # in `usable`: swarm's kernels may multiply the file's own blocks


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
    Inputs are taken in `terms` int8 terms (`kernels.input_terms`). Outputs are float32."""

    def __init__(
        self,
        kind: str,
        data: np.ndarray,
        k: int,
        bias: torch.Tensor | None,
        lib: kernels.Kernels,
        terms: int | None = None,
    ):
        super().__init__(data.shape[0], k, bias)
        self.kind, self.lib = kind, lib
        self.terms = kernels.input_terms(lib.isa, terms)
        self.format = native_format(kind)
        self.packed = lib.pack(kind, data, k)

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        threads = torch.get_num_threads()  # the node's --threads
        return self.lib.matmul(
            self.kind, self.packed, self.out_features, self.in_features, x2d, threads, self.terms
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


def native_format(kind: str) -> str:
    """The format `auto` keeps a tensor of GGUF type `kind` in."""
    if kind in INT4_NATIVE or kind == "MXFP4":  # MXFP4's codes: on swarm's kernels only
        return "int4"
    if kind.startswith(("Q", "IQ")):  # Q8_0, Q5_*, Q6_K ...: 5-8 bit codes
        return "int8"
    return "bfloat16"  # F32, F16, BF16, and safetensors
