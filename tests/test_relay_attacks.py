"""A stranger speaking the relay's plaintext requests cannot end a node or pin its connections.

Every direct TLS node runs a relay hub, so anyone who can reach its port can register a made-up
peer, splice to it, and answer the splice with as many `accept`s for its token as they like.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from devtools.launch import start_node
from swarm.address import parse_host_port
from swarm.errors import ProtocolError
from swarm.node.config import NodeConfig
from swarm.node.directory import PeerDirectory
from swarm.node.server import Node
from swarm.protocol import Hop, Relay
from swarm.relay import RelayHub
from swarm.tls import Identity
from swarm.transport import FramedStream, connect, ping
from tests.test_session import Doubling

FLAGS = ["--weights", "float32", "--wire-dtype", "float32"]
FAKE_PEER = "12D3KooWmadeUpPeerWhoRegistersWithTheRelay"
ROUNDS, ACCEPTS = 10, 24  # before the fix, 5 rounds of 12 ended the node 2 times in 3


async def ask(host: str, port: int, request: Relay) -> FramedStream:
    conn = await connect(host, port, tls=None)
    await conn.send(request)
    return conn


async def splice_token(host: str, port: int) -> tuple[FramedStream, FramedStream, str]:
    """Register FAKE_PEER, splice to it: the control and splice connections, and the token the
    relay asks FAKE_PEER to connect back with."""
    control = await ask(host, port, Relay(op="listen", peer=FAKE_PEER))
    assert (await control.receive()).op == "listening"
    splicer = await ask(host, port, Relay(op="splice", peer=FAKE_PEER))
    reverse = await control.receive()
    assert reverse.op == "reverse"
    return control, splicer, reverse.token


@pytest.mark.slow
async def test_many_accepts_for_one_splice_token_leave_the_node_serving(tiny_model_dir):
    node = start_node((0, 6), model=str(tiny_model_dir), extra=FLAGS)
    opened: list[FramedStream] = []
    try:
        node.wait_serving()
        host, port = parse_host_port(node.addr)
        for _ in range(ROUNDS):
            control, splicer, token = await splice_token(host, port)
            # connected first, then all frames at once: the node reads them in one batch
            accepts = [await connect(host, port, tls=None) for _ in range(ACCEPTS)]
            async with trio.open_nursery() as nursery:
                for conn in accepts:
                    nursery.start_soon(conn.send, Relay(op="accept", token=token))
            opened += [control, splicer, *accepts]
            await trio.sleep(0.3)
            assert node.proc.poll() is None, "\n".join(node.lines)
        reach = await ping(node.hop(), timeout=5)
        assert reach.reachable, reach.error
    finally:
        for conn in opened:
            await conn.aclose()
        node.stop()


async def hub_request(hub: RelayHub, request: Relay, nursery) -> FramedStream:
    """Serve `request` on a fresh in-memory connection in `nursery`; our end of it."""
    ours, theirs = trio.testing.memory_stream_pair()
    conn = FramedStream(theirs)

    async def serve() -> None:
        try:
            await hub.handle(conn, request, "10.0.0.9")
        except ProtocolError as exc:
            conn.refused = exc  # what the node would answer, as the handler sees it
        finally:
            await conn.aclose()

    nursery.start_soon(serve)
    return FramedStream(ours), conn


async def test_a_splice_token_is_taken_by_the_first_accept_only():
    hub = RelayHub(capacity=4)
    async with trio.open_nursery() as nursery:
        control, _ = await hub_request(hub, Relay(op="listen", peer=FAKE_PEER), nursery)
        assert (await control.receive()).op == "listening"
        await hub_request(hub, Relay(op="splice", peer=FAKE_PEER), nursery)
        token = (await control.receive()).token
        accepts = [
            (await hub_request(hub, Relay(op="accept", token=token), nursery))[1] for _ in range(2)
        ]
        await trio.testing.wait_all_tasks_blocked()
        refused = [getattr(conn, "refused", None) for conn in accepts]
        assert refused.count(None) == 1  # the one spliced: it carries the dialler's bytes
        assert any(isinstance(r, ProtocolError) for r in refused)
        nursery.cancel_scope.cancel()


async def test_a_failing_relay_request_costs_its_connection_only(nursery):
    identity = Identity.generate()
    config = NodeConfig(start=0, end=2, host="127.0.0.1")
    node = Node(
        config, Doubling(), "weights", directory=PeerDirectory(lambda: []), identity=identity
    )

    async def broken(conn, msg, source):  # a bug anywhere in the hub's handling
        raise RuntimeError("a handler bug")

    node.relay_hub.handle = broken
    port = await nursery.start(node.serve)
    conn = await ask("127.0.0.1", port, Relay(op="listen", peer=FAKE_PEER))
    with trio.fail_after(5):
        assert await conn.receive() is None  # closed, nothing else
    reach = await ping(Hop("127.0.0.1", port, 0, 2, "", identity.key_id), timeout=5)
    assert reach.reachable, reach.error
