"""A route's first hop holds the embedding table and takes token ids off the wire, so the
client's uplink carries 4 bytes a token where it carried a row of activations: the same
numbers as the client's own embeddings, through real nodes; ids where no embedding is held, or
past the vocabulary, are typed errors and the session goes on."""

from __future__ import annotations

import pytest
import torch

from devtools.launch import start_swarm, stop_all
from swarm.client.client import Client
from swarm.errors import ProtocolError, ShapeMismatch
from swarm.model.tiny import reference_greedy
from swarm.protocol import Hop
from tests.conftest import SPLITS
from tests.helpers.flags import exact_flags

PROMPT = [7, 70, 170, 270, 370, 470, 3, 33]


@pytest.fixture(scope="module")
def swarm(tiny_model_dir):
    nodes = start_swarm(SPLITS[2], model=str(tiny_model_dir), extra=exact_flags(ttl=30))
    client = Client(nodes[0].maddrs[:1], model=str(tiny_model_dir), wire_dtype="float32")
    yield client
    client.close()
    stop_all(nodes)


def opened(client: Client, route: list[Hop], max_length: int = 64):
    remote = client.remote_session(route, max_length)
    client.loop.run(remote.open)
    return remote


def test_the_first_hop_says_it_embeds_and_a_later_hop_does_not(swarm):
    route = swarm.route()
    assert opened(swarm, route).embeds
    assert not opened(swarm, route[1:]).embeds  # a session opened at blocks 3:6 first


def test_ids_alone_give_what_the_clients_own_embeddings_give(swarm):
    route = swarm.route()
    by_ids, by_rows = opened(swarm, route), opened(swarm, route)
    rows = swarm.head(route).embed_tokens(PROMPT)
    got = swarm.loop.run(by_ids.step, None, PROMPT)
    want = swarm.loop.run(by_rows.step, rows, None)
    assert torch.equal(got, want)
    step = swarm.head(route).embed_tokens([5])
    assert torch.equal(swarm.loop.run(by_ids.step, None, [5]), swarm.loop.run(by_rows.step, step))


def test_a_session_fed_by_ids_generates_the_models_greedy_tokens(swarm, tiny_reference):
    out = []
    with swarm.session(len(PROMPT) + 12) as s:
        logits = s.feed(PROMPT)
        assert s.remote.embeds
        for _ in range(12):
            out.append(int(logits.argmax()))
            logits = s.feed([out[-1]])
    assert out == reference_greedy(tiny_reference, PROMPT, 12)


def test_ids_to_a_hop_without_the_table_are_refused_and_the_session_goes_on(swarm):
    route = swarm.route()
    remote = opened(swarm, route[1:])
    remote.embeds = True  # as a client that ignored the open's answer would send
    with pytest.raises(ProtocolError, match="first hop"):
        swarm.loop.run(remote.step, None, PROMPT)
    rows = torch.randn(1, len(PROMPT), swarm.config.hidden)
    assert swarm.loop.run(remote.step, rows).shape == (1, swarm.config.hidden)


def test_an_id_past_the_vocabulary_is_refused_and_the_session_goes_on(swarm):
    remote = opened(swarm, swarm.route())
    with pytest.raises(ShapeMismatch, match="vocabulary"):
        swarm.loop.run(remote.step, None, [3, swarm.config.vocab + 5])
    assert swarm.loop.run(remote.step, None, PROMPT).shape == (1, swarm.config.hidden)
