"""What the kernel and weight tests share: the instruction sets this CPU runs, swarm's kernels
for one of them (or a skip), and a span's float32 twin to compare a quantized one with."""

from __future__ import annotations

import pytest

from swarm.model import kernels
from swarm.model.blocks import Block, Span
from swarm.model.experts import MLP
from swarm.model.linear import Dense, Linear
from swarm.model.weights import Fused

ISAS = kernels.runnable_isas()
TORCH_KERNELS = ("float32", "bfloat16", "int8", "int4")  # `usable` without swarm's kernels

needs_kernels = pytest.mark.skipif(not ISAS, reason="this CPU runs none of swarm's kernels")


def lib_for(isa: str) -> kernels.Kernels:
    lib = kernels.load(isa)
    if lib is None:
        pytest.skip(f"swarm's {isa} kernels do not build here (no C compiler?)")
    return lib


def as_float32(span: Span) -> Span:
    """The same span with every matrix replaced by its dequantized float32 weights."""

    def dense(lin: Linear) -> Dense:
        return Dense(lin.dequantized(), lin.bias)

    blocks = []
    for b in span.blocks:
        qkv = Fused([dense(lin) for lin in b.qkv.linears], b.qkv.sizes)
        m = b.mlp
        gate_up = Fused([dense(lin) for lin in m.gate_up.linears], m.gate_up.sizes)
        mlp = MLP(gate_up, dense(m.down), m.activate)
        blocks.append(Block(span.config, b.norms, qkv, dense(b.o), mlp))
    return Span(span.config, span.start, span.end, blocks, "float32")
