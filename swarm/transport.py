"""Frames over a trio stream: the IO shell around the sans-IO codec in swarm.wire."""

from __future__ import annotations

import socket

import trio

from swarm.protocol import Message, parse_message, to_wire
from swarm.wire import DEFAULT_MAX_FRAME, FrameDecoder, encode_frame

RECEIVE_CHUNK = 256 * 1024


class FramedStream:
    def __init__(self, stream: trio.SocketStream, max_frame: int = DEFAULT_MAX_FRAME):
        self.stream = stream
        self.decoder = FrameDecoder(max_frame)
        self._send_lock = trio.Lock()
        self.closed = False

    @property
    def socket(self) -> socket.socket | None:
        return getattr(self.stream, "socket", None)

    def peer(self) -> str:
        try:
            host, port = self.stream.socket.getpeername()[:2]
            return f"{host}:{port}"
        except OSError:
            return "?"

    async def send(self, message: Message) -> None:
        await self.send_raw(encode_frame(to_wire(message)))

    async def send_raw(self, frame: bytes) -> None:
        async with self._send_lock:
            await self.stream.send_all(frame)

    async def receive(self) -> Message | None:
        """The next message, or None at end of stream. Raises ProtocolError on a bad frame."""
        while True:
            raw = self.decoder.next_message()
            if raw is not None:
                return parse_message(raw)
            data = await self.stream.receive_some(RECEIVE_CHUNK)
            if not data:
                return None
            self.decoder.feed(data)

    async def aclose(self) -> None:
        self.closed = True
        with trio.move_on_after(1) as scope:
            scope.shield = True
            await self.stream.aclose()


async def connect(host: str, port: int, max_frame: int = DEFAULT_MAX_FRAME) -> FramedStream:
    stream = await trio.open_tcp_stream(host, port)
    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return FramedStream(stream, max_frame)
