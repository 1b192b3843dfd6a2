"""Mixtures of experts (Mixtral, Qwen3-MoE, Qwen2-MoE) give transformers' own tokens: tiny
random models of 8 experts (swarm.model.tiny), from safetensors and from GGUF files with the
experts stacked in 3-D tensors, split 2 and 3 ways at float32; batched sessions each get their
own tokens; a pass touches only the experts its rows chose."""

from __future__ import annotations

import pytest
import torch

from devtools.hf_to_gguf import write_gguf
from swarm.model.blocks import Span
from swarm.model.source import open_model
from swarm.model.tiny import MOE_FAMILIES, reference_greedy, save_tiny
from tests.conftest import (
    FAMILY_NEW_TOKENS,
    FAMILY_PROMPT,
    SPLITS,
    nodes_greedy,
    split_greedy,
)

PROMPT, NEW_TOKENS = FAMILY_PROMPT, FAMILY_NEW_TOKENS


@pytest.mark.parametrize("ways", [2, 3])
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_split_mixture_gives_transformers_greedy_tokens(tiny_family, family, fmt, ways):
    _, folder, gguf, want = tiny_family(family)
    path = folder if fmt == "safetensors" else gguf
    assert split_greedy(path, SPLITS[ways], [PROMPT], NEW_TOKENS) == [want]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_four_batched_sessions_each_get_their_own_tokens(tiny_family, family):
    model, folder, _, _ = tiny_family(family)
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:21], PROMPT[::2]]
    want = [reference_greedy(model, p, 24) for p in prompts]
    assert split_greedy(folder, SPLITS[2], prompts, 24) == want


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_pass_multiplies_only_the_experts_its_rows_chose(tiny_family, family):
    _, folder, _, _ = tiny_family(family)
    span = Span.load(open_model(str(folder)), 0, 1, weights="float32")
    mlp = span.blocks[0].mlp
    called = []

    def counted(e, expert):
        return lambda x: called.append((e, len(x))) or expert(x)

    mlp.experts = [counted(e, expert) for e, expert in enumerate(mlp.experts)]
    x = torch.randn(3, span.config.hidden)
    mlp(x)
    chosen = torch.topk(mlp.router(x), span.config.experts_used, dim=-1).indices
    assert sorted(e for e, _ in called) == sorted(set(chosen.flatten().tolist()))
    assert sum(rows for _, rows in called) == chosen.numel()  # each row once per choice


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_quantized_mixture_holds_about_its_file_bytes(tiny_family, family, tmp_path):
    _, folder, _, _ = tiny_family(family)
    source = open_model(str(write_gguf(folder, tmp_path / "q8.gguf", qtype="Q8_0")))
    span = Span.load(source, 0, source.config.num_layers, weights="auto")
    in_file = sum(t.nbytes for n, t in source.file.tensors.items() if n.startswith("blk."))
    assert 0.9 * in_file <= span.nbytes <= 1.1 * in_file


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_nodes_of_a_mixture_give_transformers_tokens(tiny_family, family):
    _, _, gguf, want = tiny_family(family)
    assert nodes_greedy(gguf, SPLITS[3], PROMPT, NEW_TOKENS) == want


def test_a_mixture_keeps_its_dense_layers_dense(tmp_path):
    model = save_tiny("qwen2_moe", tmp_path, mlp_only_layers=[0, 4])
    config = open_model(str(tmp_path)).config
    assert config.dense_layers == (0, 4)
    want = reference_greedy(model, PROMPT, NEW_TOKENS)
    assert split_greedy(tmp_path, SPLITS[3], [PROMPT], NEW_TOKENS) == [want]
