"""The sending side: a leaving node (or a prefill node's handoff) moves a session to a replica
serving the same blocks (the cache's slabs and digest in cache.py).

For each session, one at a time: send `Handover` and every position of its cache so far layer
by layer through the uplink (bulk, behind every decode step) while the session goes on; then
pause it (steps arriving now are held), wait until its cache stands still and its outputs are
out, send the positions it computed meanwhile (`HandoverTail`), its Gated DeltaNet states if it
has any (they change at every step: only the paused session's are the replica's to go on from)
and `HandoverEnd` signed with this node's key. The session stalls only for the tail. Once the
replica answers `Taken`, tell the session's owner (the client, or the node before this one)
and sink (the client) `Moved`; they resume the session there and the owner releases it here,
after which the held steps follow to the replica and `Release` passes it on. Anything failing
before `Taken` unpauses the session: it finishes here or, when the grace period ends, its client
replays it elsewhere as after a crash. The session's part in this is its `Move` in session_state.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import trio

from swarm.errors import SwarmError
from swarm.node.context import send_quietly
from swarm.node.handover.cache import (
    Slab,
    StateSlab,
    dtype_name,
    pick_replicas,
    slab_digest,
    slabs,
    state_slabs,
)
from swarm.node.session_state import HERE, LEFT, Copy, Pause
from swarm.node.uplink import Payload
from swarm.protocol import (
    STATE_PARTS,
    Error,
    Handover,
    HandoverEnd,
    HandoverTail,
    Hop,
    Moved,
    Release,
    Taken,
    handover_claim,
)
from swarm.records import NodeRecord

if TYPE_CHECKING:
    from swarm.node.context import SessionContext
    from swarm.node.session import Session

log = logging.getLogger("swarm.node")

# A frame is written whole, and while it waits for a busy replica to read it every result and
# step of the other sessions waits behind it in the uplink: whole layers (1.5 MB for the
# default model 1,000 tokens deep) stalled the sessions still decoding here for 4-10 s on a
# loaded 2-core machine while 8 caches moved. Small volumes keep a decode step's wait to about
# one of them; but each waits for the acknowledgement of the one before last (the in-flight
# cap), and at 64 KiB a 25 MB cache took 6-10 s to cross loopback.
KV_VOLUME_BYTES = 256 * 1024


# a prefill node's handoff, from the prompt's first pass: the rest of the prompt, the transfer,
# then the client's next step (which learns where the session went) and the last steps passed on
HANDOFF_S = 120.0


def movable(s: Session) -> bool:
    """Sessions this node ends the route of: their owner (the client, or the node before)
    and their sink (the client) follow the move. A session with a next hop finishes here or is
    replayed (the next hop would have to take the replica as the session's owner)."""
    used = s.state.used and s.lender is None  # a borrowing session's blocks do not move yet
    return s.is_last and not s.state.closed and used and s.state.move is HERE


async def hand_off(ctx: SessionContext, s: Session, say=print) -> None:
    """Prefill here, decode there: `s`'s prompt is in; move it to the node its open names.
    It decodes here until its cache has arrived (it pauses only for the tail). One cache at a
    time: the uplink then carries each at its full rate, and the first session reaches its
    decode node soonest. A refused or failed handoff leaves the session here."""
    to = s.open_msg.handoff
    assert to is not None
    deadline = trio.current_time() + HANDOFF_S
    try:
        if not await hand_over(ctx, s, to, deadline, ctx.handoff_turn, say):
            log.warning("session %s... stays here: %s took no handoff", s.sid[:8], to.link)
    except Exception:
        log.exception("handing session %s... on to %s failed", s.sid[:8], to.link)
        if not s.state.closed:
            s.unpause()


async def hand_over_all(
    ctx: SessionContext, records: list[NodeRecord], me: str, deadline: float, say=print
) -> int:
    """Hand every movable session of a leaving node to a replica `records` name, by `deadline`
    (trio time); the number handed over."""
    ctx.directory.seed(records)
    sessions = [s for s in ctx.sessions if movable(s)]
    wants = [(s.start, s.end, s.max_length) for s in sessions]
    targets = pick_replicas(records, me, ctx.fingerprint, wants)
    pairs = [(s, t) for s, t in zip(sessions, targets) if t is not None]
    if not pairs:
        return 0
    say(f"handing {len(pairs)} of {len(ctx.sessions)} sessions over to replicas")
    moved = []
    # one transfer at a time: a session pauses only for its own while the others go on
    # decoding here (all paused at once, the last of 8 sessions 1,000 tokens deep stalled for
    # 5.4 s on loopback, waiting for the 7 transfers before its own)
    turn = trio.Lock()

    async def one(s: Session, target: NodeRecord) -> None:
        try:
            if await hand_over(ctx, s, target.hop(s.start, s.end), deadline, turn, say):
                moved.append(s.sid)
        except Exception:
            # a session that ended under its handover (its cache freed mid-copy), or a bug:
            # it costs this session's handover, never the drain and the others'
            log.exception("handing session %s... over failed", s.sid[:8])
            if not s.state.closed:
                s.unpause()

    with trio.move_on_at(deadline):
        async with trio.open_nursery() as nursery:
            for s, target in pairs:
                nursery.start_soon(one, s, target)
    return len(moved)


async def hand_over(
    ctx: SessionContext,
    s: Session,
    to: Hop,
    deadline: float,
    turn: trio.Lock | None = None,
    say: Callable[[str], None] | None = None,
) -> bool:
    """Move `s` to the replica `to`, its pause and transfer in `turn`; True once the replica
    holds it (the client has been told). `say`: told once the replica has taken the cache."""
    ctx.counters.transfers += 1
    if s.state.move is HERE:  # a handoff moved on when its task was started
        s.moved(Copy())
    try:
        async with turn or trio.Lock():
            times = [time.monotonic()]
            sent = await _send_cache(ctx, s, to, deadline)
            times.append(time.monotonic())
            if sent is None:
                s.unpause()
                return False
        length, parts, paused_at = sent
        if say is not None:
            say(
                f"session {s.sid[:8]}... handed over to {to.addr} ({to.peer}), its cache in"
                f" {parts} part{'s' if parts > 1 else ''}"
            )
        await _pass_on(ctx, s, to, length, deadline)
        times.append(time.monotonic())
    finally:
        ctx.counters.transfers -= 1
    ctx.counters.moved_out += 1
    transfer, redirect = (1000 * (b - a) for a, b in zip(times, times[1:]))
    log.info(
        "session %s... handed over to %s at position %d: cache taken in %.0f ms (paused for"
        " the last %.0f), client there in %.0f ms",
        s.sid[:8],
        to.link,
        length,
        transfer,
        1000 * (times[1] - paused_at),
        redirect,
    )
    return True


async def _send_cache(
    ctx: SessionContext, s: Session, to: Hop, deadline: float
) -> tuple[int, int, float] | None:
    """Send the cache to `to` (all of it so far while the session goes on, then, paused, its
    tail and states) and wait for `Taken`: the length it took, in how many parts (phases) it
    went and when the session paused; None if it failed (logged)."""
    if s.state.closed or s.cache is None or s.cache.length == 0:
        return None
    route = list(s.route)
    route[s.hop] = to
    opening = replace(s.open_msg, route=tuple(route), origin=s.origin, handoff=None)
    try:
        ds = await ctx.downstream.connect(to)
    except SwarmError as exc:
        log.warning("cannot hand %s... over to %s: %s", s.sid[:8], to.link, exc)
        return None
    answer = ctx.downstream.expect_handover(to.link, s.sid)
    try:
        start = s.cache.length
        ctx.uplink.send_control(ds, Handover(open=opening, length=start, peer=ctx.key.peer))
        # copying and hashing 25 MB (the default model 1,000 tokens deep) is CPU work the
        # node's loop must not wait for: its sessions' steps, pings and results go on meanwhile
        phases = [await trio.to_thread.run_sync(slabs, s.cache, 0, start)]
        with trio.move_on_at(deadline):
            for done in _queue(ctx, ds, to, s, phases[0]):
                await done.wait()
            sent = await _follow_prompt(ctx, ds, to, s, phases, start)
            if sent is None:
                return None
            paused_at = time.monotonic()
            length = await _pause(ctx, s)
            if length is None:
                return None
            if length > sent:  # the tail it computed meanwhile
                await _send_tail(ctx, ds, to, s, phases, sent, length)
            states = await _send_states(ctx, ds, to, s)
            digest = await trio.to_thread.run_sync(slab_digest, phases, states)
            key, proof = ctx.key.sign(handover_claim(to.peer, s.sid, length, digest))
            end = HandoverEnd(sid=s.sid, digest=digest, peer=ctx.key.peer, key=key, proof=proof)
            ctx.uplink.send_control(ds, end)
            reply = await answer.receive()
            if isinstance(reply, Error):
                log.warning("%s refused the handover of %s...: %s", to.link, s.sid[:8], reply)
                return None
            s.moved(Taken(sid=s.sid))
            return length, len(phases), paused_at
        log.warning("handover of %s... to %s ran out of time", s.sid[:8], to.link)
        return None
    finally:
        ctx.downstream.forget_handover(to.link, s.sid)


async def _follow_prompt(
    ctx: SessionContext, ds, to: Hop, s: Session, phases: list[list[Slab]], sent: int
) -> int | None:
    """A prompt still computing here (a handoff from its first pass on): what its passes add
    meanwhile follows, all of it at once each time the last has gone; the positions sent, None
    if the session ended."""
    while sent < s.prompt_end and not s.state.closed:

        def moved_on(n: int = sent) -> bool:
            return s.cache is None or s.state.closed or s.cache.length != n

        await s.changed.until(moved_on)
        if s.cache is None or s.state.closed:
            return None
        sent = await _send_tail(ctx, ds, to, s, phases, sent, s.cache.length)
    return sent


async def _pause(ctx: SessionContext, s: Session) -> int | None:
    """Pause `s` once nothing of it computes or waits to be sent; the positions its cache
    holds then (None: it ended meanwhile)."""
    s.moved(Pause())
    await s.changed.until(lambda: s.state.closed or s.quiet)
    await ctx.uplink.until_sent(s.sid)
    if s.state.closed or s.cache is None or s.cache.length == 0:
        return None
    return s.cache.length


def _queue(ctx: SessionContext, ds, to: Hop, s: Session, phase: list[Slab]) -> list[trio.Event]:
    """Queue a phase's slabs, layer by layer, as bulk volumes of at most KV_VOLUME_BYTES;
    events set as each has gone."""
    assert s.cache is not None
    dtype = dtype_name(s.cache.keys[0].dtype)
    sent = []
    for layer, (first, keys, values) in enumerate(phase):
        if keys.shape[1] == 0:  # a Gated DeltaNet layer: its state goes last (_send_states)
            continue
        step = max(1, KV_VOLUME_BYTES // (keys[0, :1].nbytes + values[0, :1].nbytes))
        for i in range(0, keys.shape[1], step):
            k, v = keys[:, i : i + step], values[:, i : i + step]
            done = trio.Event()
            sent.append(done)
            ctx.uplink.send_cache(
                Payload(
                    ds, to.link, s.sid, "prefill", first + i, first + i + k.shape[1], k, dtype,
                    False, values=v, layer=layer, done=done,
                )
            )  # fmt: skip
    return sent


async def _send_tail(
    ctx: SessionContext, ds, to: Hop, s: Session, phases: list[list[Slab]], lo: int, hi: int
) -> int:
    """Send positions [lo, hi) of the cache as one more phase; `hi` once they have gone."""
    assert s.cache is not None
    ctx.uplink.send_control(ds, HandoverTail(sid=s.sid, length=hi))
    phases.append(await trio.to_thread.run_sync(slabs, s.cache, lo, hi))
    for done in _queue(ctx, ds, to, s, phases[-1]):
        await done.wait()
    return hi


async def _send_states(ctx: SessionContext, ds, to: Hop, s: Session) -> list[StateSlab]:
    """Send the paused session's Gated DeltaNet states, each part in volumes of rows, after
    its last positions (the same scheduler key keeps them in order); what went."""
    assert s.cache is not None
    states = await trio.to_thread.run_sync(state_slabs, s.cache)
    sent = []
    for layer, *parts in states:
        for part, rows in zip(STATE_PARTS, parts):
            step = max(1, KV_VOLUME_BYTES // rows[0, :1].nbytes)
            for i in range(0, rows.shape[1], step):
                chunk, done = rows[:, i : i + step], trio.Event()
                sent.append(done)
                ctx.uplink.send_cache(
                    Payload(
                        ds, to.link, s.sid, "prefill", i, i + chunk.shape[1], chunk, "float32",
                        False, layer=layer, part=part, done=done,
                    )
                )  # fmt: skip
    for done in sent:
        await done.wait()
    return states


async def _pass_on(ctx: SessionContext, s: Session, to: Hop, length: int, deadline: float):
    """The replica holds the cache: tell the client, wait for it to release the session here
    (its last steps are in then), send the held steps on and release it to the replica."""
    moved = Moved(sid=s.sid, hop=s.hop, to=to, length=length)
    for holder in {id(c): c for c in (s.owner, s.sink) if c is not None}.values():
        await send_quietly(holder, moved)
    with trio.move_on_at(deadline):
        await s.changed.until(lambda: s.state.move is LEFT)
    ds = ctx.downstream.stream(to.link)
    if ds is not None:
        for step in s.held:
            ctx.uplink.send_control(ds, step)
        ctx.uplink.send_control(ds, Release(sid=s.sid))
        # out before the node may stop: the replica passes the session on only after them
        with trio.move_on_at(deadline):
            await ctx.uplink.until_control_sent(ds)
    s.held = []
    s.close()
