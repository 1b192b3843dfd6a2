"""Quantized matmuls on the blocks GGUF files keep (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4).

quantmm.c is swarm's own C: at load a matrix's blocks are moved (not converted) so that 8 or 16
output rows share each vector, and a matmul quantizes its input rows to int8 and multiplies in
integers, vpdpbusd on AVX-512 VNNI CPUs, vpmaddubsw on AVX2 ones. `load()` picks the best library
this CPU runs, building it with the C compiler if setup did not; where it cannot (no compiler, a
CPU without AVX2) it returns None and the caller keeps torch's int4/int8 kernels.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from swarm.model.kernels.build import ISA_CPU_FLAGS, ISA_FLAGS, BuildError, build

log = logging.getLogger("swarm.model")

# GGUF type name -> the kernels' format number; elements and bytes per block
FORMATS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2, "Q4_K": 3, "Q6_K": 4, "Q5_K": 5, "MXFP4": 6}
BLOCKS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
    "Q5_K": (256, 176),
    "MXFP4": (32, 17),
}


class KernelError(RuntimeError):
    """A kernel refused its arguments (a shape its format cannot hold) or ran out of memory."""


@dataclass(frozen=True)
class Kernels:
    """One loaded library: `isa` is its instruction set, `rows` the output rows per vector."""

    lib: ctypes.CDLL
    isa: str
    rows: int

    @classmethod
    def open(cls, path: Path) -> Kernels:
        lib = ctypes.CDLL(str(path))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.swq_isa.restype = ctypes.c_char_p
        lib.swq_rows.restype = ctypes.c_int
        lib.swq_packed_bytes.argtypes = [ctypes.c_int, i64, i64]
        lib.swq_packed_bytes.restype = i64
        lib.swq_pack.argtypes = [ctypes.c_int, ptr, i64, i64, ptr]
        lib.swq_unpack.argtypes = [ctypes.c_int, ptr, i64, i64, i64, ptr]
        lib.swq_matmul.argtypes = [
            ctypes.c_int,
            ptr,
            i64,
            i64,
            ptr,
            i64,
            ptr,
            ctypes.c_int,
            ctypes.c_int,
        ]
        ci = ctypes.c_int
        lib.swq_attn_scores.argtypes = [ptr, ptr, i64, ci, ci, ci, i64, ctypes.c_float, ptr]
        lib.swq_attn_mix.argtypes = [ptr, ptr, i64, ci, ci, ci, i64, ptr]
        lib.swq_layers.argtypes = [ptr, ci, ptr, i64, ptr, ptr, ptr, ptr, ci]  # fast_layers.py
        return cls(lib, lib.swq_isa().decode(), lib.swq_rows())

    def pack(self, kind: str, blocks: np.ndarray, k: int) -> torch.Tensor:
        """A matrix's blocks as the file keeps them (uint8 [n, bytes per row]) -> the kernels'
        layout (uint8, 1-D): the same codes and scales, rows interleaved."""
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
        n = blocks.shape[0]
        size = self.lib.swq_packed_bytes(FORMATS[kind], n, k)
        if size < 0 or blocks.shape[1] != k // BLOCKS[kind][0] * BLOCKS[kind][1]:
            raise KernelError(f"{kind}: a matrix of {n} x {k} does not fit {blocks.shape} bytes")
        out = huge_page_tensor(size)
        self._check(self.lib.swq_pack(FORMATS[kind], blocks.ctypes.data, n, k, out.data_ptr()))
        return out

    def unpack(self, kind: str, packed: torch.Tensor, n: int, k: int) -> np.ndarray:
        """The inverse of `pack`: the file's bytes, uint8 [n, bytes per row]."""
        out = np.empty((n, k // BLOCKS[kind][0] * BLOCKS[kind][1]), dtype=np.uint8)
        self._check(self.lib.swq_unpack(FORMATS[kind], packed.data_ptr(), k, 0, n, out.ctypes.data))
        return out

    def matmul(
        self,
        kind: str,
        packed: torch.Tensor,
        n: int,
        k: int,
        x: torch.Tensor,
        threads: int,
        terms: int | None = None,
    ) -> torch.Tensor:
        """x [rows, k] float32 -> x W^T [rows, n] float32, W packed by `pack`. x is taken as
        `terms` int8 terms (default: this instruction set's, TERMS_BY_ISA): 1 rounds each input
        by up to half a step of its group's largest (llama.cpp's precision), 2 adds that
        rounding's own int8 (within 2^-16 of the largest) for ~1.5x the arithmetic."""
        terms = input_terms(self.isa, terms)
        x = x.float().contiguous()
        y = torch.empty(x.shape[0], n, dtype=torch.float32)
        self._check(
            self.lib.swq_matmul(
                FORMATS[kind],
                packed.data_ptr(),
                n,
                k,
                x.data_ptr(),
                x.shape[0],
                y.data_ptr(),
                terms,
                threads,
            )
        )
        return y

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: int, scale: float
    ) -> torch.Tensor:
        """One decode step's attention: q [heads, d] float32 against the first `seen` rows of a
        bfloat16 cache, keys and values [1, kv_heads, capacity, d] (head h reads kv head
        h // (heads / kv_heads)) -> [heads, d] float32, softmax(scale q K^T) V."""
        scores = self._scores(q, keys, values, seen, scale)
        return self._mix(torch.softmax(scores, dim=-1), values, seen)

    def partial(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seen: int, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`attend`'s piece over these positions only, as swarm.model.partial_attention
        gives it: (out [heads, d] float32, normalised over them; lse [heads], the log-sum-exp
        of the scores)."""
        scores = self._scores(q, keys, values, seen, scale)
        lse = torch.logsumexp(scores, dim=-1)
        return self._mix(torch.exp(scores - lse[:, None]), values, seen), lse

    def _scores(self, q, keys, values, seen: int, scale: float) -> torch.Tensor:
        heads, d = q.shape
        _, kv_heads, capacity, d_cache = keys.shape
        if (
            keys.dtype != torch.bfloat16
            or values.shape != keys.shape
            or values.dtype != keys.dtype
            or not (keys.is_contiguous() and values.is_contiguous())
            or d_cache != d
            or heads % kv_heads
            or not 0 < seen <= capacity
        ):
            raise KernelError(
                f"attention of q {tuple(q.shape)} over a {keys.dtype} cache"
                f" {tuple(keys.shape)}, {seen} rows seen"
            )
        q = q.float().contiguous()
        scores = torch.empty(heads, seen, dtype=torch.float32)
        self._check(
            self.lib.swq_attn_scores(
                q.data_ptr(),
                keys.data_ptr(),
                capacity * d,
                kv_heads,
                heads // kv_heads,
                d,
                seen,
                scale,
                scores.data_ptr(),
            )
        )
        return scores

    def _mix(self, p: torch.Tensor, values: torch.Tensor, seen: int) -> torch.Tensor:
        """p [heads, seen] float32 (contiguous) weighing the first `seen` rows of values."""
        heads = p.shape[0]
        _, kv_heads, capacity, d = values.shape
        out = torch.empty(heads, d, dtype=torch.float32)
        self._check(
            self.lib.swq_attn_mix(
                p.data_ptr(),
                values.data_ptr(),
                capacity * d,
                kv_heads,
                heads // kv_heads,
                d,
                seen,
                out.data_ptr(),
            )
        )
        return out

    @staticmethod
    def _check(rc: int) -> None:
        if rc == -2:
            raise MemoryError("swarm kernels: no memory for the input's int8 copy")
        if rc != 0:
            raise KernelError(f"swarm kernels refused the call (code {rc})")


HUGE_PAGE = 2 << 20


def huge_page_tensor(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes], from a 2 MiB boundary of anonymous memory the OS is asked to back with
    2 MiB pages (where transparent huge pages are on or "madvise"; elsewhere it has 4 KiB ones
    as torch's would). A decode step streams every matrix once: on 4 KiB pages each page costs
    a TLB walk. One 14336 x 4096 Q4_0 matrix, 1 thread: 2.3-2.7 ms on torch's memory, 1.76 ms
    here; Q8_0 3.3-4.6 against 2.71 (which allocation it got moved torch's figure)."""
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` while any view lives
    start = -whole.data_ptr() % HUGE_PAGE
    tail = start + nbytes // HUGE_PAGE * HUGE_PAGE  # the last 2 MiB only partly used: 4 KiB
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, tail - start)
    except OSError:  # a kernel without transparent huge pages: 4 KiB pages, as before
        pass
    return whole[start : start + nbytes]


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def runnable_isas(flags: set[str] | None = None) -> list[str]:
    """The instruction sets of ISA_FLAGS this CPU runs, best first."""
    flags = cpu_flags() if flags is None else flags
    return [isa for isa in ISA_FLAGS if ISA_CPU_FLAGS[isa] <= flags]


# int8 terms each matmul takes its input rows in, where a node's --input-terms leaves it to the
# instruction set. One (llama.cpp's precision) everywhere: a second keeps the default model's
# top-1 agreement with float32 at 0.997 instead of 0.956 but leaves perplexity where it was
# (+0.02% / -0.06%), and costs its arithmetic wherever compute, not memory, sets the pace: on
# AVX2 always (prompt passes 0.63-0.83x llama.cpp's speed with two), and on AVX-512 VNNI for
# every pass of several rows, the rows of batches, verification rounds and prompts (two 8B-shaped
# Q4_K layers, 4 / 8 / 16 rows 1.5 / 1.8 / 1.9x one term's time, 1 row 1.0-1.1x;
# scripts/bench_rows.py, docs/benchmarks.md 2026-11-28).
TERMS_BY_ISA = {"avx512vnni": 1, "avx2": 1}


def input_terms(isa: str, terms: int | None = None) -> int:
    """The int8 terms the kernels for `isa` take their inputs in: `terms` (1 or 2, a node's
    --input-terms), or for None the instruction set's own (TERMS_BY_ISA)."""
    if terms not in (None, 1, 2):
        raise ValueError(f"input terms: 1, 2 or auto, not {terms}")
    return terms or TERMS_BY_ISA[isa]


ISA_ENV = "SWARM_KERNELS_ISA"  # e.g. avx2 on an AVX-512 CPU: what an AVX2-only machine runs


@functools.cache
def load(isa: str | None = None) -> Kernels | None:
    """The kernels for `isa` (default: $SWARM_KERNELS_ISA if set, else the best this CPU
    runs), built if need be; None where there are none (the reason is logged once)."""
    isas = runnable_isas()
    if isa is None and os.environ.get(ISA_ENV):
        isa = os.environ[ISA_ENV]
        if isa not in isas:
            log.warning("%s=%s: this CPU runs %s; the best of them instead", ISA_ENV, isa, isas)
            isa = None
    if isa is not None:
        if isa not in isas:
            return None
        isas = [isa]
    if not isas:
        log.info("swarm kernels: this CPU has no AVX2; torch's int4/int8 kernels instead")
        return None
    try:
        return Kernels.open(build(isas[0]))
    except (BuildError, OSError) as exc:
        log.warning("swarm kernels unavailable (%s); torch's int4/int8 kernels instead", exc)
        return None
