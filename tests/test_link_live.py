"""The node's uplink measures a live shaped link, and follows it when its rate changes.

One trio process: a receiver answering pings as a node does (FramedStream.pong), a shaped relay in
front of it, and the real Uplink sending prefill activations through the relay the way a node
does, in bursts with idle gaps between them (so acknowledgements alone would read the link low).
The uplink's bandwidth estimate must come within 10% of the relay's rate, and follow the relay
when its rate changes mid-run.
"""

from __future__ import annotations

import statistics

import pytest
import torch
import trio

from devtools.link_proxy import LinkShape, Relay
from swarm.link.options import LinkOptions
from swarm.node.uplink import Payload, Uplink
from swarm.protocol import PREFILL, Ping, Pong, Step
from swarm.transport import FramedStream, connect

MBPS = 1e6
DELAY = 0.015
HIDDEN = 576
TOKENS = 32  # 36 KiB of float16 per frame
GAP_S = 0.1  # between bursts: at 5 Mbps the link idles 40% of the time


async def answer_pings(stream: trio.SocketStream) -> None:
    conn = FramedStream(stream)
    try:
        while (msg := await conn.receive()) is not None:
            if isinstance(msg, Ping):
                await conn.send(conn.pong(msg.nonce))
    except trio.BrokenResourceError:
        pass


async def read_pongs(uplink: Uplink, dest: str, conn: FramedStream) -> None:
    while (msg := await conn.receive()) is not None:
        if isinstance(msg, Pong):
            uplink.on_pong(dest, msg.nonce, msg.rx_bytes, msg.rx_us / 1e6)


async def settle(uplink: Uplink, dest: str, conn: FramedStream, seconds: float) -> float:
    """Send bursts for `seconds`; the median estimate over the last third of that time."""
    hidden = torch.randn(1, TOKENS, HIDDEN)
    readings = []
    end = trio.current_time() + seconds
    pos = 0
    while trio.current_time() < end:
        uplink.send_activations(
            Payload(conn, dest, "s", PREFILL, pos, 10**6, hidden, "float16", result=False)
        )
        pos += TOKENS
        await trio.sleep(GAP_S)
        bandwidth = uplink.estimator(dest).bandwidth
        if trio.current_time() > end - seconds / 3 and bandwidth is not None:
            readings.append(bandwidth * 8)
    assert readings, "no bandwidth estimate at all"
    return statistics.median(readings)


async def test_the_estimate_follows_a_live_link_through_rate_changes(nursery):
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    target_port = listeners[0].socket.getsockname()[1]
    nursery.start_soon(trio.serve_listeners, answer_pings, listeners)
    shape = LinkShape(5 * MBPS, DELAY, 64 * 1024)
    back = LinkShape(None, DELAY)
    relay = Relay("127.0.0.1", target_port, up=shape, down=back)
    port = await nursery.start(relay.serve, "127.0.0.1", 0)

    async def broken(stream, exc):
        raise AssertionError(f"the uplink lost its connection: {exc!r}")

    uplink = Uplink(LinkOptions(inflight_gain=0.0, pace_lead_s=None), broken)  # no holds
    nursery.start_soon(uplink.run)
    conn = await connect("127.0.0.1", port, tls=None)
    dest = f"127.0.0.1:{port}"
    nursery.start_soon(read_pongs, uplink, dest, conn)

    figures = {}
    for rate in (5, 20, 5):
        shape = LinkShape(rate * MBPS, DELAY, 64 * 1024)
        relay.set_shape(up=shape)
        figures[rate, len(figures)] = await settle(uplink, dest, conn, 2.4)
    print({k: round(v / MBPS, 2) for k, v in figures.items()})  # with -s: Mbps per phase
    for (rate, _), estimate in figures.items():
        assert estimate == pytest.approx(rate * MBPS, rel=0.10), figures
    assert uplink.estimator(dest).arrival_samples > 50


class GatedReceiver:
    """Reads frames as a node does and answers pings, but while `gate` is shut it keeps the
    pongs back: the sender then sees nothing acknowledged. Counts the prompt tokens it read."""

    def __init__(self):
        self.gate = trio.Event()
        self.gate.set()
        self.tokens: list[int] = []  # tokens of each Step, in arrival order
        self._held: list[int] = []

    async def serve(self, stream: trio.SocketStream) -> None:
        conn = FramedStream(stream)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._release, conn)
            while (msg := await conn.receive()) is not None:
                if isinstance(msg, Step):
                    self.tokens.append(msg.hidden["shape"][1])
                elif isinstance(msg, Ping):
                    self._held.append(msg.nonce)
            nursery.cancel_scope.cancel()

    async def _release(self, conn: FramedStream) -> None:
        while True:
            await self.gate.wait()
            while self._held:
                await conn.send(conn.pong(self._held.pop(0)))
            await trio.sleep(0.005)


async def test_the_in_flight_cap_lets_its_floor_of_prompt_chunks_go_unacknowledged(nursery):
    """The cap compares the prompt's tensor bytes in flight with floor chunks of tensor bytes:
    with a floor of 2 chunks and no acknowledgements coming, exactly 2 chunks go (frame headers
    counted against the floor would let only 1 go, and the link would idle for a round trip
    after every chunk). Once acknowledgements come the rest goes, every token once."""
    receiver = GatedReceiver()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    nursery.start_soon(trio.serve_listeners, receiver.serve, listeners)
    shape = LinkShape(0.5 * MBPS, DELAY, 64 * 1024)
    port = listeners[0].socket.getsockname()[1]
    relay = Relay("127.0.0.1", port, up=shape, down=LinkShape(None, DELAY))
    port = await nursery.start(relay.serve, "127.0.0.1", 0)

    async def broken(stream, exc):
        raise AssertionError(f"the uplink lost its connection: {exc!r}")

    options = LinkOptions(inflight_gain=2.0, inflight_floor_chunks=2, pace_lead_s=None)
    uplink = Uplink(options, broken)  # capped, not paced
    nursery.start_soon(uplink.run)
    conn = await connect("127.0.0.1", port, tls=None)
    dest = f"127.0.0.1:{port}"
    nursery.start_soon(read_pongs, uplink, dest, conn)

    # no decode session yet: prompts go whole, and the estimates come from them
    hidden = torch.randn(1, TOKENS, HIDDEN)
    for i in range(3):
        payload = Payload(conn, dest, "warm", PREFILL, i * TOKENS, 10**6, hidden, "float16", False)
        uplink.send_activations(payload)
    with trio.fail_after(10):
        while len(receiver.tokens) < 3 or uplink.scheduler.stats()["in_flight_bytes"]:
            await trio.sleep(0.05)
    bandwidth = uplink.estimator(dest).bandwidth
    assert bandwidth is not None and bandwidth * 8 < 2 * 0.5 * MBPS  # the cap is the floor

    receiver.gate = trio.Event()  # shut: nothing more is acknowledged
    uplink.observe_decode_arrival("steady")  # a decode session to protect: chunks, and the cap
    prompt = torch.randn(1, 64, HIDDEN)
    uplink.send_activations(Payload(conn, dest, "p", PREFILL, 0, 64, prompt, "float16", False))
    await trio.sleep(1.0)  # 2 chunks of 8 tokens cross 0.5 Mbps in 0.3 s
    assert receiver.tokens[3:] == [8, 8]
    assert uplink.scheduler.holding

    receiver.gate.set()
    with trio.fail_after(10):
        while sum(receiver.tokens[3:]) < 64:
            uplink.observe_decode_arrival("steady")
            await trio.sleep(0.1)
    assert sum(receiver.tokens[3:]) == 64
