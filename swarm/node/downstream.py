"""Connections to the next hops: one per address, shared by every session going there.

Each connection has a reader task for what comes back (open acknowledgements, errors, pongs).
Two kinds of ping travel on it, told apart by their nonce: round-trip pings this pool sends every
PING_INTERVAL seconds, and the acknowledgement pings the uplink sends behind activation frames.
Their pongs feed the uplink's link estimate. A lost connection is reported to every session that
goes through it. Only next hops the DHT announces are dialled (directory.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import trio

from swarm.errors import PeerFailed, SwarmError
from swarm.heartbeat import INTERVAL_S, Heartbeat, send_queue_busy
from swarm.node.directory import PeerDirectory
from swarm.node.uplink import ACK_NONCE_BASE, Uplink
from swarm.protocol import Error, Hop, Moved, Opened, Ping, Pong, Resumed, Taken
from swarm.transport import FramedStream, dial_hop

log = logging.getLogger("swarm.node")

PING_INTERVAL = 2.0
CONNECT_TIMEOUT = 10.0
MAX_PINGS = 1000
HEARTBEAT_NONCE_BASE = 1 << 32  # heartbeat pings: above the round-trip ones, below acks
# how dialling fails: unreachable, unresolvable, not a valid host name, a failed TLS handshake
UNREACHABLE = (OSError, UnicodeError, ValueError, trio.TooSlowError, trio.BrokenResourceError)


class Upstream(Protocol):
    """A session as its next hop's answers reach it."""

    sid: str
    hop: int
    downstream: str | None  # the next hop's "host:port"

    async def from_downstream(self, msg: Opened | Error) -> None: ...


class Sessions(Protocol):
    """The node's sessions, as far as the next hops' answers need them."""

    def lookup(self, sid: str) -> Upstream | None: ...

    def __iter__(self) -> Iterator[Upstream]: ...


Follow = Callable[[Upstream, Moved], Awaitable[None]]


@dataclass(frozen=True)
class RoundTrip:
    """A pong to one of our round-trip pings."""

    nonce: int


@dataclass(frozen=True)
class Acknowledged:
    """A pong to an acknowledgement ping: the next hop has read the frame before it; `rx_bytes`
    of that frame arrived over `rx_s` there (0, 0: too small to tell)."""

    nonce: int
    rx_bytes: int
    rx_s: float


def classify(pong: Pong) -> RoundTrip | Acknowledged:
    if pong.nonce >= ACK_NONCE_BASE:
        return Acknowledged(pong.nonce, pong.rx_bytes, pong.rx_us / 1e6)
    return RoundTrip(pong.nonce)


