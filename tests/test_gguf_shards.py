"""A model in llama.cpp's gguf-split shards: each process holds the first shard (the metadata)
and those with its own tensors; every process is told by name which shard it lacks.

The default model is written as 3 shards by devtools/gguf_split.py in block order: shard 1
holds the embeddings, blocks 0-9 and part of block 10; shard 2 the rest of 10 and 11-20;
shard 3 blocks 21-29 and the final norm (the model ties its head to the embeddings)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from devtools.gguf_split import split_gguf
from devtools.launch import start_node, stop_all
from swarm.client.client import Client
from swarm.errors import MissingShards
from swarm.model.blocks import Span
from swarm.model.gguf_file import GGUFFile
from swarm.model.head import Head
from swarm.model.source import default_model_path, open_model
from tests.conftest import reference_greedy, swarm_greedy
from tests.helpers.flags import exact_flags

SPANS = {"a": (0, 10), "b": (10, 21), "c": (21, 30)}
HOLDS = {"a": (1,), "b": (1, 2), "c": (1, 3)}  # the shards each span needs, with the metadata


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[Path]:
    return split_gguf(default_model_path(), tmp_path_factory.mktemp("shards"), max_tensors=95)


@pytest.fixture(scope="module")
def folders(shards, tmp_path_factory) -> dict[str, Path]:
    """Each span's own folder with only the shards it needs: its --model (the first shard)."""
    out = {}
    for name, numbers in HOLDS.items():
        folder = tmp_path_factory.mktemp(f"node-{name}")
        for k in numbers:
            os.link(shards[k - 1], folder / shards[k - 1].name)
        out[name] = folder / shards[0].name
    return out


def test_only_the_first_shard_holds_the_metadata_and_every_one_the_split_keys(shards):
    files = [GGUFFile(p) for p in shards]
    whole = GGUFFile(default_model_path())
    assert [f.fields["split.no"] for f in files] == [0, 1, 2]
    assert {f.fields["split.count"] for f in files} == {3}
    assert {f.fields["split.tensors.count"] for f in files} == {len(whole.tensors)}
    assert files[0].fields["general.architecture"] == "llama"
    assert [set(f.fields) for f in files[1:]] == [
        {"split.no", "split.count", "split.tensors.count"}
    ] * 2
    assert sum(len(f.tensors) for f in files) == len(whole.tensors)


def test_a_span_is_read_from_the_shards_holding_its_tensors(shards):
    source = open_model(str(shards[0]))
    assert source.block_files(0, 10) == shards[:1]
    assert source.block_files(10, 21) == shards[:2]
    assert source.block_files(21, 30) == shards[2:]
    assert source.block_files(9, 22) == shards


def test_any_shard_opens_the_model_under_its_name_without_the_shard_number(shards):
    whole = open_model(None)
    source = open_model(str(shards[1]))
    assert source.path == shards[0]
    assert source.config == whole.config


def test_nodes_holding_different_shards_agree_on_the_fingerprint(folders, shards):
    prints = {open_model(str(path)).fingerprint() for path in folders.values()}
    assert prints == {open_model(str(shards[2])).fingerprint()}
    assert prints != {open_model(None).fingerprint()}  # the unsplit file is another swarm's


def test_a_span_whose_shard_is_missing_is_refused_naming_it(folders, shards):
    source = open_model(str(folders["c"]))  # shards 1 and 3
    with pytest.raises(MissingShards, match=shards[1].name) as err:
        Span.load(source, 9, 11, weights="float32")
    assert err.value.files == (str(folders["c"].parent / shards[1].name),)


def test_without_the_first_shard_the_model_is_refused_naming_it(shards, tmp_path):
    os.link(shards[1], tmp_path / shards[1].name)
    with pytest.raises(MissingShards, match=shards[0].name):
        open_model(str(tmp_path / shards[1].name))


def test_the_head_needs_only_the_shards_with_the_embeddings_and_the_final_norm(folders):
    ids = [1, 42, 4898, 314]
    x = torch.randn(1, 576)
    whole = Head.load(open_model(None), weights="float32")
    head = Head.load(open_model(str(folders["c"])), weights="float32")
    assert torch.equal(head.embed_tokens(ids), whole.embed_tokens(ids))
    assert torch.equal(head.logits(x), whole.logits(x))
    with pytest.raises(MissingShards, match="output_norm.weight"):
        Head.load(open_model(str(folders["b"])), weights="float32")


def test_a_node_started_without_a_shard_its_span_needs_names_it_and_exits(folders, shards):
    out = subprocess.run(
        [sys.executable, "-m", "swarm.node", "--layers", "10:21", "--model", str(folders["a"])],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: blocks 10:21 needs") and shards[1].name in last


@pytest.mark.slow
def test_nodes_holding_only_their_shards_give_the_unsplit_models_text(folders, default_reference):
    model, tok = default_reference
    enc = tok.apply_chat_template(
        [{"role": "user", "content": "Why is the sky blue?"}], add_generation_prompt=True
    )
    ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    want = reference_greedy(model, ids, 24)
    nodes = [start_node(SPANS["a"], model=folders["a"], extra=exact_flags())]
    try:
        nodes[0].wait_serving()
        for name in "bc":
            peers = nodes[0].maddrs[:1]
            nodes.append(start_node(SPANS[name], peers, model=folders[name], extra=exact_flags()))
        for n in nodes[1:]:
            n.wait_serving()
        client = Client(nodes[0].maddrs[:1], model=str(folders["c"]), wire_dtype="float32")
        try:
            assert len(client.route()) == 3
            assert swarm_greedy(client, ids, 24) == want
        finally:
            client.close()
    finally:
        stop_all(nodes)
