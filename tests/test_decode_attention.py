"""A decode step's attention in swarm's kernels: one query row per head over a bfloat16 cache,
for every instruction set this CPU runs, against torch's attention over the widened cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from swarm.model import kernels
from swarm.model.blocks import Span
from swarm.model.fast_layers import FastLayers
from swarm.model.source import open_model
from tests.helpers.kernels import ISAS, lib_for, needs_kernels
from tests.helpers.scripts import synthetic_gguf

pytestmark = needs_kernels


def cache(kv_heads: int, capacity: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (1, kv_heads, capacity, d)
    return (
        torch.randn(shape, generator=g).bfloat16(),
        torch.randn(shape, generator=g).bfloat16(),
    )


def torch_attention(q, keys, values, seen, scale):
    out = F.scaled_dot_product_attention(
        q[None, :, None],
        keys[:, :, :seen].float(),
        values[:, :, :seen].float(),
        scale=scale,
        enable_gqa=True,
    )
    return out[0, :, 0]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    "kv_heads, group, d",
    [(8, 4, 128), (3, 3, 64), (1, 4, 256), (4, 8, 96), (2, 1, 64), (2, 5, 72)],
    ids=["llama3-8b", "smollm2", "gemma3-270m", "group-8", "no-gqa", "d-off-the-vector"],
)
@pytest.mark.parametrize("seen", [1, 2, 17, 300])
def test_decode_attention_equals_torchs_over_the_widened_cache(isa, kv_heads, group, d, seen):
    lib = lib_for(isa)
    keys, values = cache(kv_heads, seen + 5, d, seed=seen)
    q = torch.randn(kv_heads * group, d) * 3
    scale = d**-0.5
    got = lib.attend(q, keys, values, seen, scale)
    want = torch_attention(q, keys, values, seen, scale)
    assert got.shape == want.shape == (kv_heads * group, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_decode_attention_reads_no_row_past_the_seen_ones(isa):
    lib = lib_for(isa)
    keys, values = cache(2, 40, 64, seed=1)
    q = torch.randn(8, 64)
    want = lib.attend(q, keys, values, 25, 0.125)
    keys[:, :, 25:] = float("nan")
    values[:, :, 25:] = float("inf")
    assert torch.equal(lib.attend(q, keys, values, 25, 0.125), want)


@pytest.mark.parametrize(
    "change, seen",
    [
        ("float32 cache", 4),
        ("values of another shape", 4),
        ("heads not a multiple of the cache's", 4),
        ("query wider than the cache's rows", 4),
        ("nothing seen", 0),
        ("more seen than the cache holds", 11),
    ],
)
def test_decode_attention_refuses_what_it_cannot_compute(change, seen):
    lib = lib_for(ISAS[0])
    keys, values = cache(2, 10, 64, seed=2)
    q = torch.randn(8, 64)
    if change == "float32 cache":
        keys, values = keys.float(), values.float()
    elif change == "values of another shape":
        values = values[:, :, :9].contiguous()
    elif change == "heads not a multiple of the cache's":
        q = torch.randn(7, 64)
    elif change == "query wider than the cache's rows":
        q = torch.randn(8, 80)
    with pytest.raises(kernels.KernelError):
        lib.attend(q, keys, values, seen, 0.125)


def small_span(tmp_path) -> Span:
    shapes = synthetic_gguf.Shapes(
        hidden=256, intermediate=512, heads=4, kv_heads=2, head_dim=64, vocab=512, layers=2
    )
    path = synthetic_gguf.write_synthetic_gguf(tmp_path / "s.Q8_0.gguf", shapes, "Q8_0")
    return Span.load(open_model(path), 0, 2, weights="auto")


def test_a_lone_sessions_step_takes_the_kernels_attention_as_a_batched_one(tmp_path, monkeypatch):
    """Span.forward of one token (a node's step of a session decoding alone) gives what
    Span.decode gives that session, to the bit, and torch's attention within float rounding."""
    span = small_span(tmp_path)
    torch.manual_seed(1)
    prompt, steps = torch.randn(1, 30, 256), torch.randn(4, 1, 1, 256)
    outs = {}
    for way in ("forward", "decode", "torch"):
        cache = span.allocate_cache(0, 2, 40)
        span.forward(prompt, cache, 0, 0, 2)
        rows = []
        for i, x in enumerate(steps):
            if way == "decode":
                rows.append(span.decode(x[0], [cache], [30 + i], 0, 2).view(1, 1, -1))
            else:
                rows.append(span.forward(x, cache, 30 + i, 0, 2))
        outs[way] = torch.cat(rows)
        if way == "decode":
            from swarm.model import blocks

            monkeypatch.setattr(blocks.kernels, "load", lambda isa=None: None)
            monkeypatch.setattr(span, "fast", FastLayers(0))  # blocks.py's own path
    assert torch.equal(outs["forward"], outs["decode"])
    assert not torch.equal(outs["forward"], outs["torch"])  # the kernels did take it
    torch.testing.assert_close(outs["forward"], outs["torch"], rtol=1e-4, atol=1e-4)


def test_batched_decode_through_the_kernels_matches_torchs_attention(tmp_path, monkeypatch):
    """Span.decode of three sessions at different depths, bfloat16 caches: the kernels' attention
    against the same steps with torch's (kernels.load() returning None for attention only), in
    blocks.py's layer by layer path (the one layers that are not plain take)."""
    span = small_span(tmp_path)
    span.fast = FastLayers(0)
    lengths = [1, 9, 40]

    def run() -> torch.Tensor:
        torch.manual_seed(0)
        caches = [span.allocate_cache(0, 2, 64) for _ in lengths]
        assert caches[0].keys[0].dtype == torch.bfloat16
        for c, n in zip(caches, lengths):
            span.forward(torch.randn(1, n, 256), c, 0, 0, 2)
        steps = []
        for i in range(3):
            positions = [n + i for n in lengths]
            steps.append(span.decode(torch.randn(3, 256), caches, positions, 0, 2))
        return torch.stack(steps)

    calls = []
    attend = kernels.Kernels.attend
    monkeypatch.setattr(
        kernels.Kernels, "attend", lambda self, *a: calls.append(a[3]) or attend(self, *a)
    )
    with_kernels = run()
    # rows seen, 2 layers; the 1-token session's prompt is a step of its own
    assert sorted(calls) == sorted([1, 2, 3, 4, 10, 11, 12, 41, 42, 43] * 2)
    from swarm.model import blocks

    monkeypatch.setattr(blocks.kernels, "load", lambda isa=None: None)
    with_torch = run()
    torch.testing.assert_close(with_kernels, with_torch, rtol=1e-4, atol=1e-4)
