"""The data plane is TLS, and a dialled node proves the key its signed DHT record names.

What a client or upstream node sends crosses the wire encrypted; an impostor at a node's
address is refused with WrongPeer; a plaintext peer gets a readable error; a node run with
--plaintext is used only by a client that asks for it, and says so in its record.
"""

from __future__ import annotations

from functools import partial

import pytest
import trio

from devtools.launch import start_swarm, stop_all
from swarm.client.client import Client
from swarm.dht import announce, node_id, read_nodes, start_dht
from swarm.errors import RouteUnavailable, WrongPeer
from swarm.protocol import Error, Ping, Pong, Step
from swarm.records import NodeRecord
from swarm.tls import Identity, dial
from swarm.transport import TLS_RECORD, FramedStream, connect, dial_hop, ping
from tests.conftest import reference_greedy, swarm_greedy
from tests.helpers.flags import exact_flags

PROMPT = [5, 50, 150, 250, 350]
NODE_FLAGS = exact_flags(ttl=10)


async def test_a_node_answers_over_tls_with_the_key_its_record_names(tiny_swarm):
    node = tiny_swarm[0]
    conn = await dial_hop(node.hop())
    assert conn.encrypted
    await conn.send(Ping(nonce=7))
    with trio.fail_after(10):
        assert await conn.receive() == Pong(nonce=7)
    await conn.aclose()


async def test_dialling_a_node_with_another_nodes_key_is_refused_as_wrong_peer(tiny_swarm):
    node, other = tiny_swarm[0], tiny_swarm[1]
    host, port = node.hop().host, node.hop().port
    with pytest.raises(WrongPeer, match="not the node its record names"):
        await connect(host, port, tls=other.tls)


async def test_a_plaintext_peer_is_told_the_node_speaks_only_tls(tiny_swarm):
    node = tiny_swarm[0]
    conn = await connect(node.hop().host, node.hop().port, tls=None)
    await conn.send(Ping(nonce=1))
    with trio.fail_after(10):
        reply = await conn.receive()
    assert isinstance(reply, Error) and reply.code == "tls_required", reply
    with trio.fail_after(10):  # and the node hangs up (a reset: our ping was never read)
        try:
            assert await conn.receive() is None
        except trio.BrokenResourceError:
            pass
    await conn.aclose()
    assert (await ping(node.hop(), timeout=10)).reachable  # everyone else is still served


async def test_what_crosses_the_wire_is_encrypted(tiny_swarm, tiny_model_dir, tiny_reference):
    """A recording proxy in front of the first node sees a TLS handshake and then nothing of
    the protocol: no session id, no message names."""
    node = tiny_swarm[0]
    seen = bytearray()

    async def proxy(task_status=trio.TASK_STATUS_IGNORED):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(listeners[0].socket.getsockname()[1])

        async def handle(inbound):
            outbound = await trio.open_tcp_stream(node.hop().host, node.hop().port)

            async def pump(src, dst, record):
                async for data in src:
                    if record:
                        seen.extend(data)
                    await dst.send_all(data)

            async with trio.open_nursery() as n:
                n.start_soon(pump, inbound, outbound, True)
                n.start_soon(pump, outbound, inbound, False)

        await trio.serve_listeners(handle, listeners)

    async with trio.open_nursery() as nursery:
        port = await nursery.start(proxy)
        hop = node.hop()
        conn = await connect("127.0.0.1", port, tls=hop.tls)
        await conn.send(Ping(nonce=123456789))
        with trio.fail_after(10):
            assert await conn.receive() == Pong(nonce=123456789)
        await conn.aclose()
        nursery.cancel_scope.cancel()
    assert seen[0] == 0x16 and seen[1] == 0x03, bytes(seen[:8])  # a TLS handshake record
    assert b"ping" not in seen and b"nonce" not in seen


def test_a_record_naming_a_nodes_address_with_another_key_is_never_routed_through(
    tiny_swarm, tiny_model_dir, tiny_reference
):
    """Someone announces a record of its own at a real node's address: the ping during routing
    fails its key check, so no route goes through it and generation is unchanged."""
    node = tiny_swarm[0]
    client = Client(node.maddrs[:1], model=str(tiny_model_dir), wire_dtype="float32")
    dht = start_dht(node.maddrs[:1])
    try:
        real = next(r for r in client.nodes() if r.peer == node.peer)
        impostor = NodeRecord(  # signed by its own key: the DHT takes it as another node
            **{**real.to_wire(), "peer": node_id(), "tls": Identity.generate().key_id}
        )
        assert announce(dht, [impostor], ttl=60) > 0
        records, _, _ = read_nodes(dht, client.config.name, client.config.num_layers)
        assert impostor.peer in {r.peer for r in records}
        reach = trio.run(lambda: ping(impostor.hop(), timeout=10))
        assert not reach.reachable and "not the node its record names" in reach.error
        for _ in range(3):
            assert impostor.peer not in {h.peer for h in client.route()}
        want = reference_greedy(tiny_reference, PROMPT, 6)
        assert swarm_greedy(client, PROMPT, 6) == want
    finally:
        client.close()
        dht.shutdown()