class Downstream:
    def __init__(
        self,
        uplink: Uplink,
        sessions: Sessions,
        max_frame: int,
        directory: PeerDirectory,
        follow: Follow,
    ):
        """`follow`: what a session does when its next hop hands it over (`Moved`)."""
        self._uplink = uplink
        self._sessions = sessions
        self._follow = follow
        self._max_frame = max_frame
        self._directory = directory
        self._streams: dict[str, FramedStream] = {}
        self._keys: dict[str, str] = {}  # the TLS key each connection was checked against
        self._connecting: dict[str, trio.Lock] = {}
        self._pings: dict[tuple[str, int], tuple[float, bool]] = {}  # -> (sent, path clear)
        self._beats: dict[str, Heartbeat] = {}  # dest -> whether it still answers
        # handovers waiting for the replica's answer: (dest, sid) -> where it goes
        self._handovers: dict[tuple[str, str], trio.MemorySendChannel] = {}
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Own the connections' reader tasks and ping every connection, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._heartbeats)
            task_status.started()
            nonce = 0
            while True:
                await trio.sleep(PING_INTERVAL)
                for dest, ds in list(self._streams.items()):
                    nonce += 1
                    self._pings[(dest, nonce)] = (time.monotonic(), self._uplink.path_clear(dest))
                    self._uplink.send_control(ds, Ping(nonce=nonce))
                if len(self._pings) > MAX_PINGS:
                    self._pings.clear()

    async def _heartbeats(self) -> None:
        """Ping every next hop every INTERVAL_S; one that stays silent is lost, so the sessions
        through it fail upstream naming it, within about two seconds of it stopping."""
        nonce = HEARTBEAT_NONCE_BASE
        while True:
            await trio.sleep(INTERVAL_S)
            for dest, ds in list(self._streams.items()):
                now = time.monotonic()
                beat = self._beats.setdefault(dest, Heartbeat())
                beat.queued(now, send_queue_busy(ds.socket))
                if beat.hung(now):
                    silent = beat.silent_for(now)
                    await self.lost(ds, TimeoutError(f"no answer to pings for {silent:.1f} s"))
                    continue
                nonce += 1
                self._uplink.send_control(ds, Ping(nonce=nonce))
                beat.pinged(now)

    def stream(self, dest: str | None) -> FramedStream | None:
        return self._streams.get(dest) if dest is not None else None

    async def connect(self, hop: Hop) -> FramedStream:
        """The connection to `hop` (keyed by `hop.link`), opened if there is none. Raises the
        SwarmError the session's upstream gets: UnannouncedPeer for a hop no record announces,
        PeerFailed for one that cannot be reached, or what the hop's relay or TLS key said."""
        await self._directory.check(hop)
        dest = hop.link
        lock = self._connecting.setdefault(dest, trio.Lock())
        async with lock:
            ds = self._streams.get(dest)
            if ds is not None and not ds.closed and self._keys.get(dest) == hop.tls:
                return ds
            try:
                with trio.fail_after(CONNECT_TIMEOUT):
                    ds = await dial_hop(hop, self._max_frame)
            except UNREACHABLE as exc:
                why = str(exc) or type(exc).__name__
                raise PeerFailed(f"cannot reach the next hop at {dest}: {why}") from None
            self._streams[dest] = ds
            self._keys[dest] = hop.tls
            self._beats[dest] = Heartbeat()
            assert self._nursery is not None, "Downstream.run is not running"
            self._nursery.start_soon(self._read, dest, ds)
            return ds

    async def _read(self, dest: str, ds: FramedStream) -> None:
        """Backward traffic from the next hop: open acks, errors, pongs."""
        reason: Exception | None = None
        try:
            while True:
                msg = await ds.receive()
                if msg is None:
                    reason = ConnectionError("connection closed")
                    break
                if (beat := self._beats.get(dest)) is not None and self._streams.get(dest) is ds:
                    beat.heard()
                if isinstance(msg, Pong):
                    self._pong(dest, classify(msg))
                    continue
                sid = getattr(msg, "sid", "")
                if isinstance(msg, (Taken, Resumed, Error)) and (dest, sid) in self._handovers:
                    self._handovers.pop((dest, sid)).send_nowait(msg)
                    continue
                s = self._sessions.lookup(sid)
                if s is not None and s.downstream == dest and isinstance(msg, (Opened, Error)):
                    await s.from_downstream(msg)
                elif s is not None and s.downstream == dest and isinstance(msg, Moved):
                    # the next hop left, handing the session over: follow it (in a task of its
                    # own: this reader must go on reading the pongs the move waits for)
                    assert self._nursery is not None
                    self._nursery.start_soon(self._follow, s, msg)
        except (SwarmError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            reason = exc
        await self.lost(ds, reason)

    def expect_handover(self, dest: str, sid: str) -> trio.MemoryReceiveChannel:
        """Where the replica at `dest` answers the handover of `sid` or a resume of it (Taken,
        Resumed or Error; a PeerFailed Error if the connection is lost first)."""
        send, receive = trio.open_memory_channel(1)
        self._handovers[(dest, sid)] = send
        return receive

    def forget_handover(self, dest: str, sid: str) -> None:
        self._handovers.pop((dest, sid), None)

    def _pong(self, dest: str, pong: RoundTrip | Acknowledged) -> None:
        if isinstance(pong, Acknowledged):
            self._uplink.on_pong(dest, pong.nonce, pong.rx_bytes, pong.rx_s)
            return
        ping = self._pings.pop((dest, pong.nonce), None)
        if ping is not None:
            sent, clear = ping
            self._uplink.on_ping(dest, time.monotonic() - sent, queued=not clear)

    async def lost(self, stream: FramedStream, reason: Exception | None) -> None:
        """A write or read on `stream` failed: every session that goes through it fails."""
        if stream.closed:
            return
        stream.closed = True
        for dest, ds in list(self._streams.items()):
            if ds is not stream:
                continue
            del self._streams[dest]
            self._beats.pop(dest, None)
            self._uplink.forget_dest(dest)
            log.warning("lost downstream %s: %s", dest, reason)
            for key in [k for k in self._handovers if k[0] == dest]:
                err = PeerFailed(f"the replica at {dest} failed: {reason}")
                self._handovers.pop(key).send_nowait(Error.of(err, sid=key[1]))
            for s in self._sessions:
                if s.downstream == dest:
                    err = PeerFailed(f"hop {s.hop + 1} at {dest} failed: {reason}")
                    await s.from_downstream(Error.of(err, s.sid, s.hop + 1))
        await stream.aclose()
