"""Frames over a trio stream (the IO shell around the sans-IO codec in swarm.wire), and dialling
a node as its record says: directly, or spliced through the node that relays for it."""

from __future__ import annotations

import math
import random
import socket
import time
from dataclasses import dataclass

import trio

from swarm.address import join_host_port
from swarm.errors import PeerFailed, ProtocolError, SwarmError
from swarm.protocol import Error, Hop, Message, Ping, Pong, Relay, parse_message, to_wire
from swarm.tls import dial
from swarm.wire import DEFAULT_MAX_FRAME, FrameDecoder, encode_frame

RECEIVE_CHUNK = 256 * 1024
RX_MIN_BYTES = 4096  # a frame's arrival spread says something about the link from this size
# a pong is ~30 bytes; anything bigger than this is not a node answering a ping
MAX_PONG_FRAME = 4096
TLS_RECORD = 4096  # plaintext bytes per TLS record sent (TLS allows up to 16 KiB)
SEND_GRACE_S = 60.0  # longest a cancelled frame send may still take (16 MiB at ~2 Mbps)
SPLICE_TIMEOUT_S = 15.0  # a relay asks its node to connect back within 10 s (swarm.relay)


@dataclass(frozen=True)
class Arrival:
    """How one frame came in: `nbytes` arrived over `seconds` after the read that began it."""

    nbytes: int
    seconds: float


class FramedStream:
    def __init__(self, stream: trio.abc.Stream, max_frame: int = DEFAULT_MAX_FRAME):
        self.stream = stream
        self.decoder = FrameDecoder(max_frame)
        self._send_lock = trio.Lock()
        self.closed = False
        # receive timing, for the sender's bandwidth estimate (see `pong`)
        self._frame_began = 0.0  # when the read holding the current frame's first bytes returned
        self._frame_head = 0  # bytes of the buffer at that moment
        self._last_read = 0.0
        self._arrival: Arrival | None = None

    @property
    def socket(self) -> socket.socket | None:
        """The TCP socket under the stream (under TLS too: the link scheduler reads TCP_INFO)."""
        stream = self.stream
        while isinstance(stream, trio.SSLStream):
            stream = stream.transport_stream
        return getattr(stream, "socket", None)

    @property
    def encrypted(self) -> bool:
        return isinstance(self.stream, trio.SSLStream)

    def peer(self) -> str:
        try:
            host, port = self.socket.getpeername()[:2]
            return f"{host}:{port}"
        except (OSError, AttributeError):
            return "?"

    async def send(self, message: Message, at_once: bool = False) -> None:
        await self.send_raw(encode_frame(to_wire(message)), at_once)

    async def send_raw(self, frame: bytes, at_once: bool = False) -> None:
        """Send one encoded frame whole. A cancelled send would leave part of a frame on the
        wire (and breaks a TLS stream even before its first byte), so a cancel waits for the
        frame to go; only a deadline stops it (at most SEND_GRACE_S on), closing the stream.
        `at_once`: in one write, TLS's largest records, for a small frame that someone waits
        for at every step (a lender's query and answer): each write wakes the receiver, and
        any relay on the way, once more, while its arrival's spread is not needed."""
        async with self._send_lock:
            # (a task already cancelled sees -inf here: it gets the grace too)
            grace = trio.current_time() + SEND_GRACE_S
            deadline = trio.current_effective_deadline()
            deadline = grace if deadline == -math.inf else min(deadline, grace)
            with trio.CancelScope(shield=True, deadline=deadline) as scope:
                if self.encrypted and not at_once:
                    # small TLS records: a receiver decrypts nothing of a record before all of
                    # it is in, and times a frame's arrival by its reads (see `pong`)
                    view = memoryview(frame)
                    for i in range(0, len(view), TLS_RECORD):
                        await self.stream.send_all(view[i : i + TLS_RECORD])
                else:
                    await self.stream.send_all(frame)
            if scope.cancelled_caught:
                self.closed = True
                await trio.aclose_forcefully(self.stream)
                raise trio.BrokenResourceError("a frame could not be sent in time; closed")

    async def receive(self) -> Message | None:
        """The next message, or None at end of stream. Raises ProtocolError on a bad frame."""
        while True:
            raw = self.decoder.next_message()
            if raw is not None:
                self._frame_arrived(self.decoder.last_frame_bytes)
                return parse_message(raw)
            data = await self.stream.receive_some(RECEIVE_CHUNK)
            if not data:
                return None
            self._last_read = time.monotonic()
            if not self.decoder.buffered:  # a new frame begins with this read
                self._frame_began, self._frame_head = self._last_read, len(data)
            self.decoder.feed(data)

    def _frame_arrived(self, size: int) -> None:
        # the bytes after the frame's first read came in over the time to its last read: a
        # frame the sender wrote at once arrives at the rate of the narrowest link on the way,
        # whether or not the sender was busy before it (what acknowledgements cannot tell)
        spread = size - self._frame_head
        seconds = self._last_read - self._frame_began
        if spread >= RX_MIN_BYTES and seconds > 0:
            self._arrival = Arrival(spread, seconds)
        # what is left in the buffer starts the next frame and came with the last read
        self._frame_began, self._frame_head = self._last_read, self.decoder.buffered

    def pong(self, nonce: int) -> Pong:
        """The answer to a ping: it tells how the latest large frame before it arrived (once)."""
        arrival, self._arrival = self._arrival, None
        if arrival is None:
            return Pong(nonce=nonce)
        rx_us = max(1, min(2**31, round(arrival.seconds * 1e6)))
        return Pong(nonce=nonce, rx_bytes=min(arrival.nbytes, 2**31), rx_us=rx_us)

    async def aclose(self) -> None:
        self.closed = True
        with trio.move_on_after(1) as scope:
            scope.shield = True
            try:
                await self.stream.aclose()
            except (trio.BrokenResourceError, OSError):
                pass  # the peer went first: a TLS close_notify had nowhere to go
        if scope.cancelled_caught:
            await trio.aclose_forcefully(self.stream)


