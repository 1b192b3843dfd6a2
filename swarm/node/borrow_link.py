"""A borrowing session's connection to its lender (issue #52; the pass is swarm/node/borrow.py,
the lender's side swarm/node/lender.py), and its move when that lender leaves.

The lender: of the online nodes of the DHT other than this one (`--role cache` nodes first, then
the most free cache tokens), the first PROBED are dialled at once and pinged, and the one with
the least trip (round trip + TRIP_S) x (1 + its load: the sessions it serves, one more if it
serves blocks) that takes the blocks lends: every decode step waits for one trip a layer to it
(those whose records offer less than the session lends at most after the others). One
connection per session, read by a task of its own, so the lender's notice that it leaves
(`LendLeaving`) is seen between steps too. The session then asks its blocks back (`Reclaim`)
and lends them, as they come, to the next candidate; once that one holds every position, the
session's queries go there and the old connection closes. The move holds the session's
exchanges with its lender: a query waits for it, then goes to the new lender, which holds the
very bytes the old one did, so every answer is exact. Nowhere to go: it tries again, less and
less often, while the old lender stays; a lender that goes first, or dies, fails the session,
which the client replays as when a node dies.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch
import trio

from swarm.errors import LenderFailed, LendRefused, PeerFailed, ProtocolError, SwarmError
from swarm.lending import AT_ONCE_ROWS, Lend, LendLeaving, Lent, LentPartial, Reclaim
from swarm.node.borrow import attend_request, lend_frames, partial_of
from swarm.protocol import Error, KvChunk, Ping, Pong
from swarm.records import CACHE, ONLINE
from swarm.transport import dial_hop
from swarm.wire import unpack_tensor

if TYPE_CHECKING:
    from swarm.model.blocks import Block
    from swarm.model.partial_attention import Partial
    from swarm.node.borrow import BorrowedCache
    from swarm.node.context import SessionContext
    from swarm.records import NodeRecord
    from swarm.transport import FramedStream

log = logging.getLogger("swarm.node")

DIAL_S = 10.0  # to reach a lender
REPLY_S = 30.0  # for a lender's answer
RETRY_S = 1.0  # before trying again to find a leaving lender's blocks a new one, doubling
MAX_RETRY_S = 8.0
PENDING = 32  # lends sent to a new lender before its answers are read
PROBED = 3  # candidate lenders whose round trip is measured before the first lend
# what a layer's trip to a lender costs beside the wire, both ends' work and wake-ups (~2.5 ms
# on loopback, docs/benchmarks.md 2026-11-28): pings a millisecond apart are alike, and load
# tells them apart
TRIP_S = 0.0025
QUEUED = 64  # a lender's frames read ahead of whoever waits for them


class Link:
    """One connection to a lender; `read`, a task, passes its answers on in order and sets
    `leaving` when the lender says it leaves."""

    def __init__(self, conn: FramedStream, rec: NodeRecord, sid: str):
        self.conn, self.peer, self.addr, self.sid = conn, rec.peer, rec.addr, sid
        self.leaving = trio.Event()
        self.ended = False  # nothing more comes from it
        self._in, self._out = trio.open_memory_channel(QUEUED)

    async def read(self) -> None:
        try:
            while (msg := await self.conn.receive()) is not None:
                if isinstance(msg, LendLeaving):
                    check_notice(self.sid, msg)
                    self.leaving.set()
                else:
                    await self._in.send(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, SwarmError) as exc:
            log.debug("lender %s of session %s...: %r", self.addr, self.sid[:8], exc)
        finally:
            self.ended = True
            self._in.close()
            self.leaving.set()  # whoever waits for its notice: nothing more comes

    async def send(self, frame, at_once: bool = False) -> None:
        try:
            await self.conn.send(frame, at_once)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            raise self._gone() from None

    async def answer(self, kind: type, to=None):
        """The next frame, of type `kind` (answering `to`: its sid and layer); an Error answer
        raises its SwarmError, a lost lender PeerFailed."""
        try:
            with trio.fail_after(REPLY_S):
                reply = await self._out.receive()
        except (trio.EndOfChannel, trio.TooSlowError):
            raise self._gone() from None
        if isinstance(reply, Error):
            raise reply.exception()
        same = to is None or (reply.sid, reply.layer) == (to.sid, to.layer)
        if not isinstance(reply, kind) or not same:
            raise ProtocolError(f"the lender answered {reply!r:.80} to a {kind.__name__} wait")
        return reply

    async def exchange(self, frames: list, kind: type) -> list:
        for f in frames:
            await self.send(f)
        return [await self.answer(kind, f) for f in frames]

    async def aclose(self) -> None:
        await self.conn.aclose()

    def _gone(self) -> LenderFailed:
        return LenderFailed(
            f"the lender {self.peer[:16]} holding this session's oldest KV blocks is gone"
        )


def lenders_of(records: list[NodeRecord], me: str, plaintext: bool) -> list[NodeRecord]:
    """The nodes of `records` a session here may borrow from: online, not this one (`me`),
    over TLS unless this node runs plaintext."""
    return [r for r in records if r.state == ONLINE and r.peer != me and (r.tls or plaintext)]


def _load(rec: NodeRecord) -> int:
    """What else a lender answers beside this session's queries: the sessions it serves, and
    one more for a node that computes blocks at all (a `--role cache` node only lends)."""
    return rec.sessions + (rec.role != CACHE)


def check_notice(sid: str, msg: LendLeaving) -> None:
    """A leaving notice on a session's lender connection names that session, or is forged."""
    if msg.sid != sid:
        raise ProtocolError(
            f"a lender's leaving notice names session {msg.sid[:8]}..., this connection lent"
            f" for {sid[:8]}..."
        )