@pytest.fixture(scope="module")
def plaintext_node(tiny_model_dir):
    nodes = start_swarm([(0, 6)], model=str(tiny_model_dir), extra=[*NODE_FLAGS, "--plaintext"])
    yield nodes[0]
    stop_all(nodes)


def test_a_plaintext_node_says_so_and_is_used_only_when_asked(
    plaintext_node, tiny_model_dir, tiny_reference
):
    assert plaintext_node.tls == ""
    assert "PLAINTEXT" in "\n".join(plaintext_node.lines)
    careful = Client(plaintext_node.maddrs[:1], model=str(tiny_model_dir), wire_dtype="float32")
    willing = Client(
        plaintext_node.maddrs[:1], model=str(tiny_model_dir), wire_dtype="float32", plaintext=True
    )
    try:
        record = next(r for r in careful.nodes() if r.peer == plaintext_node.peer)
        assert record.tls == ""
        with pytest.raises(RouteUnavailable, match="without TLS"):
            careful.route()
        want = reference_greedy(tiny_reference, PROMPT, 6)
        assert swarm_greedy(willing, PROMPT, 6) == want
    finally:
        careful.close()
        willing.close()


async def collecting_server(nursery, identity: Identity, got: list) -> int:
    """A TLS server of `identity` on loopback appending every message it receives to `got`;
    its port."""

    async def serve(stream):
        conn = FramedStream(await identity.accept(stream))
        while (msg := await conn.receive()) is not None:
            got.append(msg)

    listeners = await nursery.start(partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
    return listeners[0].socket.getsockname()[1]


async def test_a_cancelled_send_still_sends_its_frame_whole_and_the_stream_lives():
    """Cancelling a task mid-send (a step's result came, a session closed) must neither break
    the TLS stream nor leave half a frame on it."""
    identity = Identity.generate()
    got = []

    async with trio.open_nursery() as nursery:
        port = await collecting_server(nursery, identity, got)
        conn = await connect("127.0.0.1", port, tls=identity.key_id)
        big = Step(sid="big", phase="prefill", pos=0, end=1, hidden=b"z" * (3 << 20))
        for _ in range(4):  # each sender cancelled while its 3 MiB cross
            async with trio.open_nursery() as senders:
                senders.start_soon(conn.send, big)
                await trio.sleep(0.001)
                senders.cancel_scope.cancel()
        with trio.CancelScope() as scope:
            scope.cancel()  # cancelled before it starts: not sent at all, and no harm done
            await conn.send(Error(code="x", message="y"))
        await conn.send(Ping(nonce=5))
        await conn.aclose()
        with trio.fail_after(30):
            while not got or got[-1] != Ping(nonce=5):
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert [getattr(m, "sid", None) for m in got[:-1]] == ["big"] * 4
    assert all(len(m.hidden) == 3 << 20 for m in got[:4])


class _CountedWrites(trio.abc.Stream):
    """A TCP stream that counts the writes TLS makes to it."""

    def __init__(self, stream: trio.abc.Stream):
        self.stream, self.writes = stream, 0

    async def send_all(self, data) -> None:
        self.writes += 1
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None) -> bytes:
        return await self.stream.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.stream.aclose()


async def test_a_frame_sent_at_once_is_one_write_and_arrives_whole():
    """A lender's query and answer go in one write each (one wake-up of the receiver, and of a
    relay on the way); other frames in small TLS records, whose reads time their arrival."""
    identity = Identity.generate()
    got = []

    async with trio.open_nursery() as nursery:
        port = await collecting_server(nursery, identity, got)
        tcp = _CountedWrites(await trio.open_tcp_stream("127.0.0.1", port))
        conn = FramedStream(await dial(tcp, identity.key_id, "the test's server"))
        frame = Step(sid="q", phase="prefill", pos=0, end=1, hidden=b"q" * 40_000)
        writes = tcp.writes
        await conn.send(frame, at_once=True)
        assert tcp.writes - writes == 1
        writes = tcp.writes
        await conn.send(frame)
        assert tcp.writes - writes >= 40_000 // TLS_RECORD
        await conn.aclose()
        with trio.fail_after(30):
            while len(got) < 2:
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert got == [frame, frame]
