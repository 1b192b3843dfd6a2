"""Shared fixtures: a tiny random Llama on disk, the default model's unsplit reference, swarms."""

from __future__ import annotations

import pytest
import torch

from devtools.launch import start_swarm, stop_all
from swarm.model.source import open_model
from swarm.model.tiny import reference_greedy, save_tiny_llama, save_tiny_tokenizer
from swarm.process import wait_passively
from tests.helpers.flags import exact_flags

__all__ = [
    "reference_greedy",
    "split_greedy",
    "swarm_greedy",
    "nodes_greedy",
]  # the tests import them from here

wait_passively()  # what the tests start (nodes, liars, scripts) inherits, as from a program


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-weight Llama saved as a Hugging Face safetensors folder, with a tokenizer."""
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path)
    save_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def fingerprint(tiny_model_dir) -> str:
    """The tiny model's fingerprint, as a hand-made Open must name it."""
    return open_model(str(tiny_model_dir)).fingerprint()


@pytest.fixture(scope="session")
def tiny_reference(tiny_model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_reference():
    """The unsplit default model, loaded by transformers from the same GGUF file; its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarm.model.source import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return model, tok


@pytest.fixture(scope="session")
def tiny_swarm(tiny_model_dir):
    """Uneven, overlapping spans of the tiny model: 0:2, 1:5, 4:6. Shared by every module that
    only reads from it (none may stop its nodes): starting three nodes costs seconds each."""
    nodes = start_swarm(
        [(0, 2), (1, 5), (4, 6)],
        model=str(tiny_model_dir),
        # records live 30 s: under a load average of 36 a node refreshing every 3 s at TTL 10
        # fell out of the DHT and a route found its blocks unserved
        extra=exact_flags(ttl=30),
    )
    yield nodes
    stop_all(nodes)


def swarm_greedy(client, ids: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens after `ids` through the swarm, one session, token by token."""
    out = []
    with client.session(len(ids) + new_tokens) as s:
        logits = s.feed(ids)
        for _ in range(new_tokens):
            out.append(int(logits.argmax()))
            logits = s.feed([out[-1]])
    return out


@pytest.fixture(scope="module")
def tiny_client(tiny_swarm, tiny_model_dir):
    """A client of the shared tiny swarm, float32 on the wire."""
    from swarm.client.client import Client

    client = Client(tiny_swarm[0].maddrs[:1], model=str(tiny_model_dir), wire_dtype="float32")
    yield client
    client.close()


def split_greedy(path, spans, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy tokens of several sessions through `spans` in this process, their decode steps
    batched in one pass per span as a node batches them."""
    from swarm.model.blocks import Span
    from swarm.model.head import Head

    source = open_model(str(path))
    head = Head.load(source, weights="float32")
    parts = [Span.load(source, a, b, weights="float32") for a, b in spans]
    caches = [[p.allocate_cache(p.start, p.end, 128) for p in parts] for _ in prompts]
    h = [head.embed_tokens(ids) for ids in prompts]
    for part, i in zip(parts, range(len(parts))):
        h = [
            part.forward(x, c[i], 0, part.start, part.end, ids=ids)
            for x, c, ids in zip(h, caches, prompts)
        ]
    out = [[int(head.logits(x[0, -1]).argmax())] for x in h]
    for _ in range(new_tokens - 1):
        x = torch.cat([head.embed_tokens([toks[-1]])[0] for toks in out])
        positions = [c[0].length for c in caches]
        ids = [toks[-1] for toks in out]  # Gemma 4's per-layer inputs read them
        for part, i in zip(parts, range(len(parts))):
            x = part.decode(x, [c[i] for c in caches], positions, part.start, part.end, ids=ids)
        for toks, row in zip(out, head.logits_rows(x)):
            toks.append(int(row.argmax()))
    return out


# the family tests' shared prompt (past every tiny model's window of 8 or 16) and splits
FAMILY_PROMPT = [(7 * i + 3) % 500 + 5 for i in range(30)]
FAMILY_NEW_TOKENS = 40
SPLITS = {2: [(0, 3), (3, 6)], 3: [(0, 2), (2, 4), (4, 6)]}


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """(family, **config) -> (transformers model, safetensors folder, F32 GGUF written as
    llama.cpp writes it, the model's greedy tokens after FAMILY_PROMPT), made on first use."""
    from devtools.hf_to_gguf import write_gguf
    from swarm.model.tiny import save_tiny, save_tiny_tokenizer

    cache = {}

    def get(family: str, **config):
        key = (family, repr(sorted(config.items())))
        if key not in cache:
            folder = tmp_path_factory.mktemp(family)
            model = save_tiny(family, folder, **config)
            save_tiny_tokenizer(folder)
            gguf = write_gguf(folder, tmp_path_factory.mktemp("gguf") / f"{family}.gguf")
            want = reference_greedy(model, FAMILY_PROMPT, FAMILY_NEW_TOKENS)
            cache[key] = model, folder, gguf, want
        return cache[key]

    return get


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(family, **config) -> (model, its folder, its F32 GGUF file in another folder), made on
    first use; no tokenizer, no reference tokens (`tiny_family` adds them)."""
    from devtools.hf_to_gguf import write_gguf
    from swarm.model.tiny import save_tiny

    made = {}

    def get(family: str, **config):
        key = (family, repr(sorted(config.items())))
        if key not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            model = save_tiny(family, folder, **config)
            path = write_gguf(folder, tmp_path_factory.mktemp("gguf") / f"{family}.gguf")
            made[key] = model, folder, path
        return made[key]

    return get


def nodes_greedy(path, spans, ids: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens after `ids` through real nodes serving `spans` of `path` at float32."""
    from swarm.client.client import Client

    flags = exact_flags(ttl=10)
    nodes = start_swarm(spans, model=str(path), extra=flags)
    try:
        client = Client(nodes[0].maddrs[:1], model=str(path), wire_dtype="float32")
        try:
            return swarm_greedy(client, ids, new_tokens)
        finally:
            client.close()
    finally:
        stop_all(nodes)


@pytest.fixture
def dht_peers():
    """A DHT peer of the test's own that nodes and clients join, so the swarm outlives the
    node that leaves (a client knowing only that node's DHT peer would lose the swarm)."""
    from swarm.dht import start_dht, visible_maddrs

    dht = start_dht()
    yield visible_maddrs(dht)[:1]
    dht.shutdown()
