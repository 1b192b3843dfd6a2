"""A borrowing session's connection to one lender, in blocking mode (issue #52; who holds it
and when: swarm/node/borrow_link.py): a compute thread asks it a layer's query and waits for
the answer on the socket itself, with no event loop between; a worker thread lends and moves
blocks over it; the node's trio thread looks, between exchanges, for a notice that the lender
leaves. Whoever uses it holds its session's lender lock.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

import trio

from swarm.errors import LenderFailed, ProtocolError, SwarmError
from swarm.lending import Lend, LendLeaving, Lent, Reclaim
from swarm.protocol import Error, KvChunk, Ping, Pong
from swarm.wire import unpack_tensor

if TYPE_CHECKING:
    from swarm.records import NodeRecord
    from swarm.transport_sync import SyncConnection

log = logging.getLogger("swarm.node")

REPLY_S = 30.0  # for a lender's answer
SEND_S = 60.0  # for a frame to leave (a prompt pass's query, blocks lent: megabytes)
PENDING = 32  # lends sent to a new lender before its answers are read


class Link:
    """One connection to a lender. A frame that comes unasked is a leaving notice (`leaving`,
    set in the trio thread of `token`); an answer comes in order, after its question."""

    def __init__(self, conn: SyncConnection, rec: NodeRecord, sid: str, token):
        self.conn, self.peer, self.addr, self.sid = conn, rec.peer, rec.addr, sid
        self.leaving = trio.Event()
        self.ended = False  # nothing more comes from it
        self._token = token

    def send(self, frame) -> None:
        if self.ended:
            raise self._gone()
        try:
            self.conn.send(frame, SEND_S)
        except OSError:
            self._end()
            raise self._gone() from None

    def answer(self, kind: type, to=None, timeout: float = REPLY_S):
        """The next frame, of type `kind` (answering `to`: its sid and layer), a leaving
        notice on the way noted; an Error answer raises its SwarmError, a lost lender (or none
        in `timeout` seconds) LenderFailed."""
        while True:
            try:
                reply = self.conn.receive(timeout) if not self.ended else None
            except OSError:  # the lender's end reset, or no answer in REPLY_S
                reply = None
            if reply is None:
                self._end()
                raise self._gone()
            if not isinstance(reply, LendLeaving):
                break
            check_notice(self.sid, reply)
            self._notify()
        if isinstance(reply, Error):
            raise reply.exception()
        same = to is None or (reply.sid, reply.layer) == (to.sid, to.layer)
        if not isinstance(reply, kind) or not same:
            raise ProtocolError(f"the lender answered {reply!r:.80} to a {kind.__name__} wait")
        return reply

    def exchange(self, frames: list, kind: type) -> list:
        for f in frames:
            self.send(f)
        return [self.answer(kind, f) for f in frames]

    def ping(self, nonce: int, timeout: float) -> None:
        self.send(Ping(nonce=nonce))
        self.answer(Pong, timeout=timeout)

    def look(self) -> None:
        """Read what came unasked, without waiting (in the trio thread, between exchanges): a
        leaving notice sets `leaving`; the end of the stream, or anything else, ends it."""
        if self.ended:
            return
        try:
            frames = self.conn.ready()
        except (OSError, SwarmError) as exc:
            log.debug("lender %s of session %s...: %r", self.addr, self.sid[:8], exc)
            frames = None
        for msg in frames or ():
            if not isinstance(msg, LendLeaving) or msg.sid != self.sid:
                log.debug("lender %s sent %r unasked", self.addr, msg)
                frames = None
                break
        if frames is None:
            self._end()
        elif frames:
            self.leaving.set()

    def close(self) -> None:
        self.ended = True
        self.conn.close()

    def _end(self) -> None:
        """Nothing more comes from it: whoever waits for its notice goes on."""
        if not self.ended:
            self.close()
            self._notify()

    def _notify(self) -> None:
        try:
            self._token.run_sync_soon(self.leaving.set)
        except trio.RunFinishedError:
            pass  # the node has stopped: nobody waits

    def _gone(self) -> LenderFailed:
        return LenderFailed(
            f"the lender {self.peer[:16]} holding this session's oldest KV blocks is gone"
        )


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


def pour(old: Link, new: Link, back: Returned) -> SwarmError | None:
    """What `old` sends back, lent to `new` as it comes; `new`'s refusal (or failure) if it did
    not take it all. Raises what `old` fails with."""
    old.send(Reclaim(sid=back.sid))
    sent: deque[Lend] = deque()
    lengths: dict[int, int] = {}  # per layer, what the new lender says it holds
    refused: SwarmError | None = None
    while not back.done:
        lend = back.take(old.answer(KvChunk))
        if refused is not None:
            continue  # read to the end: the next try's must not find it on the connection
        try:
            new.send(lend)
            sent.append(lend)
            if len(sent) > PENDING:  # its answers must not fill the connection meanwhile
                lend = sent.popleft()
                lengths[lend.layer] = new.answer(Lent, lend).length
        except SwarmError as exc:
            refused = exc
    try:
        for lend in sent if refused is None else ():
            lengths[lend.layer] = new.answer(Lent, lend).length
    except SwarmError as exc:
        refused = exc
    if refused is None and lengths != dict.fromkeys(back.shapes, back.held):
        refused = ProtocolError(f"the new lender holds {lengths} positions, not {back.held}")
    return refused
