"""The default model (SmolLM2-135M-Instruct, GGUF) split across real node processes."""

from __future__ import annotations

import pytest

from devtools.launch import start_node, start_swarm, stop_all
from swarm.client.client import Client
from tests.conftest import reference_greedy, swarm_greedy
from tests.helpers.flags import exact_flags

pytestmark = pytest.mark.slow

PROMPTS = [
    [{"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a haiku about a lighthouse."}],
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def expected(default_reference):
    model, tok = default_reference
    cases = []
    for messages in PROMPTS:
        enc = tok.apply_chat_template(messages, add_generation_prompt=True)
        ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
        cases.append((ids, reference_greedy(model, ids, NEW_TOKENS)))
    return cases


@pytest.mark.parametrize("parts", [2, 3])
def test_float32_wire_gives_the_unsplit_models_greedy_tokens(parts, expected):
    spans = [(0, 15), (15, 30)] if parts == 2 else [(0, 10), (10, 20), (20, 30)]
    nodes = start_swarm(spans, extra=exact_flags())
    try:
        client = Client(nodes[0].maddrs[:1], wire_dtype="float32")
        try:
            assert len(client.route()) == parts
            for ids, want in expected:
                assert swarm_greedy(client, ids, NEW_TOKENS) == want
        finally:
            client.close()
    finally:
        stop_all(nodes)


def test_float16_wire_agrees_with_the_unsplit_model_on_most_positions(expected):
    """Teacher-forced: at each position, does the swarm's argmax equal the reference token?"""
    nodes = start_swarm([(0, 15), (15, 30)])
    try:
        client = Client(nodes[0].maddrs[:1])  # nodes' default 16-bit wire dtype
        agree = total = 0
        try:
            for ids, want in expected:
                with client.session(len(ids) + len(want)) as s:
                    logits = s.feed(ids)
                    for token in want:
                        agree += int(logits.argmax()) == token
                        total += 1
                        logits = s.feed([token])
        finally:
            client.close()
    finally:
        stop_all(nodes)
    rate = agree / total
    print(f"float16 wire agreement: {agree}/{total} = {rate:.3f}")
    assert rate >= 0.9, f"float16 wire agreement {agree}/{total} = {rate:.3f}"


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def file_bytes_per_block() -> float:
    import gguf

    from swarm.model.source import default_model_path

    reader = gguf.GGUFReader(str(default_model_path()))
    blocks = [t for t in reader.tensors if t.name.startswith("blk.")]
    return sum(int(t.n_bytes) for t in blocks) / (
        1 + max(int(t.name.split(".")[1]) for t in blocks)
    )


def test_a_node_holds_its_blocks_in_about_the_files_own_bytes():
    small = start_node((0, 5))
    try:
        small.wait_serving()
        full = start_node((0, 30), small.maddrs[:1])
        try:
            full.wait_serving()
            rss_small, rss_full = rss_mib(small.pid), rss_mib(full.pid)
        finally:
            stop_all([full])
    finally:
        stop_all([small])
    per_block = (rss_full - rss_small) / 25 * 2**20
    file_block = file_bytes_per_block()
    print(
        f"node RSS: 0:5 {rss_small:.0f} MiB, 0:30 {rss_full:.0f} MiB;"
        f" {per_block / file_block:.2f}x the file's bytes a block"
    )
    # float32 blocks would be ~6.4x the Q4_1 file's bytes; packed int4 holds the file's own
    assert 0.5 < per_block / file_block < 1.6
