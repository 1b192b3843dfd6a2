"""A node shares itself fairly between source addresses: attackers on 127.0.0.2, 127.0.0.3, ...
speak the wire format at a live node while an honest user on 127.0.0.1 keeps getting its exact
text."""

from __future__ import annotations

import os
import time

import pytest
import trio

from devtools.launch import NodeProcess, start_swarm, stop_all
from swarm.client.client import Client
from swarm.errors import NodeBusy
from swarm.protocol import Attach, Attached, Close, Error, Hop, Open, Opened
from swarm.tls import dial
from swarm.transport import FramedStream
from tests.conftest import reference_greedy
from tests.helpers.flags import exact_flags

PROMPT = [5, 50, 150, 250, 350]
NEW = 8
DEADLINE = 3.0  # --open-deadline
EVICT_IDLE = 1.5  # --evict-idle
LIMITS = {
    "--max-sessions": 6,
    "--max-host-sessions": 2,
    "--max-cache-tokens": 4096,
    "--max-host-cache-tokens": 1024,
    "--max-session-tokens": 768,
    "--max-connections": 10,
    "--max-host-connections": 3,
    "--open-deadline": DEADLINE,
    "--evict-idle": EVICT_IDLE,
}
NODE_ARGS = exact_flags(ttl=10)
NODE_ARGS += [str(x) for kv in LIMITS.items() for x in kv]


@pytest.fixture(scope="module")
def node(tiny_model_dir, tmp_path_factory):
    log = open(tmp_path_factory.mktemp("admission") / "node.stderr", "w")  # noqa: SIM115
    nodes = start_swarm([(0, 6)], model=str(tiny_model_dir), extra=NODE_ARGS, stderr=log)
    yield nodes[0]
    stop_all(nodes)
    log.close()


@pytest.fixture(scope="module")
def honest(node, tiny_model_dir):
    c = Client(node.maddrs[:1], model=str(tiny_model_dir), wire_dtype="float32")
    yield c
    c.close()


async def attacker(node: NodeProcess, source: str) -> FramedStream:
    """A connection to `node` from loopback address `source` (127.0.0.2, ...)."""
    stream = await trio.open_tcp_stream(*node.host_port, local_address=source)
    return FramedStream(await dial(stream, node.tls, node.addr))


def open_msg(node: NodeProcess, fingerprint: str, max_length: int = 64, sid: str = "") -> Open:
    host, port = node.host_port
    return Open(
        sid=sid or os.urandom(16).hex(),
        route=(Hop(host, port, 0, 6, node.peer, node.tls),),
        hop=0,
        fingerprint=fingerprint,
        wire_dtype="float32",
        max_length=max_length,
        sink_token="s" * 32,
    )


async def answer(conn: FramedStream, timeout: float = 15.0):
    """The next message other than a pong, or None at end of stream."""
    with trio.fail_after(timeout):
        return await conn.receive()


async def open_sessions(conn: FramedStream, node, fingerprint, n: int) -> list:
    """Send `n` opens on `conn`; what each got back (Opened or Error)."""
    got = []
    for _ in range(n):
        await conn.send(open_msg(node, fingerprint))
        got.append(await answer(conn))
    return got


def honest_text(client: Client) -> list[int]:
    out = []
    with client.session(len(PROMPT) + NEW) as s:
        logits = s.feed(PROMPT)
        for _ in range(NEW):
            out.append(int(logits.argmax()))
            logits = s.feed([out[-1]])
    return out


async def test_one_address_gets_at_most_its_share_of_sessions(
    node, fingerprint, honest, tiny_reference
):
    conn = await attacker(node, "127.0.0.2")
    got = await open_sessions(conn, node, fingerprint, 4)
    assert [type(m) for m in got] == [Opened, Opened, Error, Error]
    assert got[2].code == "busy" and "127.0.0.2 holds 2 sessions" in got[2].message
    out = await trio.to_thread.run_sync(honest_text, honest)
    await conn.aclose()
    assert out == reference_greedy(tiny_reference, PROMPT, NEW)