class Returned:
    """What a leaving lender sends back for a Reclaim, checked against what was lent (each
    lending layer in turn, positions [0, held) in order), each piece as the Lend that gives it
    to the next lender."""

    def __init__(self, sid: str, shapes: dict[int, tuple[int, int]], held: int):
        self.sid, self.shapes, self.held = sid, shapes, held
        self._layers = sorted(shapes)  # still to come
        self._pos = 0

    @property
    def done(self) -> bool:
        return not self._layers

    def take(self, chunk: KvChunk) -> Lend:
        """Raises ProtocolError (or the wire's ShapeMismatch) for a piece out of place."""
        want = (self.sid, self._layers[0], self._pos) if self._layers else None
        if (chunk.sid, chunk.layer, chunk.pos) != want:
            raise ProtocolError(
                f"the lender sent back layer {chunk.layer} at position {chunk.pos} of session"
                f" {chunk.sid[:8]}...; "
                + (f"layer {want[1]} at {want[2]} was next" if want else "all had come")
            )
        heads, head_dim = self.shapes[chunk.layer]
        left = self.held - self._pos
        k = unpack_tensor(chunk.keys, hidden=heads * head_dim, max_tokens=left, native=True)
        n = k.shape[1]
        unpack_tensor(chunk.values, hidden=heads * head_dim, max_tokens=n, tokens=n, native=True)
        self._pos += n
        if self._pos == self.held:
            self._layers.pop(0)
            self._pos = 0
        return Lend(self.sid, chunk.layer, chunk.pos, heads, head_dim, chunk.keys, chunk.values)