async def connect(
    host: str, port: int, max_frame: int = DEFAULT_MAX_FRAME, *, tls: str | None
) -> FramedStream:
    """A framed connection to a node. `tls`: the key id its DHT record announces, checked in a
    TLS handshake (WrongPeer if the node cannot prove it); None only for a plaintext node."""
    stream = await trio.open_tcp_stream(host, port)
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is None:
        return FramedStream(stream, max_frame)
    try:
        secure = await dial(stream, tls, join_host_port(host, port))
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return FramedStream(secure, max_frame)


async def dial_hop(hop: Hop, max_frame: int = DEFAULT_MAX_FRAME) -> FramedStream:
    """A framed connection to the node `hop` names: TLS checked against its key (plaintext
    only for a hop announced without one), through its relay if it has one."""
    if hop.relay:
        return await splice(hop, max_frame)
    return await connect(hop.host, hop.port, max_frame, tls=hop.tls or None)


async def splice(hop: Hop, max_frame: int) -> FramedStream:
    """A TLS connection to the node `hop` names, through the relay at hop.host:hop.port."""
    request = Relay(op="splice", peer=hop.peer)
    conn, reply = await ask_relay(
        hop.host, hop.port, request, "spliced", SPLICE_TIMEOUT_S, max_frame
    )
    if isinstance(reply, Error):
        raise PeerFailed(f"relay {hop.addr}: {reply.message}", peer=hop.peer)
    try:
        secure = await dial(conn.stream, hop.tls, hop.link)
    except BaseException:
        await trio.aclose_forcefully(conn.stream)
        raise
    return FramedStream(secure, max_frame)


async def ask_relay(
    host: str, port: int, request: Relay, answer: str, timeout: float, max_frame: int
) -> tuple[FramedStream, Relay | Error]:
    """One plaintext request to a node that relays: the open connection and its `answer`, or
    the Error it sent (the connection then closed); ProtocolError for anything else."""
    with trio.fail_after(timeout):
        conn = await connect(host, port, max_frame, tls=None)
        try:
            await conn.send(request)
            reply = await conn.receive()
            if isinstance(reply, Error):
                await conn.aclose()
                return conn, reply
            if not isinstance(reply, Relay) or reply.op != answer or conn.decoder.buffered:
                where = f"{host}:{port}"
                raise ProtocolError(f"{where} answered {request.op} with {reply!r:.100}")
        except BaseException:
            await trio.aclose_forcefully(conn.stream)
            raise
    return conn, reply


@dataclass(frozen=True)
class Reach:
    """Outcome of pinging one node: the best round trip in seconds, or why there was none."""

    rtt_s: float | None = None
    error: str | None = None

    @property
    def reachable(self) -> bool:
        return self.error is None


async def ping(hop: Hop, *, timeout: float, rounds: int = 1) -> Reach:
    """Connect to a node as its record says (`NodeRecord.hop`) and time `rounds` pings;
    never raises.

    The best of several rounds on one connection is the figure: the first round trip
    can include the node waking a task up, later ones are the network's.
    """
    best: float | None = None
    conn: FramedStream | None = None
    try:
        with trio.fail_after(timeout):
            conn = await dial_hop(hop, MAX_PONG_FRAME)
            for _ in range(rounds):
                nonce = random.getrandbits(62)
                sent = time.perf_counter()
                await conn.send(Ping(nonce=nonce))
                reply = await conn.receive()
                rtt = time.perf_counter() - sent
                if reply is None:
                    return Reach(error="connection closed before a pong")
                if not isinstance(reply, Pong) or reply.nonce != nonce:
                    return Reach(error=f"answered a ping with {reply.t!r}")
                best = rtt if best is None else min(best, rtt)
    except trio.TooSlowError:
        return Reach(error=f"no pong within {timeout:g} s")
    except (OSError, trio.BrokenResourceError) as exc:
        return Reach(error=_os_reason(exc))
    except ProtocolError as exc:
        return Reach(error=f"bad reply: {exc}")
    except SwarmError as exc:  # the wrong peer, or a relay that does not know the node
        return Reach(error=str(exc))
    finally:
        if conn is not None:
            await conn.aclose()
    return Reach(rtt_s=best)


def _os_reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__
