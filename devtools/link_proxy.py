"""A shaped TCP link on loopback: bandwidth, one-way delay and a bounded bottleneck buffer.

This kernel has no netem, so tests and benchmarks put this user-space relay between peers
(from a checkout: it is a developer tool, not part of the installed package). Every
connection through one relay shares the same two links (one per direction), the way every
connection of a node shares its access link. Per direction, bytes read from a sender wait in a
FIFO bottleneck buffer; when it is full the relay stops reading, so the sender's TCP backs off.
The buffer drains at `rate` in small pieces, and each piece reaches the receiver `delay` after
its last bit left the bottleneck.

`ShapedLink` (devtools/shaped_link.py) is the sans-IO model of one direction; `Relay` is the trio
shell around two of them.

    python -m devtools.link_proxy --listen 127.0.0.1:9000 --target 127.0.0.1:7000 \\
        --rate-mbps 5 --delay-ms 15 --buffer-kb 64
"""

from __future__ import annotations

import argparse
import logging
import math
import socket
import struct
import time
from collections import deque

import trio

from devtools.shaped_link import FrameScanner, LinkShape, ShapedLink

log = logging.getLogger(__name__)

READ_MAX = 64 * 1024
# A small receive buffer on the relay's sockets keeps the bytes a sender has pushed but the link
# has not taken to ~30 KiB (measured; autotuned it grows to hundreds of KiB), so backpressure
# reaches the sender. 8 KiB stalls on 40 ms delayed ACKs against loopback's 64 KiB MSS, and so
# does a small send buffer, which is why the send side keeps the kernel's autotuning.
RELAY_RECEIVE_BUFFER = 32 * 1024
# epoll rounds timeouts up to whole milliseconds, so trio wakes 0.4-1.4 ms late here, more on a
# busy machine. The driver tracks the median of its lateness, wakes that much early and delivers
# what is due within it, so half the pieces arrive a little early and half a little late.
INITIAL_TIMER_SLACK_S = 0.0009
MAX_TIMER_SLACK_S = 0.003
SLACK_STEP_S = 0.00002
CONNECT_TIMEOUT_S = 10.0
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux's number; Python does not name it
TIMESTAMP_SPACE = socket.CMSG_SPACE(16)  # one struct timespec
MAX_TIMESTAMP_AGE_S = 1.0  # beyond this, a wall-clock step is likelier than a stalled relay


# Wakes every task waiting on it; a wait started after `fire` waits for the next one.
class _Signal:
    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self, deadline: float = math.inf) -> bool:  # False: the deadline passed
        event = self._event
        with trio.move_on_at(deadline):
            await event.wait()
            return True
        return False


class _Direction:
    def __init__(self, shape: LinkShape):
        self.link = ShapedLink(shape)
        self.wake_driver = _Signal()
        self.room = _Signal()  # bottleneck room or a flow's window opened
        self.readers_waiting = 0
        self.slack = INITIAL_TIMER_SLACK_S
        # when measuring: (monotonic time, frame size, seconds its first byte waits to go)
        self.frame_waits: deque[tuple[float, int, float]] | None = None

    def queue_delay(self, now: float) -> float:
        """Seconds a byte sent at `now` waits in the bottleneck buffer."""
        return max(0.0, self.link.drained_at() - now)

    async def drive(self) -> None:
        while True:
            now = trio.current_time()
            for flow, data in self.link.advance(now + self.slack):
                flow.deliver(data)
            wake_at = self.link.next_arrival()
            if self.readers_waiting:
                refill = self.link.shape.refill_bytes()
                if self.link.room() >= refill:
                    self.room.fire()
                else:
                    wake_at = min(wake_at, self.link.when_room(refill))
            wake_at -= self.slack
            if not await self.wake_driver.wait(wake_at):
                late = trio.current_time() - wake_at
                step = SLACK_STEP_S if late > self.slack else -SLACK_STEP_S
                self.slack = min(max(self.slack + step, 0.0), MAX_TIMER_SLACK_S)


# Bytes of one connection in one direction, between the link and the receiving socket.
class _Flow:
    def __init__(self) -> None:
        self.outbox: list[bytes] = []
        self.ended = False
        self.dead = False  # the receiver is gone; drop what still arrives
        self.inside = 0  # bytes read from the sender and not yet written to the receiver
        self.ready = _Signal()
        self.scanner: FrameScanner | None = None  # when measuring frame waits

    def deliver(self, data: bytes | None) -> None:
        if self.dead:
            return
        if data is None:
            self.ended = True
        else:
            self.outbox.append(data)
        self.ready.fire()


