"""Which weight formats run, and run fast, on this CPU: each kernel tried and timed at start."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from swarm.model import kernels
from swarm.model.linear import BLOCKS, Blocks, Dense, Int4, Int8, Linear
from swarm.model.quant import quantize_int4

log = logging.getLogger("swarm.model")
# where swarm's kernels do not run, what `auto` does with a file's MXFP4 matrices (resolve_format)
MXFP4 = "MXFP4 matrices (gpt-oss's experts) held as bfloat16 instead, 3.8x their bytes"


def usable_formats(
    say: Callable[[str], None] = log.warning, terms: int | None = None
) -> tuple[str, ...]:
    """The formats whose kernels run, and run fast, on this CPU: each of torch's weight-only
    kernels is tried on a small matrix and timed against a bfloat16 matmul of the same shape;
    one that fails or is more than 4x slower is left out (and `say` is told why). BLOCKS is in
    where swarm's kernels load and multiply a Q4_0, a Q8_0 and an MXFP4 matrix right, their
    inputs in `terms` int8 terms (as make_linear's); `say` is told which kernels the node's
    quantized matmuls use, and where MXFP4 steps down to bfloat16."""
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
        say(f"quantized matmuls: torch's int4/int8 kernels (swarm's kernels did not load); {MXFP4}")
        return tuple(usable)
    try:
        import gguf

        for kind in ("Q4_0", "Q8_0", "MXFP4"):
            blocks = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[kind])
            _check(Blocks(kind, blocks, cols, None, lib, terms), x)
    except Exception as exc:
        say(f"swarm's {lib.isa} kernels left out ({type(exc).__name__}: {exc}); {MXFP4}")
        return tuple(usable)
    say(
        f"quantized matmuls: swarm's {lib.isa} kernels on the file's blocks"
        f" ({', '.join(kernels.FORMATS)}), {torch.get_num_threads()} thread(s), inputs in"
        f" {kernels.input_terms(lib.isa, terms)} int8 term(s)"
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
