"""A session is a task: it owns its KV cache, opens the next hop, and computes its steps in order.

The connection that opened the session starts its task in that connection's nursery, so a
session never outlives the connection that asked for it. Steps arrive through `take_step`
(checked by the sans-IO `SessionState` and queued); the task computes them one at a time,
decode steps first, prompt pieces gathered into passes (see prompt.py), awaiting each pass in
the compute lanes, and hands the output to the uplink. The session ends when its state says
closed: by the client's close, a failure here or downstream, idling, or its connection's end.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections import deque
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import torch
import trio

from swarm.errors import PeerFailed, ProtocolError, SessionNotFound, SwarmError, UnannouncedPeer
from swarm.model.blocks import KVCache
from swarm.node.admission import peer_host
from swarm.node.compute import Done, Ticket
from swarm.node.passes import DecodeItem, decode_pass, forward_pass
from swarm.node.prompt import PromptPieces
from swarm.node.session_state import OPEN, OPENING, Fail, SessionState, SinkGone, StepIn
from swarm.node.uplink import Payload
from swarm.protocol import DECODE, PREFILL, Attach, Close, Error, Open, Opened, Step
from swarm.transport import FramedStream
from swarm.wire import unpack_tensor

if TYPE_CHECKING:
    from swarm.node.server import Node

log = logging.getLogger("swarm.node")


async def send_quietly(conn: FramedStream, msg) -> None:
    try:
        with trio.move_on_after(5):
            await conn.send(msg)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass


class Session:
    """One session on this node: blocks start:end of route hop `hop`."""

    def __init__(self, node: Node, owner: FramedStream, msg: Open, now: float):
        hop = msg.route[msg.hop]
        self.node = node
        self.open_msg = msg
        self.sid, self.hop, self.route = msg.sid, msg.hop, msg.route
        self.start, self.end = hop.start, hop.end
        self.wire_dtype = msg.wire_dtype or node.config.wire_dtype
        self.max_length = msg.max_length
        self.owner = owner  # only it may send steps
        self.host = peer_host(owner)  # whose share it counts in
        self.sink: FramedStream | None = None  # the client's connection, on the last hop
        self.downstream: str | None = None  # "host:port" of the next hop
        self.state = SessionState(msg.sid, msg.max_length, last=self.is_last, now=now)
        self.pieces = PromptPieces()
        self.decodes: deque[tuple[Step, torch.Tensor, float]] = deque()  # with arrival time
        self._sink_token = msg.sink_token
        self._open_error: Error | None = None
        self._tickets: list[Ticket] = []  # places held in the prompt lane
        self._wake = trio.Event()  # something to do came
        self._settled = trio.Event()  # the next hop answered the open, or the session ended
        self._ended = trio.Event()

    @property
    def is_last(self) -> bool:
        return self.hop == len(self.route) - 1

    # ---- what the connections tell it --------------------------------------------------------

    def take_step(self, msg: Step) -> None:
        """Check and queue a step from the owner; raises the SwarmError the owner gets."""
        hidden = unpack_tensor(
            msg.hidden, hidden=self.node.span.config.hidden, max_tokens=self.max_length
        )
        n, now = hidden.shape[1], time.monotonic()
        self.state.handle(StepIn(msg.phase, msg.pos, n, msg.end, now))
        if msg.phase == DECODE:
            self.node.uplink.observe_decode_arrival(self.sid)
            self.decodes.append((msg, hidden, now))
        else:
            self.pieces.add(msg, hidden, now)
            self.node.observer.prompt_piece(self.sid, now, msg.pos, n, msg.end)
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
        """The next hop's answer to the open, or its error later."""
        if self.state.state is OPENING:
            if isinstance(msg, Opened):
                self.state.handle(msg)
            else:
                self._open_error = msg
            self._settled.set()
        elif isinstance(msg, Error):
            await self.fail(msg)

    # ---- its end -----------------------------------------------------------------------------

    def close(self) -> None:
        """End the session (idempotent)."""
        if not self.state.closed:
            self.state.handle(Close(sid=self.sid))
        self._let_go()
        self._settled.set()
        self._ended.set()

    async def fail(self, error: Error) -> None:
        """Tell the session's upstream (and so, hop by hop, the client) and end the session."""
        if self.state.closed:
            return
        self.state.handle(Fail(error))
        self._let_go()
        self.node.errors_sent += 1
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
        if not self.node.sessions.remove(self):
            return
        log.info("session %s... closed", self.sid[:8])
        self.node.uplink.end_session(self.sid)
        ds = self.node.downstream.stream(self.downstream) if self.downstream else None
        if ds is not None:
            self.node.uplink.send_control(ds, Close(sid=self.sid))

    # ---- its task ----------------------------------------------------------------------------

    async def run(self) -> None:
        """The session's life: open the next hop, then compute steps until the session ends."""
        try:
            async with self._cache() as cache:
                if await self._open_next_hop():
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._work, cache)
                        await self._ended.wait()
                        nursery.cancel_scope.cancel()
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
        span = self.node.span
        cache = span.allocate_cache(self.end - self.start, self.max_length)
        try:
            yield cache
        finally:
            self.close()
            cache.keys.clear()
            cache.values.clear()

    async def _open_next_hop(self) -> bool:
        msg = self.open_msg
        if self.is_last:
            self.state.handle(Opened(sid=self.sid))
        else:
            nxt = msg.route[msg.hop + 1]
            dest = nxt.link
            try:
                await self.node.directory.check(nxt)
            except UnannouncedPeer as exc:
                self.close()
                await send_quietly(self.owner, Error.of(exc, sid=self.sid, hop=msg.hop + 1))
                return False
            try:
                ds = await self.node.downstream.connect(nxt)
            except (
                OSError,
                UnicodeError,
                ValueError,
                trio.TooSlowError,
                trio.BrokenResourceError,
                SwarmError,
            ) as exc:
                # unreachable, unresolvable, not a valid host name, a failed TLS handshake,
                # the wrong peer there or a relay that does not know it
                self.close()
                err = (
                    exc
                    if isinstance(exc, SwarmError)
                    else PeerFailed(
                        f"cannot reach hop {msg.hop + 1} at {dest}: {exc or type(exc).__name__}"
                    )
                )
                await send_quietly(self.owner, Error.of(err, sid=self.sid, hop=msg.hop + 1))
                return False
            self.downstream = dest
            self.node.uplink.send_control(ds, _forwarded(msg))
            with trio.move_on_after(self.node.config.limits.open_timeout_s):
                await self._settled.wait()
            if self.state.state is not OPEN:
                err = self._open_error or Error.of(
                    PeerFailed(f"hop {msg.hop + 1} at {dest} did not answer the open"),
                    sid=self.sid,
                    hop=msg.hop + 1,
                )
                self.close()
                await send_quietly(self.owner, err)
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
        limits = self.node.config.limits
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
        compute, span = self.node.compute, self.node.span
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
            self.node.observer.decode_step(arrived, time.monotonic(), done.elapsed, done.usage)

    async def _prompt_pass(self, cache: KVCache) -> None:
        """Wait for the prompt lane, then compute what has arrived by then (up to a pass's
        worth), holding the next place in the lane already if more waits."""
        config, compute = self.node.config.compute, self.node.compute
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
            forward_pass, self.node.span, cache, self.start, self.end, step.pos, hidden
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
            self.node.observer.prompt_pass(
                self.sid,
                time.monotonic(),
                step.pos,
                out.shape[1],
                step.end,
                done.elapsed,
                done.usage,
            )

    def _rank(self) -> float:
        compute = self.node.compute
        left = self.pieces.tokens_left()
        rank = compute.prefill_rank(self.pieces.prompt_since, left)
        per_token = compute.prefill_token_seconds or 0.0
        cost = min(left, self.node.config.compute.pass_tokens) * per_token
        return self.node.sessions.prompt_rank(self, rank, cost)

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
        self.node.steps_done += 1
        self.node.tokens_done += n
        if self.is_last:
            if step.pos + n != step.end:
                return True  # a middle chunk of a prefill: the client needs only the last token
            if self.sink is None:
                err = SessionNotFound("no client attached to receive results")
                await self.fail(Error.of(err, self.sid, self.hop))
                return False
            payload = Payload(
                self.sink,
                "client",
                self.sid,
                DECODE,
                step.pos,
                step.end,
                out[:, -1:],
                self.wire_dtype,
                result=True,
            )
        else:
            ds = self.node.downstream.stream(self.downstream)
            if ds is None:
                return True
            payload = Payload(
                ds,
                self.downstream,
                self.sid,
                step.phase,
                step.pos,
                step.end,
                out,
                self.wire_dtype,
                result=False,
            )
        self.node.uplink.send_activations(payload)
        return True


def _forwarded(msg: Open) -> Open:
    """The open for the next hop."""
    return Open(
        sid=msg.sid,
        route=msg.route,
        hop=msg.hop + 1,
        fingerprint=msg.fingerprint,
        wire_dtype=msg.wire_dtype,
        max_length=msg.max_length,
        sink_token=msg.sink_token,
    )