_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class Relay:
    """A shaped TCP relay to one target; every connection through it shares the two links.

    `up` shapes bytes from connecting peers to the target, `down` bytes from the target back to
    them. When the target is a node announcing the relay as its public address, `down` is the
    node's upload and `up` its download.
    """

    def __init__(self, target_host: str, target_port: int, up: LinkShape, down: LinkShape):
        self.target = (target_host, target_port)
        self._up = _Direction(up)
        self._down = _Direction(down)
        self.port: int | None = None
        self.connections = 0  # open right now
        self.served = 0  # accepted since start

    @property
    def up(self) -> LinkShape:
        return self._up.link.shape

    @property
    def down(self) -> LinkShape:
        return self._down.link.shape

    def measure_frames(self) -> deque[tuple[float, int, float]]:
        """From now on, note each frame from peers to the target as its first byte comes in:
        (monotonic time, size with prefix, seconds it waits in the up bottleneck). The caller
        empties the returned deque."""
        self._up.frame_waits = deque()
        return self._up.frame_waits

    def queue_delays(self) -> tuple[float, float]:
        """Seconds a byte sent now would wait in the up and the down bottleneck buffer."""
        now = trio.current_time()
        return self._up.queue_delay(now), self._down.queue_delay(now)

    def set_shape(self, up: LinkShape | None = None, down: LinkShape | None = None) -> None:
        """Change either direction's shape from now on. Call from the relay's trio run."""
        now = trio.current_time()
        for direction, shape in ((self._up, up), (self._down, down)):
            if shape is not None:
                direction.link.set_shape(now, shape)
                direction.wake_driver.fire()
                direction.room.fire()

    async def serve(
        self,
        listen_host: str,
        listen_port: int,
        *,
        task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept connections until cancelled; `task_status.started` gets the listening port."""
        listeners = await trio.open_tcp_listeners(listen_port, host=listen_host)
        listeners = listeners[:1]  # port 0 on a name with several addresses gives several ports
        sock = listeners[0].socket
        _tune(sock)  # accepted sockets inherit it all, and the window scale with the buffer
        self.port = sock.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._up.drive)
            nursery.start_soon(self._down.drive)
            await nursery.start(trio.serve_listeners, self._serve_one, listeners)
            task_status.started(self.port)

    async def _serve_one(self, client: trio.SocketStream) -> None:
        self.connections += 1
        self.served += 1
        try:
            await self._relay(client)
        except Exception:
            log.exception("relay: connection failed; the relay keeps serving")
        finally:
            self.connections -= 1
            await client.aclose()

    async def _relay(self, client: trio.SocketStream) -> None:
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                server = await _connect(*self.target)
        except (OSError, trio.TooSlowError) as e:
            log.warning("relay: cannot reach target %s:%d: %r", *self.target, e)
            return
        up, down = _Flow(), _Flow()
        writers_left = 2
        try:
            async with trio.open_nursery() as nursery:

                async def write(dst: trio.SocketStream, flow: _Flow, d: _Direction) -> None:
                    nonlocal writers_left
                    try:
                        await _pump_out(dst, flow, d)
                    except _GONE:
                        flow.dead = True
                        d.room.fire()
                        # closing it ends the reader on the same socket, which sends our end
                        # (after whatever is still in flight) to the other side
                        await dst.aclose()
                    writers_left -= 1
                    if writers_left == 0:
                        nursery.cancel_scope.cancel()

                nursery.start_soon(_pump_in, client, up, self._up)
                nursery.start_soon(write, server, up, self._up)
                nursery.start_soon(_pump_in, server, down, self._down)
                nursery.start_soon(write, client, down, self._down)
        finally:
            await server.aclose()


async def _pump_in(src: trio.SocketStream, flow: _Flow, d: _Direction) -> None:
    link = d.link
    try:
        while not flow.dead:
            shape = link.shape
            want = min(link.room(), READ_MAX, shape.window_bytes() - flow.inside)
            if want < shape.refill_bytes():
                d.readers_waiting += 1
                try:
                    await d.room.wait()
                finally:
                    d.readers_waiting -= 1
                continue
            try:
                data, arrived = await _receive(src.socket, want)
            except _GONE:
                return
            if not data:
                return
            flow.inside += len(data)
            if d.frame_waits is not None:
                _note_frames(d, flow, data, arrived)
            idle = link.queued_bytes == 0
            link.send(arrived, flow, data)
            if idle:  # behind other pieces, it changes none of the driver's deadlines
                d.wake_driver.fire()
    finally:
        link.close(trio.current_time(), flow)
        d.wake_driver.fire()


def _note_frames(d: _Direction, flow: _Flow, data: bytes, arrived: float) -> None:
    flow.scanner = flow.scanner or FrameScanner()
    ahead = d.queue_delay(arrived)
    for offset, size in flow.scanner.feed(data):
        wait = ahead + d.link.shape.serialization_s(offset)
        d.frame_waits.append((time.monotonic(), size, wait))


async def _pump_out(dst: trio.SocketStream, flow: _Flow, d: _Direction) -> None:
    while True:
        if flow.outbox:
            data = b"".join(flow.outbox)
            flow.outbox.clear()
            await dst.send_all(data)
            flow.inside -= len(data)
            d.room.fire()
        elif flow.ended:
            try:
                await dst.send_eof()
            except _GONE:
                pass
            return
        else:
            await flow.ready.wait()


def _tune(sock: trio.socket.SocketType) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RELAY_RECEIVE_BUFFER)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, True)
    except OSError:
        pass  # not Linux: bytes count as arriving when the relay reads them


# Bytes from `sock`, and when the kernel received them, on trio's clock. A piece enters the
# bottleneck when it reached the relay, not when the relay got round to reading it: that takes
# out the relay's wakeup latency and, when the relay stalls on a busy machine, keeps the bytes
# already waiting in its kernel buffer from finding an idle link.
async def _receive(sock: trio.socket.SocketType, nbytes: int) -> tuple[bytes, float]:
    data, ancillary, _, _ = await sock.recvmsg(nbytes, TIMESTAMP_SPACE)
    now = trio.current_time()
    for level, kind, value in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(value) >= 16:
            seconds, nanoseconds = struct.unpack("qq", value[:16])
            age = time.time() - (seconds + nanoseconds * 1e-9)
            return data, now - min(max(age, 0.0), MAX_TIMESTAMP_AGE_S)
    return data, now


async def _connect(host: str, port: int) -> trio.SocketStream:
    family, type_, proto, _, addr = (
        await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    )[0]
    sock = trio.socket.socket(family, type_, proto)
    try:
        _tune(sock)  # before connect, so the window scale matches the buffer
        await sock.connect(addr)
    except BaseException:
        sock.close()
        raise
    return trio.SocketStream(sock)


async def run_relay(
    listen_host: str,
    listen_port: int,
    target_host: str,
    target_port: int,
    up: LinkShape,
    down: LinkShape,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve a shaped relay until cancelled; `task_status.started` gets the listening port.

    Use `Relay` directly to change the shape while it runs.
    """
    relay = Relay(target_host, target_port, up, down)
    await relay.serve(listen_host, listen_port, task_status=task_status)


async def _log_queues(relay: Relay, path: str, every_s: float = 0.01) -> None:
    frames = relay.measure_frames()
    with open(path, "a", buffering=1) as out:  # lines: a killed relay loses none
        while True:
            up, down = relay.queue_delays()
            out.write(f"{time.monotonic():.4f} {up:.4f} {down:.4f}\n")
            while frames:
                t, size, wait = frames.popleft()
                out.write(f"f {t:.4f} {size} {wait:.4f}\n")
            await trio.sleep(every_s)


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m devtools.link_proxy",
        description="A shaped TCP relay: bandwidth, one-way delay and a bottleneck buffer, "
        "the same both ways unless --down-* (target -> peers) says otherwise.",
    )
    p.add_argument("--listen", type=_host_port, required=True, help="HOST:PORT (port 0: any)")
    p.add_argument("--target", type=_host_port, required=True, help="HOST:PORT to relay to")
    p.add_argument("--rate-mbps", type=float, default=0.0, help="bandwidth; 0 = unlimited")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay")
    p.add_argument("--buffer-kb", type=float, default=64.0, help="bottleneck buffer in KiB")
    for name in ("rate-mbps", "delay-ms", "buffer-kb"):
        p.add_argument(
            f"--down-{name}",
            type=float,
            default=None,
            help=f"the same for target -> peers (default: --{name})",
        )
    p.add_argument(
        "--queue-log",
        default=None,
        help="append 'MONOTONIC_S UP_QUEUE_S DOWN_QUEUE_S' lines here every 10 ms (how long a"
        " byte sent then waits in each bottleneck buffer) and 'f MONOTONIC_S SIZE WAIT_S' for"
        " each frame peers send (swarm.wire framing): for benchmarks",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def _shape(rate_mbps: float, delay_ms: float, buffer_kb: float) -> LinkShape:
    return LinkShape(rate_mbps * 1e6, delay_ms / 1e3, int(buffer_kb * 1024))


def main(argv: list[str] | None = None) -> int:
    """The command line: relay --listen to --target, shaped the same both ways unless --down-*."""
    a = _parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING)
    up = _shape(a.rate_mbps, a.delay_ms, a.buffer_kb)
    down = _shape(
        a.rate_mbps if a.down_rate_mbps is None else a.down_rate_mbps,
        a.delay_ms if a.down_delay_ms is None else a.down_delay_ms,
        a.buffer_kb if a.down_buffer_kb is None else a.down_buffer_kb,
    )

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            relay = Relay(a.target[0], a.target[1], up, down)
            port = await nursery.start(relay.serve, a.listen[0], a.listen[1])
            print(
                f"relay {a.listen[0]}:{port} -> {a.target[0]}:{a.target[1]}  up {up}  down {down}",
                flush=True,
            )
            if a.queue_log:
                nursery.start_soon(_log_queues, relay, a.queue_log)

    try:
        trio.run(run)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
