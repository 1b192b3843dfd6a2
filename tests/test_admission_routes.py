"""A node forwards an open only to the address the DHT announces for the next hop's peer;
anything else gets a typed error and no outbound connection."""

from __future__ import annotations

import os
import socket

import pytest
import trio

from devtools.launch import NodeProcess
from swarm.protocol import Error, Hop, Open, Opened
from swarm.tls import dial
from swarm.transport import FramedStream


def nodes_by_span(swarm) -> tuple[NodeProcess, NodeProcess]:
    first = next(n for n in swarm if n.layers == (0, 2))
    second = next(n for n in swarm if n.layers == (1, 5))
    return first, second


async def open_through(first: NodeProcess, fingerprint: str, next_hop: Hop):
    """Open a two-hop route from 127.0.0.40 through `first` to `next_hop`: the answer."""
    host, port = first.host_port
    stream = await trio.open_tcp_stream(host, port, local_address="127.0.0.40")
    conn = FramedStream(await dial(stream, first.tls, first.addr))
    await conn.send(
        Open(
            sid=os.urandom(16).hex(),
            route=(Hop(host, port, 0, 2, first.peer, first.tls), next_hop),
            hop=0,
            fingerprint=fingerprint,
            wire_dtype="float32",
            max_length=16,
            sink_token="s" * 32,
        )
    )
    with trio.fail_after(20):
        msg = await conn.receive()
    await conn.aclose()
    return msg


class Listener:
    """A TCP port that counts who connects to it: where a stranger tells a node to dial."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.setblocking(False)

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def accepted(self) -> int:
        n = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1


@pytest.fixture
def listener():
    lst = Listener()
    yield lst
    lst.sock.close()


async def test_an_announced_next_hop_is_opened(tiny_swarm, fingerprint):
    first, second = nodes_by_span(tiny_swarm)
    host, port = second.host_port
    assert isinstance(
        await open_through(first, fingerprint, Hop(host, port, 2, 5, second.peer, second.tls)),
        Opened,
    )


@pytest.mark.parametrize(
    "how",
    [
        "unknown peer",
        "announced peer at another port",
        "announced peer with another TLS key",
        "blocks it does not serve",
        "no peer",
    ],
)
async def test_an_open_naming_an_unannounced_next_hop_is_refused_without_dialing(
    tiny_swarm, fingerprint, listener, how
):
    first, second = nodes_by_span(tiny_swarm)
    key = second.tls
    hop = {
        "unknown peer": Hop("127.0.0.1", listener.port, 2, 5, "QmNobodyAnnouncedThis", key),
        "announced peer at another port": Hop("127.0.0.1", listener.port, 2, 5, second.peer, key),
        "announced peer with another TLS key": Hop(*second.host_port, 2, 5, second.peer, "0" * 64),
        "blocks it does not serve": Hop(*second.host_port, 5, 6, second.peer, key),
        "no peer": Hop("127.0.0.1", listener.port, 2, 5, "", key),
    }[how]
    msg = await open_through(first, fingerprint, hop)
    assert isinstance(msg, Error) and msg.code == "unannounced_peer", msg
    assert msg.hop == 1 and "dials only those" in msg.message
    assert listener.accepted() == 0
