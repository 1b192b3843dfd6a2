"""Nodes die, hang or leave mid-generation; the client reroutes, replays; the text is unchanged."""

from __future__ import annotations

import os
import signal

import pytest

from devtools.launch import start_swarm, stop_all
from swarm.client.client import Client
from swarm.errors import RouteUnavailable
from tests.conftest import reference_greedy
from tests.helpers.flags import exact_flags

PROMPT = [11, 22, 33, 44, 55, 66, 77]
NEW = 30


@pytest.fixture
def redundant_swarm(tiny_model_dir):
    """Every block served twice: 0:3 twice and 3:6 twice."""
    nodes = start_swarm(
        [(0, 3), (0, 3), (3, 6), (3, 6)],
        model=str(tiny_model_dir),
        extra=[*exact_flags(ttl=20), "--grace", "3"],
    )
    yield nodes
    for n in nodes:
        if n.proc.poll() is None:
            os.kill(n.pid, signal.SIGCONT)
    stop_all(nodes)


@pytest.fixture
def client(redundant_swarm, tiny_model_dir):
    c = Client(
        redundant_swarm[0].maddrs[:1],
        model=str(tiny_model_dir),
        wire_dtype="float32",
        step_timeout=3.0,
    )
    yield c
    c.close()


def generate_with_fault(client: Client, nodes, fault, at: int = 10, hop: int = 1):
    """Greedy decode; at token `at`, apply `fault` to the node serving route hop `hop`."""
    by_peer = {n.peer: n for n in nodes}
    out = []
    with client.session(len(PROMPT) + NEW) as s:
        logits = s.feed(PROMPT)
        for i in range(NEW):
            if i == at:
                fault(by_peer[s.remote.route[hop].peer])
            out.append(int(logits.argmax()))
            logits = s.feed([out[-1]])
        return out, s


@pytest.mark.parametrize("hop", [0, 1])
def test_generation_survives_kill_9_of_a_node_on_the_route(
    client, redundant_swarm, tiny_reference, hop
):
    out, session = generate_with_fault(client, redundant_swarm, lambda n: n.proc.kill(), hop=hop)
    assert out == reference_greedy(tiny_reference, PROMPT, NEW)
    assert len(session.recoveries) == 1


def test_generation_survives_a_hung_node(client, redundant_swarm, tiny_reference):
    out, session = generate_with_fault(
        client, redundant_swarm, lambda n: os.kill(n.pid, signal.SIGSTOP), hop=1
    )
    assert out == reference_greedy(tiny_reference, PROMPT, NEW)
    assert len(session.recoveries) == 1


def test_sigterm_lets_open_sessions_finish_and_new_ones_go_elsewhere(
    client, redundant_swarm, tiny_reference
):
    """A polite leave: the open session keeps its route; a new session avoids the leaving node."""
    by_peer = {n.peer: n for n in redundant_swarm}
    out = []
    with client.session(len(PROMPT) + NEW) as s:
        logits = s.feed(PROMPT)
        leaving = by_peer[s.remote.route[0].peer]
        for i in range(NEW):
            if i == 5:
                leaving.proc.send_signal(signal.SIGTERM)
            out.append(int(logits.argmax()))
            logits = s.feed([out[-1]])
        assert s.recoveries == []
    assert out == reference_greedy(tiny_reference, PROMPT, NEW)
    assert leaving.proc.wait(30) == 0
    # routes drawn within RECORDS_FRESH_S share one read: this one reads the DHT afresh, as a
    # session opened a second later would (one drawn sooner meets a refusal and reroutes)
    client.recent_nodes(max_age=0)
    assert leaving.peer not in {h.peer for h in client.route()}


def test_no_replacement_gives_a_clear_error_naming_the_blocks(client, redundant_swarm):
    def kill_both_tail_nodes(_node):
        for n in redundant_swarm[2:]:
            n.proc.kill()

    with pytest.raises(RouteUnavailable, match=r"blocks 3:6"):
        generate_with_fault(client, redundant_swarm, kill_both_tail_nodes, hop=1)
