"""The node's uplink keeps serving when one send fails from a bug: that connection goes, the node
and every other connection stay (a TCP_INFO read on a just-closed socket once took a node down).
Every connection it writes to gets TCP_NOTSENT_LOWAT, and each client's link is its own."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import torch
import trio

from swarm.link.options import LinkOptions
from swarm.link.tcpinfo import TCP_NOTSENT_LOWAT, get_notsent_lowat
from swarm.node import uplink as uplink_module
from swarm.node.uplink import CLIENTS, NOTSENT_LOWAT, Payload, Uplink
from swarm.protocol import DECODE, PREFILL, Ping, Step
from swarm.transport import FramedStream, connect

HIDDEN = 16


class Receiver:
    """Reads frames as the next node would; records the sessions of the steps it got."""

    def __init__(self):
        self.sids: list[str] = []
        self.got = trio.Event()

    async def serve(self, stream: trio.SocketStream) -> None:
        conn = FramedStream(stream)
        while (msg := await conn.receive()) is not None:
            if isinstance(msg, Step):
                self.sids.append(msg.sid)
                self.got.set()


class BuggyUplink(Uplink):
    """Fails to build any frame of session "bad", the way an unforeseen error would."""

    def _frame(self, p: Payload, offset: int, tokens: int) -> bytes:
        if p.sid == "bad":
            raise RuntimeError("injected fault")
        return super()._frame(p, offset, tokens)


async def open_receiver(nursery) -> tuple[Receiver, FramedStream, str]:
    receiver = Receiver()
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    nursery.start_soon(trio.serve_listeners, receiver.serve, listeners)
    return receiver, await connect("127.0.0.1", port, tls=None), f"127.0.0.1:{port}"


def prompt(conn: FramedStream, dest: str, sid: str) -> Payload:
    hidden = torch.randn(1, 4, HIDDEN)
    return Payload(conn, dest, sid, PREFILL, 0, 100, hidden, "float16", result=False)


async def test_a_failing_send_drops_its_connection_and_the_uplink_serves_the_others(nursery):
    broken: list[tuple[FramedStream, Exception]] = []

    async def on_broken(stream: FramedStream, exc: Exception) -> None:
        broken.append((stream, exc))
        stream.closed = True

    uplink = BuggyUplink(LinkOptions(), on_broken)
    nursery.start_soon(uplink.run)
    _, bad_conn, bad_dest = await open_receiver(nursery)
    good, good_conn, good_dest = await open_receiver(nursery)

    uplink.send_activations(prompt(bad_conn, bad_dest, "bad"))
    uplink.send_activations(prompt(good_conn, good_dest, "good"))
    with trio.fail_after(10):
        await good.got.wait()
    assert [(s, type(e)) for s, e in broken] == [(bad_conn, RuntimeError)]
    assert bad_conn.closed and not good_conn.closed

    good.got = trio.Event()
    uplink.send_activations(prompt(good_conn, good_dest, "good-again"))
    with trio.fail_after(10):
        await good.got.wait()
    assert good.sids == ["good", "good-again"]


async def ignore_broken(stream: FramedStream, exc: Exception) -> None:
    stream.closed = True


async def written(uplink: Uplink, before: int) -> None:
    with trio.fail_after(10):
        while uplink.bytes_sent <= before:
            await trio.sleep(0.005)


@pytest.mark.skipif(TCP_NOTSENT_LOWAT is None, reason="the OS has no TCP_NOTSENT_LOWAT")
async def test_a_new_connection_gets_notsent_lowat_though_its_socket_has_an_old_ones_id(nursery):
    uplink = Uplink(LinkOptions(), ignore_broken)
    nursery.start_soon(uplink.run)
    _, first, _ = await open_receiver(nursery)
    uplink.send_control(first, Ping(nonce=1))
    await written(uplink, 0)
    assert get_notsent_lowat(first.socket) == NOTSENT_LOWAT
    # a later connection whose socket object takes the place (and so the id) of an earlier
    # one: here the same socket under a new connection, its option unset again
    first.socket.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, 0)
    second = FramedStream(first.stream)
    assert id(second.socket) == id(first.socket) and get_notsent_lowat(second.socket) == 0
    sent = uplink.bytes_sent
    uplink.send_control(second, Ping(nonce=2))
    await written(uplink, sent)
    assert get_notsent_lowat(second.socket) == NOTSENT_LOWAT


async def test_each_client_is_measured_apart_and_out_of_the_nodes_link_figures(
    nursery, monkeypatch
):
    kernel_rtt: dict[object, float] = {}  # socket -> the RTT its TCP_INFO reads

    def read_tcp_info(sock):
        return SimpleNamespace(
            rtt_s=kernel_rtt[sock],
            delivery_rate_Bps=None,
            delivery_rate_app_limited=False,
            min_rtt_s=None,
        )

    monkeypatch.setattr(uplink_module, "read_tcp_info", read_tcp_info)
    uplink = Uplink(LinkOptions(), ignore_broken)
    nursery.start_soon(uplink.run)
    (_, near, _), (_, far, _) = [await open_receiver(nursery) for _ in range(2)]
    kernel_rtt[near.socket], kernel_rtt[far.socket] = 0.01, 0.2
    for i, conn in enumerate((near, far)):
        hidden = torch.randn(1, 1, HIDDEN)
        uplink.send_activations(
            Payload(conn, CLIENTS, f"s{i}", DECODE, 0, 1, hidden, "float16", True)
        )
    with trio.fail_after(10):
        while uplink.stats()["client_links"] < 2:
            await trio.sleep(0.005)
    figures = uplink.stats()
    assert figures["rtt_s"] == 0.0  # the node's own links: to next nodes, of which it has none
    assert (uplink.client_link(near).rtt, uplink.client_link(far).rtt) == (0.01, 0.2)
    assert figures["client_rtt_s"] == pytest.approx(0.105)  # the median of the two
    uplink.forget_client(near)  # its connection ended
    assert uplink.client_link(near) is None
    assert (uplink.stats()["client_links"], uplink.stats()["client_rtt_s"]) == (1.0, 0.2)
