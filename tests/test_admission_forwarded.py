"""Sessions a node forwards to the next hop of their routes count there in their users' shares,
not in the forwarding node's own address's: users on 127.0.0.2, 127.0.0.3, ... open two-hop
sessions through a first node (127.0.0.1) to a second whose share per address is 2."""

from __future__ import annotations

import os

import pytest
import trio

from devtools.launch import NodeProcess, start_node, start_swarm, stop_all
from swarm.model.source import open_model
from swarm.protocol import Error, Open, Opened
from swarm.tls import dial
from swarm.transport import FramedStream
from tests.helpers.flags import exact_flags

FLAGS = exact_flags(threads=1)
SECOND = ["--max-host-sessions", "2", "--max-forwarded-sessions", "4"]


@pytest.fixture
def route(tiny_model_dir):
    """Two nodes, 0:3 and 3:6; the second takes 2 sessions an address, 4 forwarded."""
    model = str(tiny_model_dir)
    [first] = nodes = start_swarm([(0, 3)], model=model, extra=FLAGS)
    try:
        nodes.append(start_node((3, 6), first.maddrs[:1], model=model, extra=[*FLAGS, *SECOND]))
        nodes[1].wait_serving()
        yield first, nodes[1], open_model(model).fingerprint()
    finally:
        stop_all(nodes)


async def open_from(user: str, first: NodeProcess, second: NodeProcess, fingerprint: str):
    """A two-hop session opened from loopback address `user`: the answer, and the connection
    (which holds the session while it is open)."""
    stream = await trio.open_tcp_stream(first.hop().host, first.hop().port, local_address=user)
    conn = FramedStream(await dial(stream, first.tls, first.addr))
    await conn.send(
        Open(
            sid=os.urandom(16).hex(),
            route=(first.hop(), second.hop()),
            hop=0,
            fingerprint=fingerprint,
            wire_dtype="float32",
            max_length=16,
            sink_token="s" * 32,
        )
    )
    with trio.fail_after(30):
        return await conn.receive(), conn


async def open_all(users: list[str], route) -> list:
    answers, conns = [], []
    try:
        for user in users:  # one after another: the second node sees them in this order
            answer, conn = await open_from(user, *route)
            answers.append(answer)
            conns.append(conn)
    finally:
        for conn in conns:
            await conn.aclose()
    return answers


@pytest.mark.slow
async def test_users_behind_a_forwarding_node_each_get_their_own_share(route):
    users = [f"127.0.0.{i}" for i in range(2, 6)]  # 4 sessions: twice one address's share
    answers = await open_all(users, route)
    assert [type(a) for a in answers] == [Opened] * 4


@pytest.mark.slow
async def test_what_one_node_forwards_is_capped_all_users_together(route):
    users = [f"127.0.0.{i}" for i in range(2, 7)]
    answers = await open_all(users, route)
    assert [type(a) for a in answers] == [Opened] * 4 + [Error]
    assert answers[-1].code == "busy" and "forwarding its users' sessions" in answers[-1].message
