"""A span's plain layers in one call of swarm's kernels a decode pass (swarm/model/fast_layers.py,
swarm/model/kernels/layer.c): taken for every one-position step, as faithful as blocks.py's
layer by layer path, and the same bits however the rows and threads are arranged."""

from __future__ import annotations

import pytest
import torch

from swarm.model import kernels
from swarm.model.blocks import Block, Span
from swarm.model.fast_layers import FastLayers
from swarm.model.source import open_model
from tests.helpers.kernels import ISAS, as_float32, lib_for, needs_kernels
from tests.helpers.scripts import synthetic_gguf

pytestmark = needs_kernels


def span_of(tmp_path, qtype="Q4_K", weights="auto", **shape) -> Span:
    dims = dict(hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, vocab=512)
    shapes = synthetic_gguf.Shapes(**{**dims, "layers": 3, **shape})
    path = synthetic_gguf.write_synthetic_gguf(tmp_path / f"s.{qtype}.gguf", shapes, qtype)
    return Span.load(open_model(path), 0, shapes.layers, weights=weights)


def steps(span: Span, lengths=(1, 9, 40), count=4, seed=0) -> torch.Tensor:
    """`count` batched steps of sessions with prompts of `lengths` -> [count, rows, hidden]."""
    torch.manual_seed(seed)
    n, hidden = span.end, span.config.hidden
    caches = [span.allocate_cache(0, n, 64) for _ in lengths]
    for cache, length in zip(caches, lengths):
        span.forward(torch.randn(1, length, hidden), cache, 0, 0, n)
    out = []
    for i in range(count):
        positions = [length + i for length in lengths]
        out.append(span.decode(torch.randn(len(lengths), hidden), caches, positions, 0, n))
    return torch.stack(out)


def test_a_plain_span_decodes_without_blocks_layer_by_layer_path(tmp_path, monkeypatch):
    span = span_of(tmp_path)
    assert span.fast.table is not None

    def refuse(*a, **k):
        raise AssertionError("a plain layer's step took blocks.py's path")

    monkeypatch.setattr(Block, "decode", refuse)
    monkeypatch.setattr(Block, "forward", refuse)
    cache = span.allocate_cache(0, 3, 8)
    out = span.forward(torch.randn(1, 1, 256), cache, 0, 0, 3)  # a lone session's step
    assert out.shape == (1, 1, 256) and cache.length == 1
    out = span.decode(torch.randn(1, 256), [cache], [1], 0, 3)
    assert out.shape == (1, 256) and cache.length == 2


@pytest.mark.parametrize("qtype", ["Q4_K", "Q8_0", "Q4_1"])
@pytest.mark.parametrize("isa", ISAS)
def test_one_call_is_as_faithful_as_blocks_path(tmp_path, monkeypatch, qtype, isa):
    """Both paths quantize each matmul's input to int8 the same way; against the float32
    weights they err alike (their roundings of norms and rotary differ in the last bits). On
    every instruction set this CPU runs (an AVX2-only machine's path too)."""
    lib = lib_for(isa)
    monkeypatch.setattr(kernels, "load", lambda isa_=None: lib)
    span = span_of(tmp_path, qtype)
    assert span.fast.lib.isa == isa
    fast = steps(span)
    exact = steps(as_float32(span))
    span.fast = FastLayers(0)
    layered = steps(span)
    fast_err = (fast - exact).norm() / exact.norm()
    layered_err = (layered - exact).norm() / exact.norm()
    assert 0 < fast_err < 1.25 * layered_err + 1e-4, (fast_err, layered_err)
    assert not torch.equal(fast, layered)  # the two paths did run


def test_a_rounds_rows_are_the_plain_steps_bit_for_bit(tmp_path):
    """A verification round (one session's consecutive positions as rows of one pass) gives
    what a lone session's steps one at a time give, to the bit: speculation stays exact."""
    span = span_of(tmp_path)
    torch.manual_seed(3)
    prompt, rows = torch.randn(1, 12, 256), torch.randn(4, 256)
    one_by_one, round_ = span.allocate_cache(0, 3, 32), span.allocate_cache(0, 3, 32)
    for cache in (one_by_one, round_):
        span.forward(prompt, cache, 0, 0, 3)
    alone = torch.cat(
        [span.forward(r.view(1, 1, -1), one_by_one, 12 + i, 0, 3)[0] for i, r in enumerate(rows)]
    )
    together = span.decode(rows, [round_] * 4, [12, 13, 14, 15], 0, 3)
    assert torch.equal(alone, together)
    assert all(torch.equal(a, b) for a, b in zip(one_by_one.keys, round_.keys))


def test_two_threads_give_one_threads_bits(tmp_path):
    """Layers big enough to share out (over 1e7 multiply-adds a row): the same bits on 2
    threads as on 1, since each unit of work is computed whole by one thread."""
    span = span_of(tmp_path, hidden=1024, intermediate=2816, heads=8, kv_heads=2, head_dim=128)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = steps(span, lengths=(3, 50))
        torch.set_num_threads(2)
        two = steps(span, lengths=(3, 50))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_a_span_of_some_part_of_the_layers_runs_that_part(tmp_path):
    """Blocks [1, 3) of a 3-block span: the table's entries from the second on."""
    span = span_of(tmp_path)
    torch.manual_seed(4)
    prompt, x = torch.randn(1, 5, 256), torch.randn(1, 1, 256)
    outs = []
    for fast in (span.fast, FastLayers(0)):
        span.fast = fast
        cache = span.allocate_cache(1, 3, 16)
        span.forward(prompt, cache, 0, 1, 3)
        outs.append(span.forward(x, cache, 5, 1, 3))
    torch.testing.assert_close(outs[0], outs[1], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("weights", ["float32", "int8"])
def test_layers_off_swarms_kernels_keep_blocks_path(tmp_path, weights):
    """float32 (the exact mode, its cache float32) and torch's int8 kernels: no table."""
    assert span_of(tmp_path, weights=weights).fast.table is None