async def test_one_address_gets_at_most_its_share_of_cache_tokens(node, fingerprint):
    conn = await attacker(node, "127.0.0.2")
    await conn.send(open_msg(node, fingerprint, max_length=600))
    assert isinstance(await answer(conn), Opened)
    await conn.send(open_msg(node, fingerprint, max_length=500))  # 1100 > 1024 for this host
    err = await answer(conn)
    await conn.aclose()
    assert isinstance(err, Error) and err.code == "busy" and "1024" in err.message


async def test_a_session_never_used_is_dropped_after_the_open_deadline(node, fingerprint):
    conn = await attacker(node, "127.0.0.3")
    await conn.send(open_msg(node, fingerprint))
    assert isinstance(await answer(conn), Opened)
    t0 = time.monotonic()
    err = await answer(conn, timeout=DEADLINE + 10)
    waited = time.monotonic() - t0
    await conn.aclose()
    assert isinstance(err, Error) and err.code == "session_not_found"
    assert "not attached within 3 s" in err.message
    assert DEADLINE - 0.5 <= waited < DEADLINE + 5


async def test_an_attached_session_outlives_the_open_deadline(node, fingerprint):
    conn = await attacker(node, "127.0.0.3")
    msg = open_msg(node, fingerprint)
    await conn.send(msg)
    assert isinstance(await answer(conn), Opened)
    await conn.send(Attach(sid=msg.sid, sink_token=msg.sink_token))
    assert isinstance(await answer(conn), Attached)
    with trio.move_on_after(DEADLINE + 2) as quiet:
        got = await conn.receive()
    await conn.aclose()
    assert quiet.cancelled_caught, f"got {got} before the session idled out"


async def test_a_newcomer_below_its_share_takes_a_place_from_the_address_holding_most(
    node, fingerprint
):
    conns = [await attacker(node, f"127.0.0.{i}") for i in (4, 5, 6)]
    for conn in conns:  # 3 addresses x 2 sessions: the node's 6 places
        assert all(isinstance(m, Opened) for m in await open_sessions(conn, node, fingerprint, 2))
    late = await attacker(node, "127.0.0.7")  # none yet; an equal share is 6 / 4
    await late.send(open_msg(node, fingerprint))
    admitted = await answer(late)
    told = []
    for conn in conns:
        with trio.move_on_after(0.5):
            told.append(await conn.receive())
        await conn.aclose()
    await late.aclose()
    assert isinstance(admitted, Opened)
    assert [(m.code, "session evicted" in m.message) for m in told] == [("busy", True)]


async def test_a_node_full_of_equal_shares_refuses_until_a_session_idles(
    node, fingerprint, honest, tiny_reference
):
    conns = [await attacker(node, f"127.0.0.{i}") for i in range(4, 10)]
    for conn in conns:  # 6 addresses x 1 session: all 6 places, each its equal share
        assert all(isinstance(m, Opened) for m in await open_sessions(conn, node, fingerprint, 1))
    late = await attacker(node, "127.0.0.10")
    await late.send(open_msg(node, fingerprint))
    refused = await answer(late)
    await trio.sleep(EVICT_IDLE + 0.5)  # now they have idled long enough to give way
    out = await trio.to_thread.run_sync(honest_text, honest)
    told = []
    for conn in conns:
        with trio.move_on_after(0.2):
            told.append(await conn.receive())
        await conn.aclose()
    await late.aclose()
    assert isinstance(refused, Error) and refused.code == "busy"
    assert "maximum of 6 sessions" in refused.message
    assert out == reference_greedy(tiny_reference, PROMPT, NEW)
    evicted = [m for m in told if m.code == "busy"]  # the others may have met the deadline
    assert len(evicted) == 1 and "session evicted" in evicted[0].message


