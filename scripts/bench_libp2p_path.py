"""What carrying our frames over hivemind's libp2p streams would cost, against plain TCP (the
measurement behind the relayed path's design, issue 24; see docs/design.md).

Two p2pd daemons on loopback (hivemind 1.1.12's `P2P`): one registers a binary stream handler
that echoes small messages and swallows bulk data; the other opens a stream to it. The same
two measures over a plain loopback TCP connection: the best round trip of a 64-byte message
(--rounds of them), and MiB/s of --mib MiB sent one way and acknowledged.

    .venv/bin/python scripts/bench_libp2p_path.py [--rounds 200] [--mib 64]
"""

from __future__ import annotations

import argparse
import asyncio
import struct
import time
import warnings

SMALL = 64
CHUNK = 64 * 1024


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Messages are a 1-byte kind and 4-byte length: kind 0 is echoed, kind 1 acknowledged."""
    try:
        while True:
            head = await reader.readexactly(5)
            kind, size = head[0], struct.unpack(">I", head[1:])[0]
            if kind == 0:
                writer.write(head + await reader.readexactly(size))
            else:
                left = size
                while left:
                    left -= len(await reader.read(min(left, CHUNK)))
                writer.write(b"k")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def measure(reader, writer, rounds: int, mib: int) -> tuple[float, float]:
    best = float("inf")
    payload = b"x" * SMALL
    for _ in range(rounds):
        t = time.perf_counter()
        writer.write(b"\0" + struct.pack(">I", SMALL) + payload)
        await writer.drain()
        await reader.readexactly(5 + SMALL)
        best = min(best, time.perf_counter() - t)
    size = mib << 20
    t = time.perf_counter()
    writer.write(b"\1" + struct.pack(">I", size))
    block = b"y" * CHUNK
    for _ in range(size // CHUNK):
        writer.write(block)
        await writer.drain()
    await reader.readexactly(1)
    return best * 1000, mib / (time.perf_counter() - t)


async def main(rounds: int, mib: int) -> None:
    from hivemind.p2p import P2P

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    tcp = await measure(reader, writer, rounds, mib)
    writer.close()
    server.close()

    a = await P2P.create()
    b = await P2P.create(initial_peers=await a.get_visible_maddrs())
    await a.add_binary_stream_handler("echo", lambda _info, r, w: serve(r, w))
    _info, reader, writer = await b.call_binary_stream_handler(a.peer_id, "echo")
    p2p = await measure(reader, writer, rounds, mib)
    writer.close()
    await b.shutdown()
    await a.shutdown()

    print(f"{'path':26} {'best RTT ms':>12} {'MiB/s':>8}")
    print(f"{'TCP, loopback':26} {tcp[0]:12.3f} {tcp[1]:8.0f}")
    print(f"{'libp2p stream, loopback':26} {p2p[0]:12.3f} {p2p[1]:8.0f}")
    print(f"libp2p / TCP: RTT {p2p[0] / tcp[0]:.1f}x, throughput {p2p[1] / tcp[1]:.2f}x")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--mib", type=int, default=64)
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    asyncio.run(main(a.rounds, a.mib))
