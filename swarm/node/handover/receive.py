"""The receiving side: a session handed over to this node, from its admission to its new owner.

`take` admits it like an open (no one is evicted for it) with its cache still `coming`; its
chunks (`take_chunk`), if the session went on meanwhile a tail (`take_tail`), and its Gated
DeltaNet states (`take_chunk` too) fill the cache through its `CacheIntake` (cache.py); `end`
checks the sender's signature over the digest and its record, installs the cache and answers
`Taken`. The session then waits for
both its next owner (`resume`; steps it sends meanwhile wait) and the sender's last steps
(`release`): ownership passes once both have come. Anything refused drops the session here,
cache and all, and tells the sender (`refuse`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from swarm.dht import proves
from swarm.errors import HandoverRefused, NodeBusy, SessionNotFound, SwarmError
from swarm.node.admission import peer_host, share_of
from swarm.node.borrow import session_room
from swarm.node.context import send_quietly
from swarm.node.handover.cache import CacheIntake, refusal
from swarm.node.session import Session
from swarm.node.session_state import COMING, HERE, Claim, Install
from swarm.protocol import (
    Error,
    Handover,
    HandoverEnd,
    HandoverTail,
    KvChunk,
    Open,
    Opened,
    Release,
    Resume,
    Resumed,
    StateChunk,
    Step,
    Taken,
    handover_claim,
)

if TYPE_CHECKING:
    from swarm.node.context import SessionContext
    from swarm.transport import FramedStream

log = logging.getLogger("swarm.node")


async def take(
    ctx: SessionContext,
    conn: FramedStream,
    msg: Handover,
    check_open: Callable[[Open], None],
    spawn: Callable[..., None],
) -> None:
    """A leaving node hands a session over: admit it as an open would be (`check_open`), with
    its cache to come; `spawn` starts a task in the node's nursery."""
    opening, now = msg.open, time.monotonic()
    try:
        if opening.handoff is not None:  # a session handed on goes no further
            raise HandoverRefused("a handed-over session that names a handoff of its own")
        check_open(opening)
        if msg.length > opening.max_length:
            raise HandoverRefused(
                f"cache of {msg.length} positions for a session of {opening.max_length}"
            )
        share = share_of(peer_host(conn), opening, handed=True)
        session = Session(ctx, conn, opening, now, share, coming=True)
        if session.borrow_cap is not None:  # its cache would have to be lent on arrival
            raise NodeBusy(
                f"a handed-over session of {opening.max_length} tokens is longer than the"
                f" {session_room(ctx.config.limits)} this node keeps for one session"
            )
        if ctx.sessions.make_room(session, now):
            raise NodeBusy("no free place for a handed-over session without evicting one")
        cache = ctx.span.allocate_cache(session.start, session.end, session.max_length)
        session.intake = CacheIntake(cache, msg.length)
        ctx.sessions.add(session)
    except SwarmError as exc:
        ctx.counters.errors_sent += 1
        await send_quietly(conn, Error.of(exc, sid=opening.sid, hop=opening.hop))
        return
    ctx.counters.transfers += 1
    if msg.peer:  # its record is read while the cache comes, not after
        spawn(ctx.directory.record, msg.peer)
    spawn(_count_transfer, ctx, session)
    spawn(session.run)


async def _count_transfer(ctx: SessionContext, s: Session) -> None:
    """Count the transfer in flight until the cache is in or the session ended."""
    try:
        await s.changed.until(lambda: s.state.move is not COMING or s.state.closed)
    finally:
        ctx.counters.transfers -= 1


def _coming(ctx: SessionContext, conn: FramedStream, sid: str) -> Session:
    s = ctx.sessions.get(sid, conn)
    if s.intake is None or s.state.move is not COMING:
        raise SessionNotFound(f"no handover of session {sid[:8]}... under way here")
    return s


async def take_chunk(ctx: SessionContext, conn: FramedStream, msg: KvChunk | StateChunk) -> None:
    """A piece of the cache, or rows of a Gated DeltaNet layer's state after the cache's last
    positions; anything that does not fit what this node allocated ends the handover."""
    s = ctx.sessions.get(msg.sid, conn)
    try:
        intake = _coming(ctx, conn, msg.sid).intake
        assert intake is not None
        intake.take(msg) if isinstance(msg, KvChunk) else intake.take_state(msg)
    except SwarmError as exc:
        await refuse(ctx, conn, s, exc)


async def take_tail(ctx: SessionContext, conn: FramedStream, msg: HandoverTail) -> None:
    """The session went on while its cache came: positions up to `msg.length` follow."""
    s = ctx.sessions.get(msg.sid, conn)
    try:
        intake = _coming(ctx, conn, msg.sid).intake
        assert intake is not None
        intake.extend(msg.length, s.max_length)
    except SwarmError as exc:
        await refuse(ctx, conn, s, exc)


