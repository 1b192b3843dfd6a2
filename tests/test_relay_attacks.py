"""A stranger speaking the relay's plaintext requests cannot end a node or pin its connections.

Every direct TLS node runs a relay hub, so anyone who can reach its port can register a made-up
peer, splice to it, and answer the splice with as many `accept`s for its token as they like.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey

from devtools.launch import start_node
from devtools.stranger import new_key
from swarm.address import parse_host_port
from swarm.errors import ProtocolError, SwarmError
from swarm.node.config import NodeConfig
from swarm.node.directory import PeerDirectory
from swarm.node.server import Node
from swarm.protocol import Error, Hop, Relay, relay_claim
from swarm.relay import CONTROL_SILENCE_S, RelayHub
from swarm.tls import Identity
from swarm.transport import FramedStream, connect, ping
from tests.helpers.doubles import Doubling
from tests.helpers.flags import exact_flags

FLAGS = exact_flags()
RELAY_ID = "the-relays-own-node-id"  # what an in-process hub's proofs are bound to
ROUNDS, ACCEPTS = 10, 24  # before the fix, 5 rounds of 12 ended the node 2 times in 3


async def ask(host: str, port: int, request: Relay) -> FramedStream:
    conn = await connect(host, port, tls=None)
    await conn.send(request)
    return conn


def key_pair() -> tuple[RSAPrivateKey, str]:
    """A fresh signing key and the node id it proves: anyone can make one, for its own id."""
    key, _marker, me = new_key()
    return key, me


def proof(key: RSAPrivateKey, relay: str, peer: str, nonce: str) -> Relay:
    marker = RSASignatureValidator(key).local_public_key.decode()
    signature = key.sign(relay_claim(relay, peer, nonce)).decode()
    return Relay(op="prove", key=marker, proof=signature)


async def register(conn: FramedStream, relay: str, peer: str, key: RSAPrivateKey) -> Relay:
    """Answer the relay's challenge on `conn` (a listen for `peer` sent) signing with `key`;
    the relay's answer ('listening', or an Error)."""
    challenge = await conn.receive()
    assert challenge.op == "challenge"
    await conn.send(proof(key, relay, peer, challenge.token))
    return await conn.receive()


async def splice_token(
    host: str, port: int, relay: str, key: RSAPrivateKey, me: str
) -> tuple[FramedStream, FramedStream, str]:
    """Register a node of our own (`me`, proven by `key`), splice to it: the control and splice
    connections, and the token the relay asks our node to connect back with."""
    control = await ask(host, port, Relay(op="listen", peer=me))
    assert (await register(control, relay, me, key)).op == "listening"
    splicer = await ask(host, port, Relay(op="splice", peer=me))
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
        key, me = key_pair()  # one node of ours, registering again each round
        for _ in range(ROUNDS):
            control, splicer, token = await splice_token(host, port, node.peer, key, me)
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


async def hub_request(hub: RelayHub, request: Relay, nursery, source: str = "10.0.0.9"):
    """Serve `request` (from host `source`) on a fresh in-memory connection in `nursery`: our
    end of it, and the hub's (which records what the hub refused)."""
    ours, theirs = trio.testing.memory_stream_pair()
    conn = FramedStream(theirs)

    async def serve() -> None:
        try:
            await hub.handle(conn, request, source)
        except SwarmError as exc:  # what the node answers, and what the test looks at
            conn.refused = exc
            await conn.send(Error.of(exc, sid="", hop=-1))
        finally:
            await conn.aclose()

    nursery.start_soon(serve)
    return FramedStream(ours), conn


async def listen(hub: RelayHub, nursery, peer: str, key: RSAPrivateKey, source="10.0.0.9"):
    """A registration with `hub` from `source`: our end, and the relay's answer to the proof."""
    ours, theirs = await hub_request(hub, Relay(op="listen", peer=peer), nursery, source)
    answer = await register(ours, hub.me, peer, key)
    return ours, theirs, answer


async def test_a_splice_token_is_taken_by_the_first_accept_only(nursery):
    hub = RelayHub(capacity=4, me=RELAY_ID)
    key, me = key_pair()
    control, _, answer = await listen(hub, nursery, me, key)
    assert answer.op == "listening"
    await hub_request(hub, Relay(op="splice", peer=me), nursery)
    token = (await control.receive()).token
    accepts = [
        (await hub_request(hub, Relay(op="accept", token=token), nursery))[1] for _ in range(2)
    ]
    await trio.testing.wait_all_tasks_blocked()
    refused = [getattr(conn, "refused", None) for conn in accepts]
    assert refused.count(None) == 1  # the one spliced: it carries the dialler's bytes
    assert any(isinstance(r, ProtocolError) for r in refused)
    nursery.cancel_scope.cancel()


async def test_a_registration_under_another_nodes_id_is_refused(nursery):
    hub = RelayHub(capacity=4, me=RELAY_ID)
    _, victim = key_pair()
    key, _me = key_pair()
    _, theirs, _ = await listen(hub, nursery, victim, key)  # signed, but with our own key
    await trio.testing.wait_all_tasks_blocked()
    assert victim not in hub.controls
    assert "proves no key" in str(theirs.refused)


async def test_a_proof_made_for_another_relay_is_refused(nursery):
    hub = RelayHub(capacity=4, me=RELAY_ID)
    key, me = key_pair()
    ours, theirs = await hub_request(hub, Relay(op="listen", peer=me), nursery)
    challenge = await ours.receive()
    await ours.send(proof(key, "some-other-relay", me, challenge.token))
    await trio.testing.wait_all_tasks_blocked()
    assert me not in hub.controls and isinstance(theirs.refused, ProtocolError)


async def test_one_address_registers_at_most_two_nodes(nursery):
    hub = RelayHub(capacity=8, me=RELAY_ID)
    answers = []
    for _ in range(3):
        key, me = key_pair()
        answers.append((await listen(hub, nursery, me, key))[2])
    key, me = key_pair()
    other = (await listen(hub, nursery, me, key, source="10.0.0.10"))[2]
    assert [a.op for a in answers[:2]] == ["listening", "listening"]
    assert answers[2].code == "busy" and other.op == "listening"
    nursery.cancel_scope.cancel()


async def test_a_registration_that_stops_pinging_is_dropped(nursery, autojump_clock):
    hub = RelayHub(capacity=4, me=RELAY_ID)
    key, me = key_pair()
    _, _, answer = await listen(hub, nursery, me, key)
    assert answer.op == "listening" and me in hub.controls
    await trio.sleep(CONTROL_SILENCE_S + 1)
    assert me not in hub.controls


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
    conn = await ask("127.0.0.1", port, Relay(op="listen", peer="anyone"))
    with trio.fail_after(5):
        assert await conn.receive() is None  # closed, nothing else
    reach = await ping(Hop("127.0.0.1", port, 0, 2, "", identity.key_id), timeout=5)
    assert reach.reachable, reach.error
