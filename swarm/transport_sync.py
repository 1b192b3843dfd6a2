"""Frames over a blocking socket, for a thread that waits on one peer at every step: a borrowing
session's compute thread and its lender (swarm.node.borrow_link). The same frames, TLS with the
peer's key checked, and relay splice as swarm.transport, without an event loop between the
thread and the socket: each query is one write from that thread, its answer one wake-up of it.

One thread at a time uses a connection (its owner's lock says which).
"""

from __future__ import annotations

import socket
import ssl
import time

from swarm.errors import PeerFailed, ProtocolError
from swarm.protocol import Error, Hop, Message, Relay, parse_message, to_wire
from swarm.tls import CLIENT_CONTEXT, check_key, refusal
from swarm.wire import FrameDecoder, encode_frame

RECEIVE_CHUNK = 256 * 1024
HEAD = 4096  # bytes kept of what came before a TLS handshake failed (a node's plaintext refusal)


class _Tls:
    """The client side of TLS over a blocking socket (OpenSSL on memory buffers, as trio's
    SSLStream runs it): what came before a failed handshake stays readable."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = CLIENT_CONTEXT.wrap_bio(self._in, self._out, server_side=False)
        self.head = bytearray()

    def handshake(self) -> None:
        while True:
            try:
                self.tls.do_handshake()
                self._flush()
                return
            except ssl.SSLWantReadError:
                self._flush()
                self._fill(record=True)

    def sendall(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[self.tls.write(view) :]
            self._flush()

    def recv(self, n: int) -> bytes:
        """Up to `n` bytes, b"" at the end of the stream."""
        while True:
            try:
                return self.tls.read(n)
            except ssl.SSLWantReadError:
                self._flush()
                if not self._fill():
                    return b""
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""

    def _flush(self) -> None:
        if self._out.pending:
            self.sock.sendall(self._out.read())

    def _fill(self, record: bool = False) -> bool:
        data = self.sock.recv(RECEIVE_CHUNK)
        if record and len(self.head) < HEAD:
            self.head += data[: HEAD - len(self.head)]
        if not data:
            self._in.write_eof()
            return False
        self._in.write(data)
        return True


class SyncConnection:
    """A framed connection in blocking mode: `send` a message, `receive` the next one."""

    def __init__(self, sock: socket.socket, max_frame: int, tls: _Tls | None = None):
        self.sock, self._tls = sock, tls
        self.decoder = FrameDecoder(max_frame)

    def send(self, message: Message, timeout: float) -> None:
        self.sock.settimeout(timeout)
        (self._tls or self.sock).sendall(encode_frame(to_wire(message)))

    def receive(self, timeout: float) -> Message | None:
        """The next message, None at the end of the stream; TimeoutError past `timeout`
        seconds, ProtocolError for a bad frame."""
        deadline = time.monotonic() + timeout
        while (raw := self.decoder.next_message()) is None:
            self.sock.settimeout(max(1e-3, deadline - time.monotonic()))
            if not self._read():
                return None
        return parse_message(raw)

    def ready(self) -> list[Message] | None:
        """The messages in already, without waiting; None if the stream has ended."""
        self.sock.settimeout(0.0)
        try:
            while self._read():
                pass
            ended = True
        except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            ended = False
        out = []
        while (raw := self.decoder.next_message()) is not None:
            out.append(parse_message(raw))
        return None if ended and not out else out

    def close(self) -> None:
        """Ends it, waking a thread that waits on it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected any more
        self.sock.close()

    def _read(self) -> bool:
        data = (self._tls or self.sock).recv(RECEIVE_CHUNK)
        if data:
            self.decoder.feed(data)
        return bool(data)


def dial_sync(hop: Hop, max_frame: int, timeout: float) -> SyncConnection:
    """A blocking connection to the node `hop` names, as swarm.transport.dial_hop makes it (TLS
    checked against its key, through its relay if it has one) within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    sock = socket.create_connection((hop.host, hop.port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if hop.relay:
            _splice(sock, hop, max_frame, deadline)
        if not hop.tls:
            return SyncConnection(sock, max_frame)
        sock.settimeout(max(1e-3, deadline - time.monotonic()))
        tls = _Tls(sock)
        try:
            tls.handshake()
        except (ssl.SSLError, ConnectionError) as exc:
            refused = refusal(bytes(tls.head))
            raise refused or PeerFailed(f"TLS handshake with {hop.addr} failed: {exc}") from None
        check_key(tls.tls.getpeercert(binary_form=True), hop.tls, hop.link)
        return SyncConnection(sock, max_frame, tls)
    except BaseException:
        sock.close()
        raise


def _splice(sock: socket.socket, hop: Hop, max_frame: int, deadline: float) -> None:
    """Ask the relay at the socket's end for `hop`'s node (swarm.transport.splice)."""
    conn = SyncConnection(sock, max_frame)
    conn.send(Relay(op="splice", peer=hop.peer), max(1e-3, deadline - time.monotonic()))
    reply = conn.receive(max(1e-3, deadline - time.monotonic()))
    if isinstance(reply, Error):
        raise PeerFailed(f"relay {hop.addr}: {reply.message}", peer=hop.peer)
    if not isinstance(reply, Relay) or reply.op != "spliced" or conn.decoder.buffered:
        raise ProtocolError(f"{hop.addr} answered splice with {reply!r:.100}")
