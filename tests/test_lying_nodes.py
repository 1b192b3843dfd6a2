"""Routes follow what the client finds, not what a record claims: a node announcing blocks it
does not serve is left out after its first refusal, and forged records cannot aim a client's
dials at every port of a host."""

from __future__ import annotations

import pytest

from devtools.launch import stop_all
from swarm.client.client import Client
from swarm.client.routing import MAX_PER_ADDRESS, MAX_PER_HOST, bounded
from swarm.records import NodeRecord
from tests.conftest import reference_greedy, swarm_greedy
from tests.helpers.flags import exact_flags
from tests.helpers.liars import honest_and_liar
from tests.helpers.records import node_record

FLAGS = exact_flags(ttl=10)
PROMPT = [5, 50, 150, 250]


@pytest.mark.slow
def test_a_node_announcing_blocks_it_does_not_serve_is_left_out(tiny_model_dir, tiny_reference):
    """The liar serves 0:3 but announces 0:6 at a huge throughput: one hop through it looks
    cheaper than two honest ones, so routes draw it among the near-best, and the session that
    tries it gets SpanError, reroutes, and leaves it out from then on."""
    model = str(tiny_model_dir)
    lie = {"LIE_END": 6, "LIE_THROUGHPUT": 1e9}
    nodes = honest_and_liar(model, [(0, 3), (3, 6)], (0, 3), FLAGS, **lie)
    peers = nodes[0].maddrs[:1]
    try:
        client = Client(peers, model=model, wire_dtype="float32")
        try:
            liar, reference = nodes[2].peer, reference_greedy(tiny_reference, PROMPT, 6)
            for _ in range(20):  # sessions until one is drawn through the liar
                assert swarm_greedy(client, PROMPT, 6) == reference
                if liar in client.shunned:
                    break
            else:
                pytest.fail("no session tried the node announcing blocks it does not serve")
            assert all(liar not in {h.peer for h in client.route()} for _ in range(5))
        finally:
            client.close()
    finally:
        stop_all(nodes)


def rec(peer: str, addr: str) -> NodeRecord:
    return node_record(peer, 0, 6, addr=addr)


def test_forged_records_at_one_address_are_dialled_a_few_at_most():
    forged = [rec(f"forged{i:02d}", "10.0.0.5:7000") for i in range(50)]
    assert len(bounded(forged)) == MAX_PER_ADDRESS


def test_forged_records_across_a_hosts_ports_are_dialled_a_few_at_most():
    forged = [rec(f"forged{i:02d}", f"10.0.0.5:{7000 + i}") for i in range(50)]
    assert len(bounded(forged)) == MAX_PER_HOST


def test_nodes_that_answered_before_keep_their_place_among_forged_ones():
    honest = rec("honest", "10.0.0.5:9000")
    forged = [rec(f"forged{i:02d}", f"10.0.0.5:{7000 + i}") for i in range(50)]
    assert honest in bounded([*forged, honest], known={"honest"})


@pytest.mark.slow
def test_a_node_claiming_a_throughput_it_lacks_loses_its_routes_once_measured(tiny_model_dir):
    """The liar serves 0:6 but takes 50 ms a pass while announcing 1e9 tokens/s: its claim draws
    a session; after that session's decode steps the client routes by what it measured."""
    model = str(tiny_model_dir)
    lie = {"LIE_THROUGHPUT": 1e9, "LIE_SLOW_S": 0.05}
    nodes = honest_and_liar(model, [(0, 6)], (0, 6), FLAGS, **lie)
    honest, peers = nodes[0], nodes[0].maddrs[:1]
    try:
        client = Client(peers, model=model, wire_dtype="float32")
        liar = nodes[1].peer
        try:
            for _ in range(10):  # sessions until the lie draws one (round trips vary under load)
                with client.session(16) as s:
                    logits = s.feed(PROMPT)
                    for _ in range(4):  # decode steps, which the client times
                        logits = s.feed([int(logits.argmax())])
                    if [h.peer for h in s.remote.route] == [liar]:
                        break
            else:
                pytest.fail("no session went through the node claiming 1e9 tokens/s")
            assert [[h.peer for h in client.route()] for _ in range(3)] == [[honest.peer]] * 3
        finally:
            client.close()
    finally:
        stop_all(nodes)
