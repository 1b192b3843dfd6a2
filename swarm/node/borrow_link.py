"""A borrowing session's lender (issue #52; the pass is swarm/node/borrow.py, the connection
swarm/node/lender_link.py, the lender's side swarm/node/lender.py), and its move when that
lender leaves.

The lender: of the online nodes of the DHT other than this one (`--role cache` nodes first, then
the most free cache tokens), the first PROBED are dialled at once and pinged, and the one with
the least trip (round trip + TRIP_S) x (1 + its load: the sessions it serves, one more if it
serves blocks) that takes the blocks lends: every decode step waits for one trip a layer to it
(those whose records offer less than the session lends at most after the others).

One connection per session, in blocking mode: the pass's compute thread sends a layer's query
itself, computes the layer's local piece meanwhile, then reads the answer off the socket, with
no hand-off to the trio thread and back (each cost ~0.3 ms and a wake-up of another thread,
docs/benchmarks.md 2026-11-28). One lock (`_lock`, a thread lock) holds the connection for
whoever uses it: that thread's trips and lends, a worker thread's move, and the trio thread's
look every WATCH_S, between exchanges, for the lender's notice that it leaves (`LendLeaving`).
The session then asks its blocks back (`Reclaim`) and lends them, as they come, to the next
candidate; once that one holds every position, the session's queries go there and the old
connection closes. The move holds the lock: a query waits for it, then goes to the new lender,
which holds the very bytes the old one did, so every answer is exact. Nowhere to go: it tries
again, less and less often, while the old lender stays; a lender that goes first, or dies,
fails the session, which the client replays as when a node dies.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch
import trio

from swarm.errors import LenderFailed, LendRefused, PeerFailed, SwarmError
from swarm.lending import Lend, Lent, LentPartial
from swarm.node.borrow import attend_request, lend_frames, partial_of
from swarm.node.lender_link import Link, Returned, pour
from swarm.records import CACHE, ONLINE
from swarm.transport_sync import dial_sync

if TYPE_CHECKING:
    from swarm.lending import AttendLent
    from swarm.model.blocks import Block
    from swarm.model.partial_attention import Partial
    from swarm.node.borrow import BorrowedCache
    from swarm.node.context import SessionContext
    from swarm.records import NodeRecord

log = logging.getLogger("swarm.node")

DIAL_S = 10.0  # to reach a lender
RETRY_S = 1.0  # before trying again to find a leaving lender's blocks a new one, doubling
MAX_RETRY_S = 8.0
PROBED = 3  # candidate lenders whose round trip is measured before the first lend
# what a layer's trip to a lender costs beside the wire, both ends' work and wake-ups (~2.5 ms
# on loopback, docs/benchmarks.md 2026-11-28): pings a millisecond apart are alike, and load
# tells them apart
TRIP_S = 0.0025
WATCH_S = 0.1  # between looks for a leaving notice: a lender leaves within seconds (--grace)


def lenders_of(records: list[NodeRecord], me: str, plaintext: bool) -> list[NodeRecord]:
    """The nodes of `records` a session here may borrow from: online, not this one (`me`),
    over TLS unless this node runs plaintext."""
    return [r for r in records if r.state == ONLINE and r.peer != me and (r.tls or plaintext)]


def _load(rec: NodeRecord) -> int:
    """What else a lender answers beside this session's queries: the sessions it serves, and
    one more for a node that computes blocks at all (a `--role cache` node only lends)."""
    return rec.sessions + (rec.role != CACHE)


class Trip:
    """A layer's query on its way to the lender, the connection held for its answer: `result`
    takes it; leaving the `with` block without it gives the connection up (the answer would
    be read as the next one's)."""

    def __init__(self, lender: Lender, link: Link, ask: AttendLent, rows: int, block: Block):
        self._lender, self._link, self._ask = lender, link, ask
        self._rows, self._block = rows, block
        self._held = True

    def result(self) -> Partial:
        try:
            reply = self._link.answer(LentPartial, self._ask)
        finally:
            self._release()
        return partial_of(reply, self._rows, self._block)

    def __enter__(self) -> Trip:
        return self

    def __exit__(self, *exc) -> None:
        if self._held:
            self._link.close()
            self._release()

    def _release(self) -> None:
        self._held = False
        self._lender.release()


class Lender:
    """One session's lender: a compute thread calls `lend_sync` and `attend_soon`; the first
    lend and a move run from the trio thread, the connection's checks in `nursery`, the
    session's."""

    def __init__(self, ctx: SessionContext, sid: str, nursery: trio.Nursery, need: int = 0):
        """`need`: the bytes the session lends at most; lenders offering that come first."""
        self.ctx, self.sid, self._nursery = ctx, sid, nursery
        self.need = need
        self.token = trio.lowlevel.current_trio_token()
        self.link: Link | None = None
        self._lock = threading.Lock()  # one exchange at a time; a move between two
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
        """Send the `n` oldest local positions of every lending layer; the first time (from
        the trio thread), to the first candidate that takes them."""
        frames = lend_frames(self.sid, cache, n)
        if not frames:
            return  # every layer here a ring: nothing to lend
        with self._lock:
            if self.link is not None:
                self.link.exchange(frames, Lent)
                self._lent(frames, cache.offset + n)
                return
        self._lent(frames, cache.offset + n)  # before a move can read it
        args = (frames, cache.length + n)
        trio.from_thread.run(self._first_lend, *args, trio_token=self.token)

    def attend_soon(self, layer: int, upto: int, q: torch.Tensor, block: Block) -> Trip:
        """Send the query of rows q [rows, heads, head_dim] over the `upto` lent positions of
        `layer` (from a compute thread, which goes on with the layer's local piece): the
        lender's piece is the Trip's `result`."""
        self._lock.acquire()
        try:
            if self.link is None:
                raise LenderFailed("this session's lender is gone")
            ask = attend_request(self.sid, layer, upto, q, block)
            self.link.send(ask)
        except BaseException:
            self._lock.release()
            raise
        return Trip(self, self.link, ask, q.shape[0], block)

    def release(self) -> None:
        self._lock.release()

    async def any_announced(self) -> bool:
        """Some node the session could borrow from is announced (none: refuse it at once)."""
        return bool(await self._candidates())

    async def aclose(self) -> None:
        self._closed = True
        link, self.link = self.link, None
        if link is not None:
            link.close()  # a thread waiting on it wakes, and fails

    def _lent(self, frames: list[Lend], held: int) -> None:
        self.held = held
        self.shapes = {f.layer: (f.kv_heads, f.head_dim) for f in frames}

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
                    await trio.to_thread.run_sync(link.exchange, frames, Lent)
                except SwarmError as exc:
                    link.close()
                    if not isinstance(exc, (LendRefused, PeerFailed)):
                        raise
                    tried.append(f"{rec.addr}: {exc}")
                    continue
                self._adopt(link)
                log.info("session %s... lends its oldest KV blocks to %s", self.sid[:8], rec.addr)
                return
        finally:
            for _, link in ranked:
                if link is not None and link is not self.link:
                    link.close()
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
            start = time.perf_counter()
            try:
                await trio.to_thread.run_sync(link.ping, i, DIAL_S)
            except SwarmError as exc:
                tried.append(f"{rec.addr}: {exc}")
                link.close()
                return
            trip = time.perf_counter() - start + TRIP_S
            found[i] = (trip * (1 + _load(rec)), link)

        async with trio.open_nursery() as nursery:
            for i, rec in enumerate(probed):
                nursery.start_soon(probe, i, rec)
        best = sorted(found, key=lambda i: (self._short(probed[i]), found[i][0]))
        return [(probed[i], found[i][1]) for i in best] + [(r, None) for r in records[PROBED:]]

    async def _open(self, rec: NodeRecord) -> Link:
        """A connection to `rec` (PeerFailed if it cannot be had)."""
        max_frame = self.ctx.config.limits.max_frame
        try:
            conn = await trio.to_thread.run_sync(dial_sync, rec.hop(), max_frame, DIAL_S)
        except (OSError, ValueError) as exc:
            raise PeerFailed(f"cannot reach it: {exc or type(exc).__name__}") from None
        except SwarmError as exc:
            raise PeerFailed(str(exc)) from None
        return Link(conn, rec, self.sid, self.token)

    def _adopt(self, link: Link) -> None:
        """`link` is the session's lender's now: its notice is watched for, and followed."""
        first = self.link is None
        self.link = link
        if first:
            self._nursery.start_soon(self._watch)
        self._nursery.start_soon(self._follow, link)

    async def _watch(self) -> None:
        while not self._closed:
            await trio.sleep(WATCH_S)
            if self._lock.acquire(blocking=False):  # else an exchange reads what comes
                try:
                    if self.link is not None:
                        self.link.look()
                finally:
                    self._lock.release()

    async def _follow(self, link: Link) -> None:
        await link.leaving.wait()
        if self.link is not link or link.ended:
            return  # closed, or lost: nothing to move
        log.info("session %s...'s lender %s leaves: moving its blocks", self.sid[:8], link.addr)
        wait = RETRY_S
        while not await self._move(link, wait == RETRY_S):
            await trio.sleep(wait)
            wait = min(2 * wait, MAX_RETRY_S)  # each try moves every block: not every second

    async def _move(self, old: Link, first: bool) -> bool:
        """Lend what `old` holds to another candidate and switch to it; False if none took it
        (and `old` still answers)."""
        tried = []
        for rec in await self._candidates(exclude=old.peer):
            if self.link is not old or old.ended:
                return True  # the session ended, or the lender went first: nothing to move
            try:
                new = await self._open(rec)
            except PeerFailed as exc:
                tried.append(f"{rec.addr}: {exc}")
                continue
            try:
                refused = await trio.to_thread.run_sync(self._switch, old, new)
            except SwarmError as exc:  # from the old lender: it cannot give the blocks back
                new.close()
                old.close()  # the session's next step fails, and replays
                log.warning("session %s...: %s: giving its blocks back failed", self.sid[:8], exc)
                return True
            if refused is not None:
                tried.append(f"{rec.addr}: {refused}")
                continue
            if self.link is new:
                self._adopt(new)
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

    def _switch(self, old: Link, new: Link) -> SwarmError | None:
        """In a worker thread, holding the session's exchanges: what `old` holds, lent to
        `new`, which is the lender then (else closed); `new`'s refusal if it did not take it
        all."""
        refused = None
        with self._lock:
            if self.link is old and not old.ended and not self._closed:
                refused = pour(old, new, Returned(self.sid, self.shapes, self.held))
                if refused is None and not self._closed:
                    self.link = new
                    old.close()
                    return None
        new.close()
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
