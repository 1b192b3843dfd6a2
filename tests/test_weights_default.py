"""The default model's own Q4_1 weights kept quantized: faithful to float32, unchanged by splits."""

from __future__ import annotations

import pytest
import torch

from devtools.launch import start_swarm, stop_all
from swarm.client.client import Client
from swarm.model.blocks import Span
from swarm.model.fidelity import SAMPLE_TEXT, agreement, perplexity, reference_logits, span_logits
from swarm.model.head import Head
from swarm.model.source import open_model

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "What makes a good lighthouse keeper?"}]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def source():
    return open_model(None)


@pytest.fixture(scope="module")
def text_ids(default_reference):
    _model, tok = default_reference
    return tok(SAMPLE_TEXT)["input_ids"]


# int8 rows requantize the file's Q4_1 groups and its Q8_0 head: a format for memory, not
# fidelity. At auto, swarm's kernels take inputs in two int8 terms on AVX-512 VNNI and in one
# (llama.cpp's precision) on AVX2; each is held to its own bar on any machine.
@pytest.mark.parametrize(
    "weights, terms, least_agreement", [("auto", 2, 0.97), ("auto", 1, 0.95), ("int8", None, 0.94)]
)
def test_kept_weights_agree_with_float32_transformers_and_keep_its_perplexity(
    source, default_reference, text_ids, weights, terms, least_agreement
):
    model, _tok = default_reference
    reference = reference_logits(model, text_ids)
    span = Span.load(source, 0, source.config.num_layers, weights=weights, terms=terms)
    logits = span_logits(span, Head.load(source, weights, terms=terms), text_ids)
    rate = agreement(logits, reference)
    ppl, ref_ppl = perplexity(logits, text_ids), perplexity(reference, text_ids)
    print(
        f"{weights}, {terms} term(s): agreement {rate:.3f}, perplexity {ppl:.3f} vs {ref_ppl:.3f}"
    )
    assert rate >= least_agreement
    assert abs(ppl / ref_ppl - 1) <= 0.02


def local_greedy(span: Span, head: Head, ids: list[int], new_tokens: int) -> list[int]:
    cache = span.allocate_cache(span.start, span.end, len(ids) + new_tokens)
    hidden = span.forward(head.embed_tokens(ids), cache, 0, span.start, span.end)
    out = []
    for i in range(new_tokens):
        out.append(int(head.logits(hidden[:, -1]).argmax()))
        hidden = span.forward(
            head.embed_tokens(out[-1:]), cache, len(ids) + i, span.start, span.end
        )
    return out


@pytest.mark.parametrize("spans", [[(0, 15), (15, 30)], [(0, 10), (10, 20), (20, 30)]])
def test_splitting_default_weights_gives_the_unsplit_runs_greedy_tokens(source, spans):
    """Nodes at the default --weights; a float32 wire, so that only the split could differ."""
    ids = source.tokenizer().apply_chat_template(PROMPT, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    span = Span.load(source, 0, source.config.num_layers)
    with torch.inference_mode():
        want = local_greedy(span, Head.load(source), ids, NEW_TOKENS)
    nodes = start_swarm(spans, extra=["--wire-dtype", "float32"])
    try:
        client = Client(nodes[0].maddrs[:1], wire_dtype="float32")
        try:
            got = []
            with client.session(len(ids) + NEW_TOKENS) as s:
                logits = s.feed(ids)
                for _ in range(NEW_TOKENS):
                    got.append(int(logits.argmax()))
                    logits = s.feed(got[-1:])
        finally:
            client.close()
    finally:
        stop_all(nodes)
    assert got == want