async def end(ctx: SessionContext, conn: FramedStream, msg: HandoverEnd) -> None:
    """The sender's last word: check the cache is whole, that the sender signed its digest and
    serves these weights; then the session goes on here from the cache's length."""
    s = ctx.sessions.get(msg.sid, conn)
    try:
        intake = _coming(ctx, conn, msg.sid).intake
        assert intake is not None
        if not intake.complete:
            raise HandoverRefused(f"the cache is incomplete ({intake.missing()})")
        claim = handover_claim(ctx.key.peer, msg.sid, intake.length, intake.digest())
        if msg.digest != intake.digest() or not proves(msg.peer, msg.key, claim, msg.proof):
            raise HandoverRefused(
                f"the handover of {msg.sid[:8]}... is not signed by node {msg.peer[:16]}"
            )
        record = await ctx.directory.record(msg.peer)
        if record is None or record.fingerprint != ctx.fingerprint:
            raise HandoverRefused(
                f"node {msg.peer[:16]} announces no span of these weights"
                f" ({ctx.fingerprint}); its cache is not taken"
            )
        _install(s, intake, time.monotonic())
    except SwarmError as exc:
        await refuse(ctx, conn, s, exc)
        return
    ctx.counters.moved_in += 1
    log.info("session %s... handed over here at position %d", s.sid[:8], intake.length)
    await conn.send(Taken(sid=msg.sid))


def _install(s: Session, intake: CacheIntake, now: float) -> None:
    intake.install()
    s.state.handle(Opened(sid=s.sid))
    s.state.next_pos = intake.length
    s.state.used, s.state.last_active = True, now
    s.moved(Install())


async def refuse(ctx: SessionContext, conn: FramedStream, s: Session, exc: SwarmError) -> None:
    """Drop the handed-over session (its cache with it) and tell the sender why; a session
    not being handed over only gets the error."""
    err = Error.of(refusal(exc), sid=s.sid, hop=s.hop)
    log.info("refused a handover of %s...: %s", s.sid[:8], exc)
    if s.intake is not None and s.state.move is COMING:
        s.evict(err)
    ctx.counters.errors_sent += 1
    await send_quietly(conn, err)


async def resume(ctx: SessionContext, conn: FramedStream, msg: Resume) -> None:
    """Whoever held the session on the leaving node claims it here (`claim`); `Resumed`."""
    s = ctx.sessions.lookup(msg.sid)
    if s is None:
        raise SessionNotFound(f"no session {msg.sid[:8]}... to resume here")
    claim(s, conn, msg)
    await conn.send(Resumed(sid=msg.sid))


def claim(s: Session, conn: FramedStream, msg: Resume) -> None:
    """Its owner claims `s` on `conn` (steps come from it once the leaving node has passed on
    the last of its own) and/or its sink."""
    if s.intake is None or s.state.move is COMING:
        raise SessionNotFound(f"no session {msg.sid[:8]}... to resume here")
    if msg.sink:
        s.attach(conn, msg.sink_token)
    elif not secrets.compare_digest(s.sink_token.encode(), msg.sink_token.encode()):
        raise SessionNotFound(f"no session {msg.sid[:8]}... to resume here")
    if msg.owner:
        if not s.state.accepts(Claim()):
            raise SessionNotFound(f"no session {msg.sid[:8]}... to resume here")
        s.next_owner = conn
        if s.moved(Claim()) is HERE:
            _pass_ownership(s)


def step(ctx: SessionContext, conn: FramedStream, msg: Step) -> None:
    """A step on `conn`: the owner's is taken; the next owner's waits until the leaving node
    has passed on every step it still held."""
    s = ctx.sessions.lookup(msg.sid)
    if s is not None and conn is s.owner:
        s.take_step(msg)
    elif s is not None and conn is s.next_owner:
        s.early.append(msg)
    else:
        raise SessionNotFound(f"no session {msg.sid[:8]}... on this connection")


def release(s: Session, conn: FramedStream) -> None:
    """The owner on `conn` will send no more steps on it: a session handed over from here goes
    on to the replica; one handed over here passes to its next owner if it has claimed it."""
    if conn is not s.owner:
        raise SessionNotFound(f"no session {s.sid[:8]}... on this connection")
    if s.moved(Release(sid=s.sid)) is HERE and s.next_owner is not None:
        _pass_ownership(s)


def _pass_ownership(s: Session) -> None:
    assert s.next_owner is not None
    s.owner, s.next_owner = s.next_owner, None
    # handed over, it counted as its sender's forwarding; now as its owner's open would
    s.count_in(share_of(peer_host(s.owner), s.open_msg))
    early, s.early = s.early, []
    for msg in early:
        s.take_step(msg)
