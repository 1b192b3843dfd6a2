"""Measure the shaped relay: configured vs measured throughput and round-trip time.

For each setting a relay runs as its own process (`python -m devtools.link_proxy`, as benchmarks
run it) in front of a loopback server that sinks, sources or echoes. Throughput is the median of
a few bulk transfers timed first byte to last at the receiver; RTT is the median of small
ping-pongs on an idle link, and again behind a bulk upload on another connection (the
bottleneck buffer then adds about buffer/rate).
"""

from __future__ import annotations

import argparse
import statistics
import struct
import subprocess
import sys
from pathlib import Path

import trio
from bench.proc import cpu_seconds

from devtools.link_proxy import LinkShape, Relay

ROOT = Path(__file__).resolve().parents[1]

CHUNK = 64 * 1024


class Target:
    """First byte of a connection picks the mode: S sinks, D sends N bytes back, E echoes."""

    def __init__(self) -> None:
        self.port = 0
        self.sunk: list[list[tuple[float, int]]] = []

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        await trio.serve_listeners(self._handle, listeners, task_status=task_status)

    async def _handle(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                mode = await stream.receive_some(1)
                if mode == b"S":
                    log: list[tuple[float, int]] = []
                    self.sunk.append(log)
                    while data := await stream.receive_some(CHUNK):
                        log.append((trio.current_time(), len(data)))
                elif mode == b"D":
                    header = await receive_exactly(stream, 8)
                    (nbytes,) = struct.unpack("!Q", header)
                    for _ in range(nbytes // CHUNK):
                        await stream.send_all(b"d" * CHUNK)
                elif mode == b"E":
                    while data := await stream.receive_some(CHUNK):
                        await stream.send_all(data)
            except trio.BrokenResourceError:
                pass


async def receive_exactly(stream: trio.SocketStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = await stream.receive_some(n - len(buf))
        if not data:
            raise EOFError
        buf += data
    return bytes(buf)


def rate_of(arrivals: list[tuple[float, int]]) -> float:
    # the first receive's bytes crossed the link before the clock started
    return sum(n for _, n in arrivals[1:]) * 8 / (arrivals[-1][0] - arrivals[0][0])


async def upload_rate(port: int, target: Target, nbytes: int) -> float:
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(b"S")
        for _ in range(nbytes // CHUNK):
            await stream.send_all(b"u" * CHUNK)
    log = None
    with trio.fail_after(60):
        while log is None or sum(n for _, n in log) < nbytes // CHUNK * CHUNK:
            await trio.sleep(0.01)
            log = target.sunk[-1] if target.sunk else None
    target.sunk.clear()
    return rate_of(log)


async def download_rate(port: int, nbytes: int) -> float:
    arrivals = []
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(b"D" + struct.pack("!Q", nbytes))
        while data := await stream.receive_some(CHUNK):
            arrivals.append((trio.current_time(), len(data)))
    return rate_of(arrivals)


async def round_trips(port: int, pings: int) -> list[float]:
    rtts = []
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(b"E")
        for _ in range(pings):
            start = trio.current_time()
            await stream.send_all(b"p" * 64)
            await receive_exactly(stream, 64)
            rtts.append(trio.current_time() - start)
            await trio.sleep(0.02)
    return rtts


async def loaded_round_trips(port: int, pings: int) -> list[float]:
    async with trio.open_nursery() as nursery:

        async def saturate() -> None:
            async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                await stream.send_all(b"S")
                while True:
                    await stream.send_all(b"u" * CHUNK)

        nursery.start_soon(saturate)
        await trio.sleep(0.5)  # let the bottleneck buffer fill
        rtts = await round_trips(port, pings)
        nursery.cancel_scope.cancel()
    return rtts


async def start_relay(nursery, target: Target, shape: LinkShape, in_process: bool):
    """The relay's port and, when it runs as a process, its pid."""
    if in_process:
        relay = Relay("127.0.0.1", target.port, shape, shape)
        return await nursery.start(relay.serve, "127.0.0.1", 0), None
    command = [sys.executable, "-m", "devtools.link_proxy", "--listen", "127.0.0.1:0"]
    command += ["--target", f"127.0.0.1:{target.port}"]
    command += ["--rate-mbps", str((shape.rate_bps or 0) / 1e6)]
    command += ["--delay-ms", str(shape.delay_s * 1e3)]
    command += ["--buffer-kb", str(shape.buffer_bytes / 1024)]

    async def run(task_status=trio.TASK_STATUS_IGNORED):
        await trio.run_process(command, stdout=subprocess.PIPE, cwd=ROOT, task_status=task_status)

    process = await nursery.start(run)
    line = b""
    while not line.endswith(b"\n"):
        line += await process.stdout.receive_some(1)
    return int(line.split()[1].rsplit(b":", 1)[1]), process.pid


async def baseline_rtt(a: argparse.Namespace) -> float:
    async with trio.open_nursery() as nursery:
        target = Target()
        await nursery.start(target.serve)
        port, _ = await start_relay(nursery, target, LinkShape(None, 0.0), a.in_process)
        rtt = statistics.median(await round_trips(port, a.pings))
        nursery.cancel_scope.cancel()
    return rtt


async def calibrate(a: argparse.Namespace) -> None:
    where = "in this process" if a.in_process else "as its own process"
    base = await baseline_rtt(a)
    print(f"relay {where}; RTT through an unshaped relay (loopback, hops): {base * 1e3:.2f} ms")
    print(
        f"{'rate':>6} {'delay':>6} {'buffer':>7} | {'up Mbps':>15} {'down Mbps':>15} | "
        f"{'idle RTT ms':>16} {'p10-p90':>11} | {'loaded RTT':>10} {'expect':>6} | {'relay CPU':>9}"
    )
    for rate_mbps in a.rates:
        shape = LinkShape(rate_mbps * 1e6, a.delay_ms / 1e3, int(a.buffer_kb * 1024))
        async with trio.open_nursery() as nursery:
            target = Target()
            await nursery.start(target.serve)
            port, pid = await start_relay(nursery, target, shape, a.in_process)
            nbytes = int(rate_mbps * 1e6 / 8 * a.seconds)
            cpu0, t0 = (cpu_seconds(pid) if pid else 0.0), trio.current_time()
            ups = [await upload_rate(port, target, nbytes) for _ in range(a.runs)]
            cpu = (cpu_seconds(pid) - cpu0) / (trio.current_time() - t0) if pid else None
            downs = [await download_rate(port, nbytes) for _ in range(a.runs)]
            idle = sorted(await round_trips(port, a.pings))
            loaded = statistics.median(await loaded_round_trips(port, a.pings // 2))
            nursery.cancel_scope.cancel()
        up, down, rtt = statistics.median(ups), statistics.median(downs), statistics.median(idle)
        want_rtt = 2 * shape.delay_s
        # a ping behind a full buffer waits for it to drain: buffer * 8 / rate
        want_loaded = want_rtt + shape.serialization_s(shape.buffer_bytes)
        p10, p90 = idle[len(idle) // 10], idle[len(idle) * 9 // 10]
        print(
            f"{rate_mbps:>6g} {a.delay_ms:>4g}ms {a.buffer_kb:>5g}KB | "
            f"{up / 1e6:>7.2f} ({up / shape.rate_bps - 1:+6.1%}) "
            f"{down / 1e6:>7.2f} ({down / shape.rate_bps - 1:+6.1%}) | "
            f"{rtt * 1e3:>7.2f} ({rtt / want_rtt - 1:+6.1%}) {p10 * 1e3:>5.1f}-{p90 * 1e3:<5.1f} | "
            f"{loaded * 1e3:>10.1f} {want_loaded * 1e3:>6.1f} | "
            + (f"{cpu:>8.0%}" if cpu is not None else f"{'-':>9}"),
            flush=True,
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rates", type=float, nargs="+", default=[5, 20, 100], help="Mbps")
    p.add_argument("--delay-ms", type=float, default=15.0)
    p.add_argument("--buffer-kb", type=float, default=64.0)
    p.add_argument("--seconds", type=float, default=2.0, help="per bulk transfer")
    p.add_argument("--runs", type=int, default=3, help="bulk transfers per direction")
    p.add_argument("--pings", type=int, default=40)
    p.add_argument("--in-process", action="store_true", help="relay in this process")
    trio.run(calibrate, p.parse_args())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
