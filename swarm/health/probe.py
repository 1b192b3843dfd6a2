"""The health server's own view of a node's data plane: a ping/pong round trip over TCP."""

from __future__ import annotations

import random
import socket
import time
from dataclasses import dataclass

import trio

from swarm.errors import ProtocolError
from swarm.protocol import Ping, to_wire
from swarm.wire import FrameDecoder, encode_frame

# a pong is ~30 bytes; anything bigger than this is not a node answering a ping
MAX_REPLY_FRAME = 4096


@dataclass(frozen=True)
class Reach:
    """Outcome of pinging one address: the best round trip, or why there was none."""

    rtt_ms: float | None = None
    error: str | None = None

    @property
    def reachable(self) -> bool:
        return self.error is None


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


async def ping(addr: str, timeout: float = 3.0, rounds: int = 3) -> Reach:
    """Connect to a node's data-plane address and time `rounds` pings; never raises.

    The best of several rounds on one connection is the figure: the first round trip
    can include the node waking a task up, later ones are the network's.
    """
    try:
        host, port = split_addr(addr)
    except ValueError:
        return Reach(error=f"bad address {addr!r}")
    best: float | None = None
    stream: trio.SocketStream | None = None
    try:
        with trio.fail_after(timeout):
            stream = await trio.open_tcp_stream(host, port)
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            decoder = FrameDecoder(MAX_REPLY_FRAME)
            for _ in range(rounds):
                nonce = random.getrandbits(62)
                sent = time.perf_counter()
                await stream.send_all(encode_frame(to_wire(Ping(nonce=nonce))))
                reply = await _next_message(stream, decoder)
                rtt = time.perf_counter() - sent
                if reply.get("t") != "pong" or reply.get("nonce") != nonce:
                    return Reach(error=f"answered a ping with {str(reply.get('t'))[:32]!r}")
                best = rtt if best is None else min(best, rtt)
    except trio.TooSlowError:
        return Reach(error=f"no pong within {timeout:g} s")
    except (OSError, trio.BrokenResourceError) as exc:
        return Reach(error=_os_reason(exc))
    except ProtocolError as exc:
        return Reach(error=f"bad reply: {exc}")
    finally:
        if stream is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await stream.aclose()
    return Reach(rtt_ms=None if best is None else best * 1000.0)


async def _next_message(stream: trio.SocketStream, decoder: FrameDecoder) -> dict:
    while True:
        message = decoder.next_message()
        if message is not None:
            return message
        data = await stream.receive_some(MAX_REPLY_FRAME)
        if not data:
            raise ProtocolError("connection closed before a pong")
        decoder.feed(data)


def _os_reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__
