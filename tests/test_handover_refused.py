"""A node takes a handed-over cache only whole, well formed and signed by an announced node of
its weights; anything else is refused with a typed error, and its other sessions go on."""

from __future__ import annotations

import secrets

import pytest
import torch
import trio

from devtools.launch import start_swarm, stop_all
from swarm.client.client import Client
from swarm.dht import sign_as_node
from swarm.node.handover.cache import slab_digest
from swarm.protocol import (
    Error,
    Handover,
    HandoverEnd,
    KvChunk,
    Open,
    Resume,
    StateChunk,
    handover_claim,
)
from swarm.transport import dial_hop
from swarm.wire import pack_tensor
from tests.conftest import reference_greedy
from tests.helpers.flags import exact_flags
from tests.helpers.handover import PROMPTS

LAYERS, WIDTH, LENGTH = 6, 32, 4  # the tiny model: 2 kv heads of 16; a 4-token session


@pytest.fixture(scope="module")
def node(tiny_model_dir):
    [n] = start_swarm([(0, 6)], model=str(tiny_model_dir), extra=exact_flags(ttl=10))
    yield n
    stop_all([n])


@pytest.fixture(scope="module")
def client(node, tiny_model_dir):
    c = Client(node.maddrs[:1], model=str(tiny_model_dir), wire_dtype="float32")
    yield c
    c.close()


def handover(node, client: Client, sid: str) -> Handover:
    opening = Open(
        sid=sid,
        route=(node.hop(),),
        hop=0,
        fingerprint=client.fingerprint,
        wire_dtype="float32",
        max_length=64,
        sink_token="a" * 32,
    )
    return Handover(open=opening, length=LENGTH)


def slab(seed: int, slots: int = LENGTH, width: int = WIDTH) -> torch.Tensor:
    return torch.randn(1, slots, width, generator=torch.Generator().manual_seed(seed))


def chunks(sid: str, pieces) -> list[KvChunk]:
    return [
        KvChunk(sid, layer, first, pack_tensor(k, "float32"), pack_tensor(v, "float32"))
        for layer, (first, k, v) in enumerate(pieces)
    ]


def full_cache() -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    return [(0, slab(2 * i), slab(2 * i + 1)) for i in range(LAYERS)]


async def send_and_read(node, messages) -> list:
    """Send `messages` to `node` on one TLS connection; the errors and answers it sends back,
    then ask it to resume the session: whether it still holds it."""
    conn = await dial_hop(node.hop())
    answers = []
    try:
        for m in messages:
            await conn.send(m)
        with trio.move_on_after(5):
            while (msg := await conn.receive()) is not None:
                answers.append(msg)
                if isinstance(msg, Error):
                    break
        sid = messages[0].open.sid
        await conn.send(Resume(sid, "a" * 32, owner=True, sink=True))
        with trio.move_on_after(5):
            answers.append(await conn.receive())
    finally:
        await conn.aclose()
    return answers


def forge(node, messages) -> list:
    return trio.run(send_and_read, node, messages)


def generate_around(client: Client, tiny_reference, attack) -> None:
    """A session's greedy tokens on the node, `attack()` run half way, are those of an
    undisturbed run."""
    prompt, new = PROMPTS[0], 12
    out = []
    with client.session(len(prompt) + new) as s:
        logits = s.feed(prompt)
        for i in range(new):
            if i == new // 2:
                attack()
            out.append(int(logits.argmax()))
            logits = s.feed([out[-1]])
        assert s.recoveries == []
    assert out == reference_greedy(tiny_reference, prompt, new)


def refused_and_gone(answers) -> None:
    """The handover was refused with its typed error, and the node holds nothing of it."""
    codes = [a.code for a in answers if isinstance(a, Error)]
    assert codes == ["handover_refused", "session_not_found"], answers


def test_a_chunk_of_the_wrong_shape_is_refused_and_other_sessions_go_on(
    node, client, tiny_reference
):
    sid = secrets.token_hex(16)
    bad = KvChunk(
        sid, 0, 0, pack_tensor(slab(0, width=31), "float32"), pack_tensor(slab(1), "float32")
    )
    answers = []
    generate_around(
        client,
        tiny_reference,
        lambda: answers.extend(forge(node, [handover(node, client, sid), bad])),
    )
    refused_and_gone(answers)


def test_a_state_for_a_layer_without_one_is_refused(node, client):
    """The tiny model has no Gated DeltaNet layer: no state of a handed-over session fits."""
    sid = secrets.token_hex(16)
    state = StateChunk(sid, 0, "s", 0, pack_tensor(slab(0), "float32"))
    forged = [handover(node, client, sid), *chunks(sid, full_cache()), state]
    refused_and_gone(forge(node, forged))


def test_a_chunk_past_the_sessions_length_is_refused(node, client):
    sid = secrets.token_hex(16)
    k, v = slab(0, slots=LENGTH + 1), slab(1, slots=LENGTH + 1)
    too_long = KvChunk(sid, 0, 0, pack_tensor(k, "float32"), pack_tensor(v, "float32"))
    refused_and_gone(forge(node, [handover(node, client, sid), too_long]))


def test_a_cache_in_another_dtype_than_the_nodes_is_refused(node, client):
    sid = secrets.token_hex(16)
    k, v = slab(0), slab(1)
    halved = KvChunk(sid, 0, 0, pack_tensor(k, "bfloat16"), pack_tensor(v, "bfloat16"))
    refused_and_gone(forge(node, [handover(node, client, sid), halved]))


def test_an_incomplete_cache_is_refused(node, client):
    sid = secrets.token_hex(16)
    pieces = full_cache()
    digest = slab_digest([pieces])
    key, proof = sign_as_node(handover_claim(node.peer, sid, LENGTH, digest))
    end = HandoverEnd(sid, digest, "f" * 40, key, proof)
    refused_and_gone(forge(node, [handover(node, client, sid), *chunks(sid, pieces[:-1]), end]))


def test_a_cache_signed_by_a_node_the_dht_does_not_announce_is_refused(
    node, client, tiny_reference
):
    """The test process signs with a key of its own, a valid signature for a node id no
    record of the model names: a stranger cannot hand caches over."""
    from swarm.dht import node_id

    sid = secrets.token_hex(16)
    pieces = full_cache()
    digest = slab_digest([pieces])
    key, proof = sign_as_node(handover_claim(node.peer, sid, LENGTH, digest))
    end = HandoverEnd(sid, digest, node_id(), key, proof)
    answers = []
    forged = [handover(node, client, sid), *chunks(sid, pieces), end]
    generate_around(client, tiny_reference, lambda: answers.extend(forge(node, forged)))
    refused_and_gone(answers)


def test_a_proof_for_another_cache_is_refused(node, client):
    from swarm.dht import node_id

    sid = secrets.token_hex(16)
    pieces = full_cache()
    other = slab_digest([[(first, k + 1, v) for first, k, v in pieces]])
    key, proof = sign_as_node(handover_claim(node.peer, sid, LENGTH, other))
    end = HandoverEnd(sid, other, node_id(), key, proof)
    refused_and_gone(forge(node, [handover(node, client, sid), *chunks(sid, pieces), end]))
