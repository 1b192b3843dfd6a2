"""A span's plain layers as one C call a decode pass (swarm/model/kernels/layer.c).

Between a decode step's matmuls, Python and torch's small ops took 60% of the default model's
one-row step and 0.65 ms of each 8B-shaped layer (docs/benchmarks.md, 2026-11-27, night). Where
every layer of a span is the plain llama-like kind (RMSNorm, q/k/v, RoPE, softmax attention over
a bfloat16 cache, a gated silu or gelu MLP, all matrices on swarm's kernels, biases or not), a
decode pass goes through all of its layers in one call, with the node's threads kept inside it.
Every one-position step of such a span takes this path: a lone session's (Span.forward), a batch
of sessions' and a verification round's rows (Span.decode), so a round's rows stay the plain
steps' bit for bit. Other layers (q/k norms, post-norms, softcaps, sinks, mixtures of experts,
latent or linear attention, shared KV, a float32 cache) keep blocks.py's path.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from swarm.model import kernels
from swarm.model.experts import MLP
from swarm.model.linear import Blocks
from swarm.model.weights import Fused

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
i64, i32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p


class _Mat(ctypes.Structure):
    _fields_ = [("fmt", i32), ("terms", i32), ("w", ptr), ("n", i64), ("bias", ptr)]


class _Layer(ctypes.Structure):
    _fields_ = [
        *[(name, i64) for name in ("hidden", "heads", "kv_heads", "head_dim", "rot_dim", "ff")],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        *[(name, i32) for name in ("act", "nqkv", "ngu", "pad")],
        ("attn_norm", ptr),
        ("mlp_norm", ptr),
        ("qkv", _Mat * 3),
        ("o", _Mat),
        ("gu", _Mat * 2),
        ("down", _Mat),
    ]


class _Cache(ctypes.Structure):
    _fields_ = [("k", ptr), ("v", ptr), ("capacity", i64)]


def _plain(block) -> bool:
    """Whether layer.c computes `block` as blocks.py does."""
    c = block.c
    if block.source is not None or block.tail is not None or block.sinks is not None:
        return False
    if c.qk_norm or c.post_norms or c.attn_gate or c.v_norm or c.k_eq_v:
        return False
    if c.attn_softcap is not None or c.activation not in ACTIVATIONS:
        return False
    if not isinstance(block.qkv, Fused) or type(block.mlp) is not MLP:
        return False
    if not all(isinstance(m, Blocks) for m in _matrices(block)):
        return False
    return len(block.qkv.linears) <= 3 and len(block.mlp.gate_up.linears) <= 2


def _matrices(block) -> tuple:
    return (*block.qkv.linears, block.o, *block.mlp.gate_up.linears, block.mlp.down)


class FastLayers:
    """A span's blocks as layer.c takes them (`table` None: some block is not plain, or the
    kernels did not load: every pass keeps blocks.py's path)."""

    def __init__(self, start: int, lib=None, table=None, keep=(), rings=()):
        self.start, self.lib, self.table, self.keep = start, lib, table, keep
        self.rings = rings  # per entry: a sliding-window layer, whose cache may be a ring

    @classmethod
    def build(cls, config, start: int, blocks: list) -> FastLayers:
        """Blocks [start, start + len(blocks)) of a model of `config`, on the library their
        matrices were packed for (each instruction set's packs rows its own way)."""
        ropes = {config.rotary_of(start + i) for i in range(len(blocks))}
        if not blocks or config.kv_shared or len(ropes) != 1:
            return cls(start)
        if not all(_plain(b) for b in blocks):
            return cls(start)
        libs = {id(m.lib): m.lib for b in blocks for m in _matrices(b)}
        if len(libs) != 1:
            return cls(start)
        (lib,) = libs.values()
        keep: list = []  # the biases and norms the table points at, held while it lives
        table = (_Layer * len(blocks))()
        rot_dim = next(iter(ropes))[1]
        for entry, block in zip(table, blocks):
            cls._fill(entry, block, rot_dim, keep)
        rings = [config.window(start + i) is not None for i in range(len(blocks))]
        return cls(start, lib, table, keep, rings)

    @staticmethod
    def _fill(entry: _Layer, block, rot_dim: int, keep: list) -> None:
        c = block.c

        def address(t: torch.Tensor | None) -> int | None:
            if t is None:
                return None
            t = t.float().contiguous()
            keep.append(t)
            return t.data_ptr()

        def mat(m: Blocks) -> _Mat:
            fmt = kernels.FORMATS[m.kind]
            return _Mat(fmt, m.terms, m.packed.data_ptr(), m.out_features, address(m.bias))

        entry.hidden, entry.heads, entry.kv_heads = c.hidden, c.heads, c.kv_heads
        entry.head_dim, entry.rot_dim, entry.ff = c.head_dim, rot_dim, c.intermediate
        entry.eps, entry.scale = c.rms_eps, c.scale
        entry.act = ACTIVATIONS[c.activation]
        entry.attn_norm = address(block.norms["attn_norm"])
        entry.mlp_norm = address(block.norms["mlp_norm"])
        qkv, gu = block.qkv.linears, block.mlp.gate_up.linears
        entry.nqkv, entry.ngu = len(qkv), len(gu)
        for i, m in enumerate(qkv):
            entry.qkv[i] = mat(m)
        for i, m in enumerate(gu):
            entry.gu[i] = mat(m)
        entry.o, entry.down = mat(block.o), mat(block.mlp.down)

    def run(self, x, caches, positions, start: int, end: int, turns, lone: bool):
        """x [rows, hidden] through model layers [start, end) in one call where layer.c takes
        these rows (`takes`; turns: the span's rotary's {rope: (cos, sin)}), else None."""
        first, layers = start - self.start, end - start
        if self.table is None or not self.takes(caches, positions, first, layers, lone):
            return None
        ((cos, sin),) = turns.values()
        return self.decode(x, caches, positions, first, layers, cos, sin)

    def takes(
        self, caches: list, positions: list[int], first: int, layers: int, lone: bool
    ) -> bool:
        """Whether these rows' caches for table entries [first, first + layers) are layer.c's
        kind: bfloat16, with no row past a layer's slots where blocks.py would not wrap it
        (`lone`: a lone session's step, where only a ring wraps) or where one session has
        several rows (a round: a later row would overwrite a ring slot an earlier row reads;
        blocks.py takes such rounds row by row)."""
        if any(cache.keys[0].dtype != torch.bfloat16 for cache in caches):
            return False
        repeats = len({id(cache) for cache in caches}) < len(caches)
        for cache, pos in zip(caches, positions):
            for keys, ring in zip(cache.keys[:layers], self.rings[first : first + layers]):
                if pos >= keys.shape[2] and (repeats or (lone and not ring)):
                    return False
        return True

    @torch.inference_mode()
    def decode(self, h, caches, positions, first: int, layers: int, cos, sin):
        """h [rows, hidden] -> [rows, hidden] through table entries [first, first + layers),
        row i at positions[i] in caches[i] (whose layers are those entries'); cos, sin [rows,
        rotary dims] of those positions."""
        rows = h.shape[0]
        x = h.to(torch.float32, copy=True).contiguous()
        slots = (_Cache * (layers * rows))()
        for layer in range(layers):
            for r, cache in enumerate(caches):
                k, v = cache.keys[layer], cache.values[layer]
                slots[layer * rows + r] = _Cache(k.data_ptr(), v.data_ptr(), k.shape[2])
        pos = np.asarray(positions, dtype=np.int64)
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        entry = ctypes.addressof(self.table) + first * ctypes.sizeof(_Layer)
        rc = self.lib.lib.swq_layers(
            entry,
            layers,
            x.data_ptr(),
            rows,
            pos.ctypes.data,
            cos.data_ptr(),
            sin.data_ptr(),
            ctypes.addressof(slots),
            torch.get_num_threads(),
        )
        kernels.Kernels._check(rc)
        return x
