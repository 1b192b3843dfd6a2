"""A session through its narrow context: the parts of its node it uses (the blocks, the uplink,
the next hops) as small stand-ins, with the real compute lanes and session table, so each
behaviour is seen without processes or sockets. The last test runs a node in-process."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
import trio

from swarm.errors import NodeBusy, PeerFailed, ProtocolError
from swarm.node.config import Limits, NodeConfig
from swarm.node.context import SessionContext
from swarm.node.directory import PeerDirectory
from swarm.node.server import Node
from swarm.node.session import Session
from swarm.node.uplink import CLIENTS, Payload
from swarm.protocol import DECODE, PREFILL, Close, Error, Open, Opened
from swarm.transport import FramedStream
from tests.helpers.doubles import Doubling
from tests.helpers.sessions import (
    SID,
    TOKEN,
    Conn,
    NextHops,
    Uplink,
    context,
    open_msg,
    route,
    start,
    step,
    until,
)


async def opened(ctx: SessionContext, nursery, hops: int = 1) -> tuple[Session, Conn]:
    """A session open on the first hop of a route of `hops`, the next hop having answered."""
    session, owner = await start(ctx, nursery, open_msg(hops))
    if hops > 1:
        await until(lambda: ctx.uplink.control)
        await session.from_downstream(Opened(sid=SID))
    await until(lambda: owner.sent)
    assert owner.sent == [Opened(sid=SID)]
    return session, owner


async def test_a_prompt_is_computed_and_handed_to_the_uplink_for_the_next_hop(nursery):
    ctx = context(nursery)
    session, _ = await opened(ctx, nursery, hops=2)
    msg, hidden = step(0, 4, 4)
    session.take_step(msg)
    await until(lambda: ctx.uplink.payloads)
    [sent] = ctx.uplink.payloads
    nxt = route(2)[1].link
    assert (sent.stream, sent.dest, sent.result) == (ctx.downstream.conns[nxt], nxt, False)
    assert (sent.phase, sent.pos, sent.end) == (PREFILL, 0, 4)
    assert torch.equal(sent.hidden, hidden * 2)


async def test_the_last_hop_sends_its_client_only_the_last_token_of_a_prompt(nursery):
    ctx = context(nursery)
    session, _ = await opened(ctx, nursery)
    client = Conn()
    session.attach(client, TOKEN)
    msg, hidden = step(0, 4, 4)
    session.take_step(msg)
    await until(lambda: ctx.uplink.payloads)
    [sent] = ctx.uplink.payloads
    assert (sent.stream, sent.dest, sent.result) == (client, CLIENTS, True)
    assert torch.equal(sent.hidden, hidden[:, -1:] * 2)


async def test_an_out_of_order_step_is_refused_and_nothing_is_computed(nursery):
    ctx = context(nursery)
    session, _ = await opened(ctx, nursery)
    session.attach(Conn(), TOKEN)
    session.take_step(step(0, 4, 4)[0])
    with pytest.raises(ProtocolError, match="out of order; expected position 4"):
        session.take_step(step(6, 1, 7, DECODE)[0])
    await until(lambda: ctx.uplink.payloads)
    await trio.sleep(0.05)
    assert [p.pos for p in ctx.uplink.payloads] == [0]
    assert not session.state.closed


async def test_the_last_hop_without_an_attached_client_fails_the_session(nursery):
    ctx = context(nursery)
    session, owner = await opened(ctx, nursery)
    session.take_step(step(0, 4, 4)[0])
    await until(lambda: len(owner.sent) > 1)
    err = owner.sent[1]
    assert (err.code, err.hop) == ("session_not_found", 0)
    assert "no client attached" in err.message
    assert ctx.sessions.lookup(SID) is None and not ctx.uplink.payloads


async def test_a_verification_round_after_the_client_left_fails_the_session(nursery):
    # the client hung up with rounds in flight: nobody is left to check them
    ctx = context(nursery)
    session, owner = await opened(ctx, nursery)
    session.attach(Conn(), TOKEN)
    session.take_step(step(0, 4, 4)[0])
    await until(lambda: ctx.uplink.payloads)
    session.sink_gone()
    session.take_step(replace(step(4, 3, 7, DECODE)[0], spec=1))
    await until(lambda: len(owner.sent) > 1)
    assert (owner.sent[1].code, owner.sent[1].hop) == ("session_not_found", 0)
    assert ctx.sessions.lookup(SID) is None and len(ctx.uplink.payloads) == 1


async def test_a_next_hop_that_cannot_be_reached_is_reported_upstream(nursery):
    refusal = PeerFailed("cannot reach the next hop at 127.0.0.1:9001: refused")
    ctx = context(nursery, NextHops(refuse=refusal))
    session, owner = await start(ctx, nursery, open_msg(hops=2))
    await until(lambda: owner.sent)
    assert owner.sent == [Error.of(refusal, SID, hop=1)]
    assert session.state.closed and ctx.sessions.lookup(SID) is None


async def test_a_next_hop_refusing_the_open_is_reported_upstream(nursery):
    ctx = context(nursery)
    session, owner = await start(ctx, nursery, open_msg(hops=2))
    await until(lambda: ctx.uplink.control)
    refusal = Error.of(NodeBusy("node serves its maximum of 64 sessions"), SID, hop=1)
    await session.from_downstream(refusal)
    await trio.sleep(0.05)
    assert owner.sent == [refusal]  # and no Opened after it
    assert session.state.error == refusal and ctx.sessions.lookup(SID) is None


async def test_a_next_hop_that_does_not_answer_the_open_is_reported_upstream(nursery):
    ctx = context(nursery, open_timeout_s=0.1)
    _, owner = await start(ctx, nursery, open_msg(hops=2))
    await until(lambda: owner.sent)
    [err] = owner.sent
    assert (err.code, err.hop) == ("peer_failed", 1)
    assert "did not answer the open" in err.message


async def test_the_open_goes_on_to_the_next_hop_for_its_blocks(nursery):
    ctx = context(nursery)
    await start(ctx, nursery, open_msg(hops=2))
    await until(lambda: ctx.uplink.control)
    [(stream, forwarded)] = ctx.uplink.control
    assert stream is ctx.downstream.conns[route(2)[1].link]
    assert (forwarded.sid, forwarded.hop, forwarded.sink_token) == (SID, 1, TOKEN)


async def test_closing_a_session_tells_the_next_hop(nursery):
    ctx = context(nursery)
    session, _ = await opened(ctx, nursery, hops=2)
    session.close()
    nxt = ctx.downstream.conns[route(2)[1].link]
    assert ctx.uplink.control[-1] == (nxt, Close(sid=SID))
    assert ctx.uplink.ended == [SID] and ctx.sessions.lookup(SID) is None


async def test_a_session_nobody_attaches_to_is_dropped_after_the_open_deadline(nursery):
    ctx = context(nursery, open_deadline_s=0.1)
    _, owner = await opened(ctx, nursery)
    await until(lambda: len(owner.sent) > 1)
    assert owner.sent[1].code == "session_not_found"
    assert "not attached within 0.1 s of opening" in owner.sent[1].message
    assert ctx.sessions.lookup(SID) is None


async def test_an_idle_session_expires_after_its_last_step_and_tells_its_client(nursery):
    ctx = context(nursery, session_idle_s=0.2)
    session, owner = await opened(ctx, nursery)
    client = Conn()
    session.attach(client, TOKEN)
    session.take_step(step(0, 4, 4)[0])
    await until(lambda: ctx.uplink.payloads)
    await until(lambda: len(owner.sent) > 1)
    told = [owner.sent[1], *client.sent]
    assert [m.message for m in told] == ["session expired after idling"] * 2


async def evict_while_the_holder_is_written_to(node: Node, port: int) -> FramedStream:
    """Admit a session from one connection (the holder), then a newcomer's from another that
    hangs up at once, while the node is still writing to the holder (say, a result)."""
    holder = FramedStream(await trio.open_tcp_stream("127.0.0.1", port))
    await holder.send(Open("a" * 32, route(1), 0, "weights", "float32", 16, TOKEN))
    assert isinstance(await holder.receive(), Opened)
    conn = node.sessions.lookup("a" * 32).owner  # the node's end of the holder's connection
    async with conn._send_lock:
        newcomer = FramedStream(await trio.open_tcp_stream("127.0.0.1", port))
        await newcomer.send(Open("b" * 32, route(1), 0, "weights", "float32", 16, TOKEN))
        await newcomer.aclose()
        await until(lambda: node.throttle.evicted == 1 and len(node.connections) == 1)
    return holder


async def test_an_evicted_sessions_holder_is_told_though_the_newcomer_hung_up(nursery):
    limits = Limits(max_sessions=1, evict_idle_s=0.0)
    config = NodeConfig(start=0, end=2, host="127.0.0.1", plaintext=True, limits=limits)
    directory = PeerDirectory(lambda: [], plaintext=True)
    node = Node(config, Doubling(), "weights", directory=directory)
    port = await nursery.start(node.serve)
    holder = await evict_while_the_holder_is_written_to(node, port)
    with trio.fail_after(5):
        told = await holder.receive()
    assert (told.code, told.sid) == ("busy", "a" * 32)
    assert "session evicted" in told.message
    await holder.aclose()


class Faulty(Uplink):
    """An uplink whose hand-off of one session's output raises: a bug in that session's work."""

    def __init__(self, sid: str) -> None:
        super().__init__()
        self.sid = sid

    def send_activations(self, payload: Payload) -> None:
        if payload.sid == self.sid:
            raise RuntimeError("a bug")
        super().send_activations(payload)


async def test_an_internal_error_fails_its_session_alone_not_the_connection_it_came_over(nursery):
    # a middle hop: both sessions come over the previous node's one connection
    ctx = context(nursery)
    broken, fine = "b" * 32, "f" * 32
    ctx = SessionContext(**{**vars(ctx), "uplink": Faulty(broken)})
    upstream = Conn()
    sessions = {}
    for sid in (broken, fine):
        sessions[sid] = Session(
            ctx, upstream, replace(open_msg(3), sid=sid, hop=1), time.monotonic()
        )
        ctx.sessions.add(sessions[sid])
        nursery.start_soon(sessions[sid].run)
    await until(lambda: len(ctx.uplink.control) == 2)
    for s in sessions.values():
        await s.from_downstream(Opened(sid=s.sid))
    await until(lambda: len(upstream.sent) == 2)
    for sid, s in sessions.items():
        s.take_step(replace(step(0, 4, 4)[0], sid=sid))
    await until(lambda: ctx.uplink.payloads and len(upstream.sent) > 2)
    err = upstream.sent[2]
    assert (err.code, err.sid, err.hop) == ("error", broken, 1)
    assert "internal error" in err.message
    assert not upstream.closed and ctx.sessions.lookup(broken) is None
    sessions[fine].take_step(replace(step(4, 1, 5, DECODE)[0], sid=fine))
    await until(lambda: len(ctx.uplink.payloads) == 2)
    assert [p.sid for p in ctx.uplink.payloads] == [fine, fine]