async def test_one_address_gets_at_most_its_share_of_connections(node):
    """The one too many is told so before TLS: a refusal costs the node no handshake."""
    conns = [await attacker(node, "127.0.0.11") for _ in range(3)]
    with pytest.raises(NodeBusy, match="3 connections"):
        await attacker(node, "127.0.0.11")
    for conn in conns:
        await conn.aclose()


async def test_a_full_node_closes_an_idle_connection_for_a_newcomer(node, honest, tiny_reference):
    """Four addresses hold all 10 connections, doing nothing."""
    conns = [await attacker(node, f"127.0.0.{20 + i // 3}") for i in range(10)]
    await trio.sleep(0.5)  # all accepted
    out = await trio.to_thread.run_sync(honest_text, honest)
    answers = []
    for conn in conns:
        with trio.move_on_after(0.2):
            answers.append(await conn.receive())
        await conn.aclose()
    assert out == reference_greedy(tiny_reference, PROMPT, NEW)
    busy = [m for m in answers if isinstance(m, Error)]
    assert busy and all(m.code == "busy" for m in busy)
    assert "held no session" in busy[0].message


async def test_closing_the_upstream_connection_frees_the_session_down_the_route(
    tiny_swarm, fingerprint
):
    """A two-hop session through the shared swarm; its opener goes away without a close."""
    first = next(n for n in tiny_swarm if n.layers == (0, 2))
    second = next(n for n in tiny_swarm if n.layers == (1, 5))
    h1, p1 = first.host_port
    h2, p2 = second.host_port
    sid, token = os.urandom(16).hex(), "t" * 32
    opener = await attacker(first, "127.0.0.30")
    await opener.send(
        Open(
            sid=sid,
            route=(
                Hop(h1, p1, 0, 2, first.peer, first.tls),
                Hop(h2, p2, 2, 5, second.peer, second.tls),
            ),
            hop=0,
            fingerprint=fingerprint,
            wire_dtype="float32",
            max_length=32,
            sink_token=token,
        )
    )
    assert isinstance(await answer(opener), Opened)
    assert await attach_probe(second, sid, token) == "attached"  # it is there
    await opener.aclose()
    with trio.fail_after(10):
        while (probe := await attach_probe(second, sid, token)) == "attached":
            await trio.sleep(0.2)
    assert probe == "session_not_found"


async def attach_probe(node: NodeProcess, sid: str, token: str) -> str:
    """Attach to `sid` on `node` and let go again: 'attached' or the error code."""
    conn = await attacker(node, "127.0.0.31")
    await conn.send(Attach(sid=sid, sink_token=token))
    msg = await answer(conn)
    await conn.aclose()
    return "attached" if isinstance(msg, Attached) else msg.code


async def test_a_close_from_the_opener_still_ends_the_session(node, fingerprint):
    conn = await attacker(node, "127.0.0.32")
    msg = open_msg(node, fingerprint)
    await conn.send(msg)
    assert isinstance(await answer(conn), Opened)
    await conn.send(Close(sid=msg.sid))
    await trio.sleep(0.3)
    assert await attach_probe(node, msg.sid, msg.sink_token) == "session_not_found"
    await conn.aclose()


async def test_the_dht_record_counts_what_the_node_turned_away(node, fingerprint, honest):
    conn = await attacker(node, "127.0.0.33")
    got = await open_sessions(conn, node, fingerprint, 3)  # the third is over the share

    def announced_throttled() -> int:
        deadline = time.monotonic() + 20  # the next announcement, every --announce-ttl / 3
        while time.monotonic() < deadline:
            mine = [r for r in honest.nodes() if r.peer == node.peer]
            if mine and mine[0].throttled > 0:
                return mine[0].throttled
            time.sleep(0.5)
        return 0

    throttled = await trio.to_thread.run_sync(announced_throttled)
    await conn.aclose()
    assert isinstance(got[2], Error) and got[2].code == "busy"
    assert throttled >= 1
