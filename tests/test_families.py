"""Every family the node computes gives transformers' own tokens: tiny random models of each
(swarm.model.tiny), from their safetensors folder and from a GGUF written the way llama.cpp
writes it (devtools.hf_to_gguf), split 2 and 3 ways at float32, with prompts longer than any
sliding window; batched sessions give each one's tokens alone; every tensor is consumed."""

from __future__ import annotations

import json

import pytest
import torch

from swarm.model.blocks import Block
from swarm.model.source import open_model
from swarm.model.tiny import FAMILIES, reference_greedy
from tests.conftest import (
    FAMILY_NEW_TOKENS,
    FAMILY_PROMPT,
    SPLITS,
    nodes_greedy,
    split_greedy,
)
from tests.helpers.tiny import LLAMA3, YARN

VARIANTS = {
    **{f: (f, {}) for f in FAMILIES},
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3}),
    "llama-yarn": ("llama", {"rope_parameters": YARN}),
    "qwen3-yarn": ("qwen3", {"rope_parameters": YARN}),
}
PROMPT, NEW_TOKENS = FAMILY_PROMPT, FAMILY_NEW_TOKENS


@pytest.fixture(scope="module")
def made(tiny_family):
    """variant -> (reference model, safetensors folder, GGUF path, reference tokens)."""
    return lambda variant: tiny_family(VARIANTS[variant][0], **VARIANTS[variant][1])


@pytest.mark.parametrize("ways", [2, 3])
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_split_gives_transformers_greedy_tokens(made, variant, fmt, ways):
    _, folder, gguf, want = made(variant)
    path = folder if fmt == "safetensors" else gguf
    assert split_greedy(path, SPLITS[ways], [PROMPT], NEW_TOKENS) == [want]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_batched_sessions_each_get_their_own_tokens(made, variant):
    model, folder, _, _ = made(variant)
    prompts = [PROMPT, PROMPT[:7], PROMPT[5:26]]  # inside and past the window, at once
    want = [reference_greedy(model, p, 24) for p in prompts]
    assert split_greedy(folder, SPLITS[2], prompts, 24) == want


def file_tensors(source, block: int) -> set[str]:
    """The names the file holds for one block, read apart from the loader."""
    if hasattr(source, "file"):
        return {n for n in source.file.tensors if n.startswith(f"blk.{block}.")}
    from safetensors import safe_open

    names = set()
    for f in source.path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            names |= {n for n in st.keys() if n.startswith(f"model.layers.{block}.")}
    return names


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_tensor_of_every_block_is_consumed(made, variant, fmt):
    _, folder, gguf, _ = made(variant)
    source = open_model(str(folder if fmt == "safetensors" else gguf))
    for block in range(source.config.num_layers):
        raw = source.block_raw(block)
        Block.load(source.config, block, raw, "float32", None)
        assert not raw.unread() and len(raw) == len(file_tensors(source, block))


def test_a_block_with_a_tensor_its_family_does_not_compute_is_refused(made, tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder, _, _ = made("qwen2")
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.4.self_attn.q_norm.weight"] = torch.ones(16)  # Qwen3's, in block 4
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="block 4 .*has self_attn.q_norm.weight"):
        open_model(str(tmp_path))


@pytest.mark.parametrize(
    "change, said",
    [
        ({"model_type": "olmo2"}, "model_type 'olmo2' is not one this node computes"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 4.0}}, "RoPE scaling 'dynamic'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "original_max_position"),
        ({"hidden_act": "relu2"}, "activation 'relu2'"),
    ],
)
def test_what_changes_the_math_and_is_not_built_is_refused_by_name(made, tmp_path, change, said):
    _, folder, _, _ = made("qwen3")
    for f in folder.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=said):
        open_model(str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("fmt, ways", [("safetensors", 3), ("gguf", 2)])
@pytest.mark.parametrize("variant", FAMILIES)
def test_nodes_of_each_family_give_transformers_tokens(made, variant, fmt, ways):
    _, folder, gguf, want = made(variant)
    path = str(folder if fmt == "safetensors" else gguf)
    assert nodes_greedy(path, SPLITS[ways], PROMPT, NEW_TOKENS) == want
