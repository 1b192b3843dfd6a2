"""A session is a task: it owns its KV cache, opens the next hop, and computes its steps in order.

The connection that opened the session starts its task in that connection's nursery, so a
session never outlives the connection that asked for it. Steps arrive through `take_step`
(checked by the sans-IO `SessionState` and queued); the task computes them one at a time,
decode steps first, prompt pieces gathered into passes (see prompt.py), awaiting each pass in
the compute lanes, and hands the output to the uplink. The session ends when its state says
closed: by the client's close, a failure here or downstream, idling, or its connection's end.

A session sees of its node only its `SessionContext`: the blocks, the compute lanes, the uplink,
the next hops, the session table and the configuration, given once by the node.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import trio

from swarm.errors import HandoverRefused, PeerFailed, ProtocolError, SessionNotFound, SwarmError
from swarm.node.admission import Share, peer_host, share_of
from swarm.node.passes import DecodeItem, decode_pass, forward_pass
from swarm.node.prompt import PromptPieces
from swarm.node.session_state import Fail, SessionState, SinkGone, StepIn
from swarm.node.uplink import CLIENTS, Payload
from swarm.protocol import (
    DECODE,
    PREFILL,
    Attach,
    Close,
    Error,
    Hop,
    KvChunk,
    Moved,
    Open,
    Opened,
    Release,
    Resume,
    Resumed,
    Step,
)
from swarm.wire import unpack_tensor

if TYPE_CHECKING:
    from swarm.model.blocks import KVCache, Span
    from swarm.node.compute import ComputeQueue, Done, Ticket
    from swarm.node.config import NodeConfig
    from swarm.node.downstream import Downstream
    from swarm.node.handover import CacheIntake
    from swarm.node.observer import StepObserver
    from swarm.node.session_table import SessionTable
    from swarm.node.uplink import Uplink
    from swarm.transport import FramedStream

log = logging.getLogger("swarm.node")


@dataclass
class Counters:
    """What a node's sessions and connections did, for its status line."""

    errors_sent: int = 0
    steps_done: int = 0  # forward passes
    tokens_done: int = 0  # tokens through them
    prompt_passes: int = 0  # prompt passes (a replayed session costs one or more here)
    prompt_tokens: int = 0
    moved_in: int = 0  # sessions whose cache a leaving node handed over here
    moved_out: int = 0  # sessions this node handed over to a replica
    transfers: int = 0  # handovers in flight, either way


@dataclass(frozen=True)
class SessionContext:
    """What a session may use of its node, given once by the node; it reaches nothing else."""

    config: NodeConfig  # its limits, the prompt passes' sizes, the default wire dtype
    span: Span  # the blocks: their width, a session's cache, the passes through them
    compute: ComputeQueue  # the lanes its passes wait for
    uplink: Uplink  # where its activations, results and closes leave
    downstream: Downstream  # the connections to next hops, dialled only if announced
    sessions: SessionTable  # its place, given up when it ends, and its turn for prompt passes
    observer: StepObserver
    counters: Counters
    # a session opened with a handoff calls it once its prompt is in (swarm.node.mover.hand_off)
    hand_off: Callable[[Session], None] | None = None


async def send_quietly(conn: FramedStream, msg) -> None:
    try:
        with trio.move_on_after(5):
            await conn.send(msg)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass


