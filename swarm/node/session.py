"""A session is a task: it owns its KV cache, opens the next hop, and computes its steps in order.

The connection that opened the session starts its task in that connection's nursery, so a
session never outlives the connection that asked for it. Steps arrive through `take_step`
(checked by the sans-IO `SessionState` and queued); the task computes them one at a time
(steps.py: decode steps first, prompt pieces gathered into passes, each pass awaited in the
compute lanes, its output handed to the uplink). The session ends when its state says
closed: by the client's close, a failure here or downstream, idling, or its connection's end.

A session sees of its node only its `SessionContext`: the blocks, the compute lanes, the uplink,
the next hops, the session table and the configuration, given once by the node. Moving a session
to another node, either way, is swarm/node/handover/; the session keeps only where it stands in
it (`state.move`) and the steps it holds meanwhile.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import trio

from swarm.errors import (
    HandoverRefused,
    NodeBusy,
    PeerFailed,
    ProtocolError,
    SessionNotFound,
    ShapeMismatch,
    SwarmError,
)
from swarm.model.blocks import ring_slots
from swarm.node.admission import Share, peer_host, share_of
from swarm.node.borrow import BorrowedCache, lent_at_most, local_tokens, session_room
from swarm.node.borrow_link import Lender
from swarm.node.context import SessionContext, send_quietly
from swarm.node.prompt import PromptPieces
from swarm.node.session_state import (
    COMING,
    Fail,
    Move,
    MoveEvent,
    SessionState,
    SinkGone,
    StepIn,
    Unpause,
)
from swarm.node.signal import Signal
from swarm.node.steps import StepWork
from swarm.protocol import Attach, Close, Error, Hop, Open, Opened, Step
from swarm.wire import unpack_tensor

if TYPE_CHECKING:
    from swarm.model.blocks import KVCache
    from swarm.node.compute import Ticket
    from swarm.node.handover.cache import CacheIntake
    from swarm.transport import FramedStream

log = logging.getLogger("swarm.node")


class Session(StepWork):
    """One session on this node: blocks start:end of route hop `hop`."""

    def __init__(
        self,
        ctx: SessionContext,
        owner: FramedStream,
        msg: Open,
        now: float,
        share: Share | None = None,
        coming: bool = False,
    ):
        """`share`: whose shares it counts in, if not those of an open from `owner`; `coming`:
        handed over here, its cache still to come (its `intake`)."""
        hop = msg.route[msg.hop]
        self.ctx = ctx
        self.open_msg = msg
        self.sid, self.hop, self.route = msg.sid, msg.hop, msg.route
        self.start, self.end = hop.start, hop.end
        self.wire_dtype = msg.wire_dtype or ctx.config.wire_dtype or ctx.span.config.wire_dtype
        self.max_length = msg.max_length
        # longer than one session may keep here: this many positions here, the oldest lent
        # (borrow.py)
        self.borrow_cap = local_tokens(ctx.span.config, ctx.config.limits, msg.max_length)
        self.local_tokens = self.borrow_cap or msg.max_length
        self.lender: Lender | None = None
        self.owner = owner  # only it may send steps
        self.count_in(share or share_of(peer_host(owner), msg))
        self.sink: FramedStream | None = None  # the client's connection, on the last hop
        self.downstream: str | None = None  # "host:port" of the next hop
        self.state = SessionState(msg.sid, msg.max_length, self.is_last, now, coming)
        self.pieces = PromptPieces()
        self.decodes: deque[tuple[Step, torch.Tensor, float]] = deque()  # with arrival time
        self.sink_token = msg.sink_token
        self._tickets: list[Ticket] = []  # places held in the prompt lane
        self._wake = trio.Event()  # something to do came, or the state moved
        self.changed = Signal()  # its state moved, a pass ended, or it fell quiet
        self._scope = trio.CancelScope()  # the task's work: cancelled when the session closes
        self.cache: KVCache | None = None  # while the task runs
        self._computing = False
        self._idling = False
        self._early = None
        self.prompt_end = 0  # where the prompt it computes last ends
        # a hand-over's steps: held for the replica (sending), from the next owner before the
        # sender released it (receiving); the cache coming through `intake` (receiving)
        self.held: list[Step] = []
        self.early: list[Step] = []
        self.next_owner: FramedStream | None = None
        self.intake: CacheIntake | None = None

    @property
    def round_limit(self) -> int:
        """The most tokens a verification step may carry here: no more than a sliding
        window's ring among its layers has slots (each would then hold one)."""
        return ring_slots(self.ctx.span.config, self.start, self.end, self.max_length)

    @property
    def is_last(self) -> bool:
        return self.hop == len(self.route) - 1

    # ---- what the connections tell it --------------------------------------------------------

    def take_step(self, msg: Step) -> None:
        """Check and queue a step from the owner; raises the SwarmError the owner gets."""
        wire, (msg, hidden) = msg, self._input(msg)
        n, now = hidden.shape[1], time.monotonic()
        spec = msg.spec is not None
        if spec and self.borrow_cap:
            raise ProtocolError("a session borrowing KV blocks takes no verification steps")
        if spec and n > self.round_limit:
            raise ShapeMismatch(
                f"a verification step of {n} tokens is longer than a sliding window here"
                f" ({self.round_limit}): a rewind into it could not restore the window's cache"
            )
        self.state.handle(StepIn(msg.phase, msg.pos, n, msg.end, now, spec=spec))
        if self.state.holds_steps:  # handing over: the replica computes it
            self.held.append(wire)
            return
        if spec:  # a rewind makes the rounds queued after its position stale: dropped
            self._drop_decodes_from(msg.pos)
        self._queue(msg, hidden, now)

    def attach(self, conn: FramedStream, token: str) -> None:
        """The client claims this last hop's results, proving it with the open's token."""
        if not secrets.compare_digest(self.sink_token.encode(), token.encode()):
            raise SessionNotFound(f"no session {self.sid[:8]}... to attach to here")
        self.state.handle(Attach(sid=self.sid, sink_token=token))
        self.sink = conn
        self.changed.fire()
        self._wake.set()  # used now: its idle deadline moves

    def count_in(self, share: Share) -> None:
        self.host = share.host  # whose share it counts in
        self.via = share.via  # the node forwarding it here, if one does (its share too)
        self.origin = share.origin  # the user's host, for the next hop

    def moved(self, event: MoveEvent) -> Move | None:
        """A step of a hand-over (swarm.node.handover); the session's new move, None once it
        has closed. Raises the SwarmError its sender gets."""
        if self.state.closed:
            return None
        move = self.state.move_on(event)
        self.changed.fire()
        return move

    def unpause(self) -> None:
        """The hand-over failed: compute the held steps here after all (a later drain or
        prompt may try again)."""
        if not self.state.accepts(Unpause()):
            return
        self.moved(Unpause())
        held, self.held = self.held, []
        for msg in held:
            self._queue(*self._input(msg), time.monotonic())

    def _input(self, msg: Step) -> tuple[Step, torch.Tensor]:
        """The step's activations [1, tokens, hidden]: off the wire, or at a first hop that
        embeds, its token ids looked up here (the ids then go on only where the model's layers
        read them)."""
        config = self.ctx.span.config
        if msg.hidden is not None or msg.ids is None:  # (neither: unpack names what is wrong)
            return msg, unpack_tensor(msg.hidden, hidden=config.hidden, max_tokens=self.max_length)
        embedding = self.ctx.span.embedding
        if self.hop != 0 or embedding is None:
            raise ProtocolError(
                "a step of token ids without activations: only a route's first hop holding"
                " the embedding table (Opened.embeds) takes them"
            )
        if len(msg.ids) > self.max_length or max(msg.ids) >= embedding.vocab:
            raise ShapeMismatch(
                f"a step of {len(msg.ids)} token ids, the largest {max(msg.ids)}: this session"
                f" holds {self.max_length} tokens of a {embedding.vocab}-token vocabulary"
            )
        hidden = embedding(list(msg.ids))
        return (msg if config.per_layer else replace(msg, ids=None)), hidden

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
        self.changed.fire()

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
        async with trio.open_nursery() as lending:  # its lender's connection tasks
            cache = self.intake.cache if self.intake is not None else self._allocate(lending)
            self.cache = cache
            try:
                yield cache
            finally:
                self.close()
                self.cache = None
                cache.keys.clear()
                cache.values.clear()
                cache.states.clear()
                if self.lender is not None:
                    await self.lender.aclose()  # the lender forgets the blocks with it
                lending.cancel_scope.cancel()

    def _allocate(self, lending: trio.Nursery) -> KVCache | BorrowedCache:
        if self.borrow_cap is None:
            return self.ctx.span.allocate_cache(self.start, self.end, self.max_length)
        cap = self.borrow_cap
        cache = BorrowedCache.allocate(self.ctx.span, self.start, self.end, self.max_length, cap)
        need = lent_at_most(cap, self.max_length) * cache.position_bytes
        self.lender = Lender(self.ctx, self.sid, lending, need)
        return cache

    async def _await_intake(self) -> bool:
        """A handed-over session waits for its cache; False if it did not come in time."""
        with trio.move_on_after(self.ctx.config.limits.open_timeout_s):
            await self.changed.until(lambda: self.state.move is not COMING)
            return True
        err = HandoverRefused("the handed-over cache did not arrive in time")
        await self.fail(Error.of(err, self.sid, self.hop))
        return False

    async def _open_next_hop(self) -> bool:
        """Open the session down the route (the last hop opens at once) and tell the owner;
        False if that failed (the owner has been told why)."""
        if self.state.closed:
            return False  # evicted before its task began
        if self.lender is not None and not await self.lender.any_announced():
            room = session_room(self.ctx.config.limits)
            err = NodeBusy(
                f"session wants {self.max_length} cache tokens, more than the {room} this node"
                " keeps for one session, and no node to borrow from is announced"
            )
            await self.fail(Error.of(err, self.sid, self.hop))
            return False
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
        embeds = self.hop == 0 and self.ctx.span.embedding is not None
        await send_quietly(self.owner, Opened(sid=self.sid, embeds=embeds))
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


def _forwarded(msg: Open, origin: str) -> Open:
    """The open for the next hop: every field as it came (a new one needs no line here)."""
    return replace(msg, hop=msg.hop + 1, origin=origin)
