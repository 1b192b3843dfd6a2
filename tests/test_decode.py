"""The lean decode path (issue 27): fused projections, the rotary table, GQA attention over the
cache without copies, and one pass for the decode steps of several sessions."""

from __future__ import annotations

import pytest
import torch

from swarm.model.blocks import Span
from swarm.model.rope import Rotary
from swarm.model.source import open_model
from swarm.model.weights import make_linear

FORMATS = ["float32", "bfloat16", "int8", "int4"]


@pytest.mark.parametrize("weights", FORMATS)
def test_fused_projections_hold_each_matrix_as_it_would_be_held_alone(tiny_model_dir, weights):
    source = open_model(str(tiny_model_dir))
    raw = source.block_raw(0)
    block = Span.load(source, 0, 1, weights=weights).blocks[0]
    for fused, names in (
        (block.qkv, ("q", "k", "v")),
        (block.mlp.gate_up, ("gate", "up")),
    ):
        assert len(fused.linears) == 1 and fused.linears[0].matrices == len(names)
        alone = torch.cat([make_linear(raw[n], weights).dequantized() for n in names])
        assert torch.equal(fused.linears[0].dequantized(), alone)


@pytest.mark.parametrize("weights", FORMATS)
def test_a_fused_projection_multiplies_as_its_parts_do(tiny_model_dir, weights):
    source = open_model(str(tiny_model_dir))
    raw = source.block_raw(0)
    block = Span.load(source, 0, 1, weights=weights).blocks[0]
    x = torch.randn(3, source.config.hidden)
    want = torch.cat([make_linear(raw[n], weights)(x) for n in ("q", "k", "v")], -1)
    torch.testing.assert_close(block.qkv(x).float(), want.float(), rtol=1e-2, atol=1e-2)


def test_the_rotary_table_gives_transformers_cos_and_sin_at_every_position(tiny_model_dir):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    reference = LlamaRotaryEmbedding(LlamaConfig.from_pretrained(tiny_model_dir))
    config = open_model(str(tiny_model_dir)).config
    head_dim = config.head_dim
    rotary = Rotary(config.rope, head_dim)
    positions = torch.arange(0, 700)  # past the table's first size: it grows
    want_cos, want_sin = reference(torch.zeros(1, 1, head_dim), positions[None])
    cos, sin = rotary.cos_sin(0, 700)
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    cos, sin = rotary.at([5, 699, 0])
    assert torch.equal(cos, want_cos[0, [5, 699, 0]])


def test_one_decode_pass_for_several_sessions_computes_what_each_computes_alone(tiny_model_dir):
    span = Span.load(open_model(str(tiny_model_dir)), 0, 6, weights="float32")
    hidden = span.config.hidden
    prompts = [torch.randn(1, n, hidden) for n in (3, 17, 9)]
    steps = torch.randn(len(prompts), hidden)

    def primed():
        caches = [span.allocate_cache(0, 6, 32) for _ in prompts]
        for cache, prompt in zip(caches, prompts):
            span.forward(prompt, cache, 0, 0, 6)
        return caches

    alone = [
        span.forward(steps[i].view(1, 1, -1), cache, cache.length, 0, 6).view(-1)
        for i, cache in enumerate(primed())
    ]
    caches = primed()
    together = span.decode(steps, caches, [c.length for c in caches], 0, 6)
    torch.testing.assert_close(together, torch.stack(alone), rtol=1e-5, atol=1e-5)
    assert [c.length for c in caches] == [4, 18, 10]


def test_a_decode_pass_writes_each_sessions_cache_at_its_own_position(tiny_model_dir):
    span = Span.load(open_model(str(tiny_model_dir)), 0, 2, weights="float32")
    caches = [span.allocate_cache(0, 2, 8) for _ in range(2)]
    span.forward(torch.randn(1, 3, span.config.hidden), caches[1], 0, 0, 2)
    span.decode(torch.randn(2, span.config.hidden), caches, [0, 3], 0, 2)
    assert (
        caches[0].keys[0][0, :, 0].abs().sum() > 0 and caches[0].keys[0][0, :, 1:].abs().sum() == 0
    )
    assert (
        caches[1].keys[1][0, :, 3].abs().sum() > 0 and caches[1].keys[1][0, :, 4:].abs().sum() == 0
    )
