"""Mixtures of experts (Mixtral, Qwen3-MoE, Qwen2-MoE) give transformers' own tokens: tiny
random models of 8 experts (swarm.model.tiny), from safetensors and from GGUF files with the
experts stacked in 3-D tensors, split 2 and 3 ways at float32; batched sessions each get their
own tokens; a pass touches only the experts its rows chose."""

from __future__ import annotations

import pytest
import torch

from devtools.hf_to_gguf import write_gguf
from devtools.launch import start_swarm, stop_all
from swarm.client.client import Client
from swarm.model.blocks import Span
from swarm.model.source import open_model
from swarm.model.tiny import MOE_FAMILIES, reference_greedy, save_tiny
from tests.conftest import split_greedy, swarm_greedy

PROMPT = [(11 * i + 5) % 500 + 5 for i in range(30)]
NEW_TOKENS = 40
SPLITS = {2: [(0, 3), (3, 6)], 3: [(0, 2), (2, 4), (4, 6)]}
FLAGS = ["--weights", "float32", "--wire-dtype", "float32", "--announce-ttl", "10"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """family -> (reference model, safetensors folder, GGUF path, reference tokens)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            folder = tmp_path_factory.mktemp(family)
            model = save_tiny(family, folder)
            gguf = write_gguf(folder, tmp_path_factory.mktemp("gguf") / f"{family}.gguf")
            cache[family] = model, folder, gguf, reference_greedy(model, PROMPT, NEW_TOKENS)
        return cache[family]

    return get


@pytest.mark.parametrize("ways", [2, 3])
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_split_mixture_gives_transformers_greedy_tokens(made, family, fmt, ways):
    _, folder, gguf, want = made(family)
    path = folder if fmt == "safetensors" else gguf
    assert split_greedy(path, SPLITS[ways], [PROMPT], NEW_TOKENS) == [want]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_four_batched_sessions_each_get_their_own_tokens(made, family):
    model, folder, _, _ = made(family)
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:21], PROMPT[::2]]
    want = [reference_greedy(model, p, 24) for p in prompts]
    assert split_greedy(folder, SPLITS[2], prompts, 24) == want


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_pass_multiplies_only_the_experts_its_rows_chose(made, family):
    _, folder, _, _ = made(family)
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
def test_a_quantized_mixture_holds_about_its_file_bytes(made, family, tmp_path):
    _, folder, _, _ = made(family)
    source = open_model(str(write_gguf(folder, tmp_path / "q8.gguf", qtype="Q8_0")))
    span = Span.load(source, 0, source.config.num_layers, weights="auto")
    in_file = sum(t.nbytes for n, t in source.file.tensors.items() if n.startswith("blk."))
    assert 0.9 * in_file <= span.nbytes <= 1.1 * in_file


@pytest.mark.slow
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_nodes_of_a_mixture_give_transformers_tokens(made, family):
    _, _, gguf, want = made(family)
    nodes = start_swarm(SPLITS[3], model=str(gguf), extra=FLAGS)
    try:
        client = Client(nodes[0].maddrs[:1], model=str(gguf), wire_dtype="float32")
        try:
            assert swarm_greedy(client, PROMPT, NEW_TOKENS) == want
        finally:
            client.close()
    finally:
        stop_all(nodes)


def test_a_mixture_keeps_its_dense_layers_dense(tmp_path):
    model = save_tiny("qwen2_moe", tmp_path, mlp_only_layers=[0, 4])
    config = open_model(str(tmp_path)).config
    assert config.dense_layers == (0, 4)
    want = reference_greedy(model, PROMPT, NEW_TOKENS)
    assert split_greedy(tmp_path, SPLITS[3], [PROMPT], NEW_TOKENS) == [want]