class Session:
    """One session on this node: blocks start:end of route hop `hop`."""

    def __init__(
        self,
        ctx: SessionContext,
        owner: FramedStream,
        msg: Open,
        now: float,
        share: Share | None = None,
    ):
        """`share`: whose shares it counts in, if not those of an open from `owner`."""
        hop = msg.route[msg.hop]
        self.ctx = ctx
        self.open_msg = msg
        self.sid, self.hop, self.route = msg.sid, msg.hop, msg.route
        self.start, self.end = hop.start, hop.end
        self.wire_dtype = msg.wire_dtype or ctx.config.wire_dtype or ctx.span.config.wire_dtype
        self.max_length = msg.max_length
        self.owner = owner  # only it may send steps
        self._count_in(share or share_of(peer_host(owner), msg))
        self.sink: FramedStream | None = None  # the client's connection, on the last hop
        self.downstream: str | None = None  # "host:port" of the next hop
        self.state = SessionState(msg.sid, msg.max_length, last=self.is_last, now=now)
        self.pieces = PromptPieces()
        self.decodes: deque[tuple[Step, torch.Tensor, float]] = deque()  # with arrival time
        self._sink_token = msg.sink_token
        self._tickets: list[Ticket] = []  # places held in the prompt lane
        self._wake = trio.Event()  # something to do came, or the state moved
        self._scope = trio.CancelScope()  # the task's work: cancelled when the session closes
        self.cache: KVCache | None = None  # while the task runs
        # handing over (this node leaves): steps stop being computed and wait in `held`
        self.paused = False
        self.paused_at = 0.0
        self.held: list[Step] = []
        self.released = trio.Event()  # the owner sends no more steps here
        self._computing = False
        # taken over (a leaving node hands it here): the cache fills through `intake`
        self.intake: CacheIntake | None = None
        self.ready = trio.Event()  # the cache is complete and checked
        self._next_owner: FramedStream | None = None  # resumed, waiting for the sender's release
        self._handed = False  # the sender released the session: its steps are all in
        self._early: list[Step] = []  # steps from the next owner before that
        self._sink_came = trio.Event()
        self.moving = False  # its cache is being handed over (a drain or a handoff)
        self.prompt_end = 0  # where the prompt it computes last ends

    @property
    def is_last(self) -> bool:
        return self.hop == len(self.route) - 1

    # ---- what the connections tell it --------------------------------------------------------

    def take_step(self, msg: Step) -> None:
        """Check and queue a step from the owner; raises the SwarmError the owner gets."""
        hidden = unpack_tensor(
            msg.hidden, hidden=self.ctx.span.config.hidden, max_tokens=self.max_length
        )
        n, now = hidden.shape[1], time.monotonic()
        self.state.handle(StepIn(msg.phase, msg.pos, n, msg.end, now))
        if self.paused:  # handing over: the replica computes it
            self.held.append(msg)
            return
        self._queue(msg, hidden, now)

    def _queue(self, msg: Step, hidden: torch.Tensor, now: float) -> None:
        if msg.phase == DECODE:
            self.ctx.uplink.observe_decode_arrival(self.sid)
            self.decodes.append((msg, hidden, now))
        else:
            self.pieces.add(msg, hidden, now)
            self.ctx.observer.prompt_piece(self.sid, now, msg.pos, hidden.shape[1], msg.end)
        self._wake.set()

    def attach(self, conn: FramedStream, token: str) -> None:
        """The client claims this last hop's results, proving it with the open's token."""
        if not secrets.compare_digest(self._sink_token.encode(), token.encode()):
            raise SessionNotFound(f"no session {self.sid[:8]}... to attach to here")
        self.state.handle(Attach(sid=self.sid, sink_token=token))
        self.sink = conn
        self._sink_came.set()
        self._wake.set()  # used now: its idle deadline moves

    # ---- handed over to this node ----------------------------------------------------------

    def take_chunk(self, chunk: KvChunk) -> None:
        """A piece of the cache a leaving node hands over; raises HandoverRefused."""
        if self.intake is None or self.ready.is_set():
            raise SessionNotFound(f"no handover of session {self.sid[:8]}... under way here")
        self.intake.take(chunk)

    def install(self, now: float) -> None:
        """The whole cache has come and been checked: the session goes on from its length."""
        assert self.intake is not None
        self.intake.install()
        self.state.handle(Opened(sid=self.sid))
        self.state.next_pos = self.intake.length
        self.state.used, self.state.last_active = True, now
        self.ready.set()

    def resume(self, conn: FramedStream, msg: Resume) -> None:
        """Whoever held the session on the leaving node claims it here: its owner (steps come
        from it once the leaving node has passed on the last of its own) and/or its sink."""
        if self.intake is None or not self.ready.is_set():
            raise SessionNotFound(f"no session {self.sid[:8]}... to resume here")
        if msg.sink:
            self.attach(conn, msg.sink_token)
        elif not secrets.compare_digest(self._sink_token.encode(), msg.sink_token.encode()):
            raise SessionNotFound(f"no session {self.sid[:8]}... to resume here")
        if msg.owner:
            self._next_owner = conn
            self._pass_ownership()

    def step_from(self, conn: FramedStream, msg: Step) -> None:
        """A step on `conn`: the owner's is taken; the next owner's waits until the leaving node
        has passed on every step it still held."""
        if conn is self.owner:
            self.take_step(msg)
        elif conn is self._next_owner and conn is not None:
            self._early.append(msg)
        else:
            raise SessionNotFound(f"no session {self.sid[:8]}... on this connection")

    def release(self, conn: FramedStream) -> None:
        """The owner on `conn` will send no more steps on it."""
        if conn is not self.owner:
            raise SessionNotFound(f"no session {self.sid[:8]}... on this connection")
        self.released.set()
        if self.intake is not None:  # the leaving node's last steps are in: the owner may come
            self._handed = True
            self._pass_ownership()

    async def follow(self, moved: Moved) -> None:
        """The next hop left, handing this session over to `moved.to`: claim it there as its
        owner, send the steps from now on there, and release it on the node that left once the
        steps queued for that node have gone (it passes them on). If anything fails the
        session stays as it was; it fails when the next hop is gone, and its client replays."""
        if moved.hop != self.hop + 1 or self.state.closed or self.downstream is None:
            return
        downstream, uplink = self.ctx.downstream, self.ctx.uplink
        old, dest = self.downstream, moved.to.link
        try:
            conn = await downstream.connect(moved.to)
        except SwarmError as exc:
            log.warning("cannot follow session %s... to %s: %s", self.sid[:8], dest, exc)
            return
        answer = downstream.expect_handover(dest, self.sid)
        reply = None
        uplink.send_control(conn, Resume(self.sid, self._sink_token, owner=True, sink=False))
        with trio.move_on_after(self.ctx.config.limits.open_timeout_s):
            reply = await answer.receive()
        downstream.forget_handover(dest, self.sid)
        if not isinstance(reply, Resumed) or self.state.closed:
            log.warning("session %s... could not follow to %s: %s", self.sid[:8], dest, reply)
            return
        self.downstream = dest
        self.route = tuple(moved.to if i == moved.hop else h for i, h in enumerate(self.route))
        while uplink.pending(self.sid, old) and not self.state.closed:
            await trio.sleep(0.005)
        if (ds := downstream.stream(old)) is not None:
            uplink.send_control(ds, Release(sid=self.sid))
        log.info("session %s... follows its next hop to %s", self.sid[:8], dest)

    def _count_in(self, share: Share) -> None:
        self.host = share.host  # whose share it counts in
        self.via = share.via  # the node forwarding it here, if one does (its share too)
        self.origin = share.origin  # the user's host, for the next hop

    def _pass_ownership(self) -> None:
        if not self._handed or self._next_owner is None:
            return
        self.owner, self._next_owner = self._next_owner, None
        # handed over, it counted as its sender's forwarding; now as its owner's open would
        self._count_in(share_of(peer_host(self.owner), self.open_msg))
        early, self._early = self._early, []
        for step in early:
            self.take_step(step)

    def sink_gone(self) -> None:
        self.sink = None
        if self.state.accepts(SinkGone()):
            self.state.handle(SinkGone())

    async def from_downstream(self, msg: Opened | Error) -> None:
        """The next hop's answer to the open, or its error (refusing the open, or later)."""
        if isinstance(msg, Error):
            await self.fail(msg)
        elif self.state.accepts(msg):
            self.state.handle(msg)
            self._wake.set()

    # ---- its end -----------------------------------------------------------------------------

    def close(self) -> None:
        """End the session (idempotent)."""
        if not self.state.closed:
            self.state.handle(Close(sid=self.sid))
        self._let_go()
        self._scope.cancel()

    async def fail(self, error: Error) -> None:
        """Tell the session's upstream (and so, hop by hop, the client) and end the session."""
        if self.state.closed:
            return
        self.state.handle(Fail(error))
        self._let_go()
        self.ctx.counters.errors_sent += 1
        sink = self.sink
        await send_quietly(self.owner, error)
        if sink is not None and sink is not self.owner:
            await send_quietly(sink, error)
        self.close()

    def evict(self, error: Error) -> None:
        """Give the session's place up at once (a newcomer takes it); the caller tells the
        holder `error`."""
        if self.state.closed:
            return
        self.state.handle(Fail(error))
        self.close()

    def _let_go(self) -> None:
        """Free the session's place, drop what it still had to send, tell the next hop."""
        if not self.ctx.sessions.remove(self):
            return
        error = self.state.error
        log.info("session %s... closed%s", self.sid[:8], f" ({error.code})" if error else "")
        self.ctx.uplink.end_session(self.sid)
        ds = self.ctx.downstream.stream(self.downstream) if self.downstream else None
        if ds is not None:
            self.ctx.uplink.send_control(ds, Close(sid=self.sid))

    # ---- its task ----------------------------------------------------------------------------

    async def run(self) -> None:
        """The session's life: open the next hop, then compute steps until the session ends."""
        try:
            with self._scope:
                async with self._cache() as cache:
                    await self._live(cache)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            self.close()

    async def _live(self, cache: KVCache) -> None:
        try:
            if self.intake is not None:
                if await self._await_intake():
                    await self._work(cache)
            elif await self._open_next_hop():
                await self._work(cache)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            raise
        except Exception:
            # a bug costs this session only: its owner may be the previous node's connection,
            # which every session that node forwards here shares
            log.exception("session %s... failed on an internal error", self.sid[:8])
            await self.fail(Error.of(SwarmError("internal error"), self.sid, self.hop))

    @asynccontextmanager
    async def _cache(self):
        cache = self.intake.cache if self.intake is not None else self._allocate()
        self.cache = cache
        try:
            yield cache
        finally:
            self.close()
            self.cache = None
            cache.keys.clear()
            cache.values.clear()

    def _allocate(self) -> KVCache:
        return self.ctx.span.allocate_cache(self.start, self.end, self.max_length)

    async def _await_intake(self) -> bool:
        """A handed-over session waits for its cache; False if it did not come in time."""
        with trio.move_on_after(self.ctx.config.limits.open_timeout_s):
            await self.ready.wait()
            return True
        err = HandoverRefused("the handed-over cache did not arrive in time")
        await self.fail(Error.of(err, self.sid, self.hop))
        return False

    async def _open_next_hop(self) -> bool:
        """Open the session down the route (the last hop opens at once) and tell the owner;
        False if that failed (the owner has been told why)."""
        if self.state.closed:
            return False  # evicted before its task began
        if self.is_last:
            self.state.handle(Opened(sid=self.sid))
        elif not await self._ask_next_hop(self.route[self.hop + 1]):
            return False
        log.info(
            "session %s... opened, hop %d, blocks %d:%d",
            self.sid[:8],
            self.hop,
            self.start,
            self.end,
        )
        await send_quietly(self.owner, Opened(sid=self.sid))
        return True

    async def _ask_next_hop(self, nxt: Hop) -> bool:
        """Send the open on to `nxt` and wait for its answer (from_downstream); True once it
        has opened."""
        try:
            ds = await self.ctx.downstream.connect(nxt)
        except SwarmError as exc:
            await self.fail(Error.of(exc, sid=self.sid, hop=self.hop + 1))
            return False
        self.downstream = nxt.link
        self.ctx.uplink.send_control(ds, _forwarded(self.open_msg, self.origin))
        with trio.move_on_after(self.ctx.config.limits.open_timeout_s):
            while self.state.opening:
                await self._woken()
        if self.state.opening:
            err = PeerFailed(f"hop {self.hop + 1} at {nxt.link} did not answer the open")
            await self.fail(Error.of(err, sid=self.sid, hop=self.hop + 1))
        return not self.state.closed

    async def _work(self, cache: KVCache) -> None:
        try:
            while not self.state.closed:
                self._computing = True
                if self.decodes:
                    await self._decode(cache, *self.decodes.popleft())
                elif self.pieces:
                    await self._prompt_pass(cache)
                else:
                    self._computing = False
                    await self._idle()
                self._computing = False
        finally:
            for ticket in self._tickets:
                ticket.release()

    @property
    def quiet(self) -> bool:
        """Nothing of the session is computing or waiting to be: its cache stands still."""
        return not (self._computing or self.decodes or self.pieces)

    def pause(self) -> None:
        """Compute nothing more: steps arriving from now on wait in `held` (for the replica)."""
        self.paused = True
        self.paused_at = time.monotonic()

    def unpause(self) -> None:
        """The handover failed: compute the held steps here after all (a later drain or
        prompt may try again)."""
        self.paused = False
        self.moving = False
        held, self.held = self.held, []
        for msg in held:
            hidden = unpack_tensor(
                msg.hidden, hidden=self.ctx.span.config.hidden, max_tokens=self.max_length
            )
            self._queue(msg, hidden, time.monotonic())

    async def _sink_in_time(self) -> bool:
        """A handed-over last hop may compute a step before the client has resumed it here:
        the result waits for the client a little while."""
        if self.intake is None:
            return False
        with trio.move_on_after(self.ctx.config.limits.open_timeout_s):
            await self._sink_came.wait()
        return self.sink is not None

    async def _woken(self) -> None:
        self._wake = trio.Event()
        await self._wake.wait()

    async def _idle(self) -> None:
        limits = self.ctx.config.limits
        idle, unused = limits.session_idle_s, limits.open_deadline_s
        with trio.move_on_after(self.state.deadline(idle, unused) - time.monotonic()):
            await self._woken()
            return
        if self.state.expired(time.monotonic(), idle, unused):
            if self.state.used:
                err = SessionNotFound("session expired after idling")
            else:
                what = "attached" if self.is_last else "stepped"
                err = SessionNotFound(f"session dropped: not {what} within {unused:g} s of opening")
            await self.fail(Error.of(err, self.sid, self.hop))

    async def _decode(self, cache: KVCache, step: Step, hidden: torch.Tensor, arrived: float):
        compute, span = self.ctx.compute, self.ctx.span
        try:
            if hidden.shape[1] == 1:  # joins other sessions' steps through the same blocks
                run = functools.partial(decode_pass, span, self.start, self.end)
                item = DecodeItem(cache, step.pos, hidden)
                done = await compute.decode((self.start, self.end), item, run)
            else:
                fn = functools.partial(
                    forward_pass, span, cache, self.start, self.end, step.pos, hidden
                )
                done = await compute.run(DECODE, fn, hidden.shape[1])
        except Exception as exc:
            await self._compute_failed(exc)
            return
        if await self._forward(step, done):
            self.ctx.observer.decode_step(arrived, time.monotonic(), done.elapsed, done.usage)

    async def _prompt_pass(self, cache: KVCache) -> None:
        """Wait for the prompt lane, then compute what has arrived by then (up to a pass's
        worth), holding the next place in the lane already if more waits."""
        config, compute = self.ctx.config.compute, self.ctx.compute
        if not self._tickets:
            self._tickets.append(compute.reserve(PREFILL, self._rank()))
        ticket = self._tickets[0]
        await ticket.turn()
        wait = self.pieces.wait(time.monotonic(), config.min_pass_tokens, config.gather_s)
        if wait > 0:  # a few tokens only: let more come, a little while
            self._tickets.pop(0).release()
            with trio.move_on_after(wait):
                while (
                    self.pieces.wait(time.monotonic(), config.min_pass_tokens, config.gather_s) > 0
                ):
                    await self._woken()
            return
        step, hidden = self.pieces.take(config.pass_tokens, time.monotonic())
        self.prompt_end = step.end
        if self.pieces:  # more than one pass waits: queue the next, behind any decode step
            self._tickets.append(compute.reserve(PREFILL, self._rank()))
        fn = functools.partial(
            forward_pass, self.ctx.span, cache, self.start, self.end, step.pos, hidden
        )
        try:
            done = await ticket.run(fn, hidden.shape[1])
        except Exception as exc:
            await self._compute_failed(exc)
            return
        finally:
            self._tickets.remove(ticket)
            ticket.release()
        self.ctx.counters.prompt_passes += 1
        self.ctx.counters.prompt_tokens += hidden.shape[1]
        if await self._forward(step, done):
            out = done.result
            self._prompt_computed(done_all=step.pos + out.shape[1] == step.end)
            self.ctx.observer.prompt_pass(
                self.sid,
                time.monotonic(),
                step.pos,
                out.shape[1],
                step.end,
                done.elapsed,
                done.usage,
            )

    def _prompt_computed(self, done_all: bool) -> None:
        """Opened with a handoff (this node computes prompts for a decode node): the session
        goes to that node, its cache streaming there from the prompt's first pass on (the
        rest follows as passes finish), decoding here until it has all arrived. A layer with a
        sliding window shorter than the session waits for the whole prompt: the next pass
        would overwrite positions of its ring while they are copied out."""
        if self.open_msg.handoff is None or self.moving or self.ctx.hand_off is None:
            return
        assert self.cache is not None
        rings = any(k.shape[2] < self.max_length for k in self.cache.keys)
        if done_all or not rings:
            self.moving = True
            self.ctx.hand_off(self)

    def _rank(self) -> float:
        compute = self.ctx.compute
        left = self.pieces.tokens_left()
        rank = compute.prefill_rank(self.pieces.prompt_since, left)
        per_token = compute.prefill_token_seconds or 0.0
        cost = min(left, self.ctx.config.compute.pass_tokens) * per_token
        return self.ctx.sessions.prompt_rank(self, rank, cost)

    async def _compute_failed(self, error: Exception) -> None:
        if self.state.closed:
            return
        log.exception("step failed in session %s...", self.sid[:8], exc_info=error)
        err = error if isinstance(error, SwarmError) else ProtocolError(f"compute failed: {error}")
        await self.fail(Error.of(err, sid=self.sid, hop=self.hop))

    async def _forward(self, step: Step, done: Done) -> bool:
        """Queue a pass's output for the next hop (or the client); False if the session ended."""
        if self.state.closed:
            return False
        out = done.result
        n = out.shape[1]
        self.ctx.counters.steps_done += 1
        self.ctx.counters.tokens_done += n
        if not self.is_last:
            ds = self.ctx.downstream.stream(self.downstream)
            if ds is None:
                return True  # lost: the sessions through it are failing
            to, dest, phase, result = ds, self.downstream, step.phase, False
        elif step.pos + n != step.end:
            return True  # a middle chunk of a prefill: the client needs only the last token
        elif self.sink is None and not await self._sink_in_time():
            err = SessionNotFound("no client attached to receive results")
            await self.fail(Error.of(err, self.sid, self.hop))
            return False
        else:
            to, dest, phase, result, out = self.sink, CLIENTS, DECODE, True, out[:, -1:]
        payload = Payload(
            to, dest, self.sid, phase, step.pos, step.end, out, self.wire_dtype, result=result
        )
        self.ctx.uplink.send_activations(payload)
        return True


def _forwarded(msg: Open, origin: str) -> Open:
    """The open for the next hop: every field as it came (a new one needs no line here)."""
    return replace(msg, hop=msg.hop + 1, origin=origin)