class Lender:
    """One session's lender, driven from the trio thread (a compute lane calls `lend_sync` and
    `attend_soon`); its connection's tasks run in `nursery`, the session's."""

    def __init__(self, ctx: SessionContext, sid: str, nursery: trio.Nursery, need: int = 0):
        """`need`: the bytes the session lends at most; lenders offering that come first."""
        self.ctx, self.sid, self._nursery = ctx, sid, nursery
        self.need = need
        self.token = trio.lowlevel.current_trio_token()
        self.link: Link | None = None
        self._lock = trio.Lock()  # one exchange at a time; a move between two
        self.held = 0  # positions [0, held) of each lending layer are at the lender
        self.shapes: dict[int, tuple[int, int]] = {}  # lending layer: kv heads, head_dim
        self._closed = False  # the session ended: a move under way must not switch

    @property
    def lending(self) -> bool:
        """Blocks of the session are at the lender."""
        return self.link is not None

    @property
    def peer(self) -> str:
        return self.link.peer if self.link is not None else ""

    def lend_sync(self, cache: BorrowedCache, n: int) -> None:
        trio.from_thread.run(self.lend, cache, n, trio_token=self.token)

    def attend_soon(self, layer: int, upto: int, q: torch.Tensor, block: Block) -> Future:
        """`attend`, started from a compute thread, which goes on meanwhile (the local piece
        of the layer's attention) and takes the lender's piece from the Future after."""
        done: Future = Future()

        async def run() -> None:
            try:
                done.set_result(await self.attend(layer, upto, q, block))
            except BaseException as exc:  # noqa: BLE001 (the compute thread raises it)
                done.set_exception(exc)

        def spawn() -> None:  # in the trio thread, where what it raises would end the run
            try:
                trio.lowlevel.spawn_system_task(run)
            except BaseException as exc:  # noqa: BLE001 (the compute thread raises it)
                done.set_exception(exc)

        # without waiting for the trio thread to take it: the local piece starts at once
        self.token.run_sync_soon(spawn)
        return done

    async def lend(self, cache: BorrowedCache, n: int) -> None:
        """Send the `n` oldest local positions of every lending layer; the first time, to the
        first candidate that takes them."""
        frames = lend_frames(self.sid, cache, n)
        if not frames:
            return  # every layer here a ring: nothing to lend
        async with self._lock:
            if self.link is not None:
                await self.link.exchange(frames, Lent)
            else:
                await self._first_lend(frames, cache.length + n)
            self.held = cache.offset + n
            self.shapes = {f.layer: (f.kv_heads, f.head_dim) for f in frames}

    async def any_announced(self) -> bool:
        """Some node the session could borrow from is announced (none: refuse it at once)."""
        return bool(await self._candidates())

    async def attend(self, layer: int, upto: int, q: torch.Tensor, block: Block) -> Partial:
        """The lender's piece of `layer`'s attention for rows q [rows, heads, head_dim]."""
        async with self._lock:
            if self.link is None:
                raise LenderFailed("this session's lender is gone")
            ask = attend_request(self.sid, layer, upto, q, block)
            await self.link.send(ask, at_once=q.shape[0] <= AT_ONCE_ROWS)
            reply = await self.link.answer(LentPartial, ask)
        return partial_of(reply, q.shape[0], block)

    async def aclose(self) -> None:
        self._closed = True
        link, self.link = self.link, None
        if link is not None:
            await link.aclose()

    async def _first_lend(self, frames: list[Lend], tokens: int) -> None:
        tried: list[str] = []
        ranked = await self._ranked(await self._candidates(), tried)
        try:
            for rec, link in ranked:
                if link is None:
                    try:
                        link = await self._open(rec)
                    except PeerFailed as exc:
                        tried.append(f"{rec.addr}: {exc}")
                        continue
                try:
                    await link.exchange(frames, Lent)
                except (LendRefused, PeerFailed) as exc:
                    tried.append(f"{rec.addr}: {exc}")
                    await link.aclose()
                    continue
                self.link = link
                log.info("session %s... lends its oldest KV blocks to %s", self.sid[:8], rec.addr)
                return
        finally:
            for _, link in ranked:
                if link is not None and link is not self.link:
                    await link.aclose()
        raise LendRefused(
            f"this node's cache is short for a session of {tokens} tokens and no"
            f" lender took its oldest blocks ({'; '.join(tried) or 'none announced'})"
        )

    async def _ranked(
        self, records: list[NodeRecord], tried: list[str]
    ) -> list[tuple[NodeRecord, Link | None]]:
        """`records` best first: the first PROBED dialled at once and pinged, by (round trip +
        TRIP_S) x (1 + their load, `_load`), with their open links (those unreachable noted in
        `tried`); the rest after them, in their order, not dialled yet."""
        probed, found = records[:PROBED], {}

        async def probe(i: int, rec: NodeRecord) -> None:
            try:
                link = await self._open(rec)
            except PeerFailed as exc:
                tried.append(f"{rec.addr}: {exc}")
                return
            failed = f"no answer to a ping in {DIAL_S:.0f} s"
            with trio.move_on_after(DIAL_S):
                try:
                    start = trio.current_time()
                    await link.send(Ping(nonce=i))
                    await link.answer(Pong)
                    trip = trio.current_time() - start + TRIP_S
                    found[i] = (trip * (1 + _load(rec)), link)
                    return
                except SwarmError as exc:
                    failed = str(exc)
            tried.append(f"{rec.addr}: {failed}")
            await link.aclose()

        async with trio.open_nursery() as nursery:
            for i, rec in enumerate(probed):
                nursery.start_soon(probe, i, rec)
        best = sorted(found, key=lambda i: (self._short(probed[i]), found[i][0]))
        return [(probed[i], found[i][1]) for i in best] + [(r, None) for r in records[PROBED:]]

    async def _open(self, rec: NodeRecord) -> Link:
        """A connection to `rec`, read by its task; and, when it says it leaves, the move."""
        link = Link(await self._dial(rec), rec, self.sid)
        self._nursery.start_soon(link.read)
        self._nursery.start_soon(self._follow, link)
        return link

    async def _follow(self, link: Link) -> None:
        await link.leaving.wait()
        if self.link is not link or link.ended:
            return  # closed, or lost: nothing to move
        log.info("session %s...'s lender %s leaves: moving its blocks", self.sid[:8], link.addr)
        wait = RETRY_S
        while True:
            async with self._lock:
                if self.link is not link or link.ended or await self._move(link, wait == RETRY_S):
                    return
            await trio.sleep(wait)
            wait = min(2 * wait, MAX_RETRY_S)  # each try moves every block: not every second

    async def _move(self, old: Link, first: bool) -> bool:
        """Lend what `old` holds to another candidate and switch to it; False if none took it
        (and `old` still answers)."""
        tried = []
        for rec in await self._candidates(exclude=old.peer):
            try:
                new = await self._open(rec)
            except PeerFailed as exc:
                tried.append(f"{rec.addr}: {exc}")
                continue
            try:
                refused = await self._pour(old, new)
            except SwarmError as exc:  # from the old lender: it cannot give the blocks back
                await new.aclose()
                await old.aclose()  # the session's next step fails, and replays
                log.warning("session %s...: %s: giving its blocks back failed", self.sid[:8], exc)
                return True
            if refused is not None or self._closed:
                await new.aclose()
                if self._closed:
                    return True
                tried.append(f"{rec.addr}: {refused}")
                continue
            self.link = new
            await old.aclose()
            log.info(
                "session %s... moved its lent KV blocks (%d positions) from %s to %s",
                *(self.sid[:8], self.held, old.addr, rec.addr),
            )
            return True
        log.log(
            logging.WARNING if first else logging.DEBUG,
            "session %s...'s lender %s leaves and no other took its blocks (%s): trying again"
            " until it has gone; the session replays if it goes first",
            *(self.sid[:8], old.addr, "; ".join(tried) or "none announced"),
        )
        return False

    async def _pour(self, old: Link, new: Link) -> SwarmError | None:
        """What `old` sends back, lent to `new` as it comes; `new`'s refusal (or failure) if
        it did not take it all. Raises what `old` fails with."""
        back = Returned(self.sid, self.shapes, self.held)
        await old.send(Reclaim(sid=self.sid))
        sent: deque[Lend] = deque()
        lengths: dict[int, int] = {}  # per layer, what the new lender says it holds
        refused: SwarmError | None = None
        while not back.done:
            lend = back.take(await old.answer(KvChunk))
            if refused is not None:
                continue  # read to the end: the next try's must not find it on the connection
            try:
                await new.send(lend)
                sent.append(lend)
                if len(sent) > PENDING:  # its answers must not fill the connection meanwhile
                    lend = sent.popleft()
                    lengths[lend.layer] = (await new.answer(Lent, lend)).length
            except SwarmError as exc:
                refused = exc
        try:
            for lend in sent if refused is None else ():
                lengths[lend.layer] = (await new.answer(Lent, lend)).length
        except SwarmError as exc:
            refused = exc
        if refused is None and lengths != dict.fromkeys(self.shapes, self.held):
            refused = ProtocolError(f"the new lender holds {lengths} positions, not {self.held}")
        return refused

    async def _candidates(self, exclude: str = "") -> list[NodeRecord]:
        directory = self.ctx.directory
        records = await directory.fresh()
        ok = lenders_of(records, self.ctx.key.peer, directory.plaintext)
        ok = [r for r in ok if r.peer != exclude]
        return sorted(ok, key=lambda r: (self._short(r), r.role != CACHE, -r.free_cache_tokens))

    def _short(self, rec: NodeRecord) -> bool:
        """`rec` offers less than the session lends at most (it may take the first blocks and
        refuse later ones: the session then replays)."""
        return rec.lend_free_mb * 2**20 < self.need

    async def _dial(self, rec: NodeRecord) -> FramedStream:
        try:
            with trio.fail_after(DIAL_S):
                return await dial_hop(rec.hop(), self.ctx.config.limits.max_frame)
        except (OSError, ValueError, trio.TooSlowError, trio.BrokenResourceError) as exc:
            raise PeerFailed(f"cannot reach it: {exc or type(exc).__name__}") from None
        except SwarmError as exc:
            raise PeerFailed(str(exc)) from None
