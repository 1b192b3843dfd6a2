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
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import trio

from swarm.errors import PeerFailed, ProtocolError, SessionNotFound, SwarmError
from swarm.node.admission import peer_host, share_of
from swarm.node.passes import DecodeItem, decode_pass, forward_pass
from swarm.node.prompt import PromptPieces
from swarm.node.session_state import Fail, SessionState, SinkGone, StepIn
from swarm.node.uplink import CLIENTS, Payload
from swarm.protocol import DECODE, PREFILL, Attach, Close, Error, Hop, Open, Opened, Step
from swarm.wire import unpack_tensor

if TYPE_CHECKING:
    from swarm.model.blocks import KVCache, Span
    from swarm.node.compute import ComputeQueue, Done, Ticket
    from swarm.node.config import NodeConfig
    from swarm.node.downstream import Downstream
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


async def send_quietly(conn: FramedStream, msg) -> None:
    try:
        with trio.move_on_after(5):
            await conn.send(msg)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass


class Session:
    """One session on this node: blocks start:end of route hop `hop`."""

    def __init__(self, ctx: SessionContext, owner: FramedStream, msg: Open, now: float):
        hop = msg.route[msg.hop]
        self.ctx = ctx
        self.open_msg = msg
        self.sid, self.hop, self.route = msg.sid, msg.hop, msg.route
        self.start, self.end = hop.start, hop.end
        self.wire_dtype = msg.wire_dtype or ctx.config.wire_dtype or ctx.span.config.wire_dtype
        self.max_length = msg.max_length
        self.owner = owner  # only it may send steps
        share = share_of(peer_host(owner), msg)
        self.host = share.host  # whose share it counts in
        self.via = share.via  # the node forwarding it here, if one does (its share too)
        self.origin = share.origin  # the user's host, for the next hop
        self.sink: FramedStream | None = None  # the client's connection, on the last hop
        self.downstream: str | None = None  # "host:port" of the next hop
        self.state = SessionState(msg.sid, msg.max_length, last=self.is_last, now=now)
        self.pieces = PromptPieces()
        self.decodes: deque[tuple[Step, torch.Tensor, float]] = deque()  # with arrival time
        self._sink_token = msg.sink_token
        self._tickets: list[Ticket] = []  # places held in the prompt lane
        self._wake = trio.Event()  # something to do came, or the state moved
        self._scope = trio.CancelScope()  # the task's work: cancelled when the session closes

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
        if msg.phase == DECODE:
            self.ctx.uplink.observe_decode_arrival(self.sid)
            self.decodes.append((msg, hidden, now))
        else:
            self.pieces.add(msg, hidden, now)
            self.ctx.observer.prompt_piece(self.sid, now, msg.pos, n, msg.end)
        self._wake.set()

    def attach(self, conn: FramedStream, token: str) -> None:
        """The client claims this last hop's results, proving it with the open's token."""
        if not secrets.compare_digest(self._sink_token.encode(), token.encode()):
            raise SessionNotFound(f"no session {self.sid[:8]}... to attach to here")
        self.state.handle(Attach(sid=self.sid, sink_token=token))
        self.sink = conn
        self._wake.set()  # used now: its idle deadline moves

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
                    if await self._open_next_hop():
                        await self._work(cache)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        except Exception:
            # a bug must cost one connection, never the node and everyone else's sessions
            log.exception("closing connection from %s after an internal error", self.owner.peer())
            await self.owner.aclose()
        finally:
            self.close()

    @asynccontextmanager
    async def _cache(self):
        cache = self.ctx.span.allocate_cache(self.start, self.end, self.max_length)
        try:
            yield cache
        finally:
            self.close()
            cache.keys.clear()
            cache.values.clear()

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
                if self.decodes:
                    await self._decode(cache, *self.decodes.popleft())
                elif self.pieces:
                    await self._prompt_pass(cache)
                else:
                    await self._idle()
        finally:
            for ticket in self._tickets:
                ticket.release()

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
        if await self._forward(step, done):
            out = done.result
            self.ctx.observer.prompt_pass(
                self.sid,
                time.monotonic(),
                step.pos,
                out.shape[1],
                step.end,
                done.elapsed,
                done.usage,
            )

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
        elif self.sink is None:
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
    """The open for the next hop."""
    return Open(
        sid=msg.sid,
        route=msg.route,
        hop=msg.hop + 1,
        fingerprint=msg.fingerprint,
        wire_dtype=msg.wire_dtype,
        max_length=msg.max_length,
        sink_token=msg.sink_token,
        origin=origin,
    )
