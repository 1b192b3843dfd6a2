"""The HTTP servers' connection cap (swarm/http_server.py): who makes room when it is reached,
and what a client sees, on a real hypercorn server over loopback."""

from __future__ import annotations

import json

import pytest
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from swarm.cli import hypercorn_config
from swarm.http_server import (
    WAITING,
    ConnectionLimits,
    ConnectionTable,
    TooManyConnections,
    serve,
)

# ---- who makes room ---------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(total: int, per_caller: int) -> tuple[ConnectionTable, Clock]:
    clock = Clock()
    return ConnectionTable(ConnectionLimits(total, per_caller, grace_s=2.0), clock), clock


def test_a_full_server_closes_the_longest_idle_connection_of_the_address_holding_most():
    t, clock = table(total=4, per_caller=3)
    a1, _ = t.admit(("10.0.0.1", 1))
    t.admit(("10.0.0.1", 2))
    b1, _ = t.admit(("10.0.0.2", 1))
    t.admit(("10.0.0.1", 3))
    clock.now += 5
    with t.request(a1.peer):  # a request under way keeps its connection
        _, victim = t.admit(("10.0.0.3", 1))
    assert victim is not None and victim.peer == ("10.0.0.1", 2)
    assert t.held == {"10.0.0.1": 2, "10.0.0.2": 1, "10.0.0.3": 1}
    assert b1.peer in t.open


def test_an_address_at_its_share_gives_up_its_own_idle_connection():
    t, clock = table(total=8, per_caller=2)
    t.admit(("10.0.0.2", 1))
    first, _ = t.admit(("10.0.0.1", 1))
    t.admit(("10.0.0.1", 2))
    clock.now += 5
    _, victim = t.admit(("10.0.0.1", 3))
    assert victim is first
    assert t.held == {"10.0.0.1": 2, "10.0.0.2": 1}


def test_a_connection_just_opened_or_just_answered_keeps_its_place_for_the_grace():
    t, clock = table(total=2, per_caller=2)
    a, _ = t.admit(("10.0.0.1", 1))
    clock.now += 5
    with t.request(a.peer):
        t.admit(("10.0.0.2", 1))
        clock.now += 1
    with pytest.raises(TooManyConnections) as full:
        t.admit(("10.0.0.3", 1))
    assert full.value.retry_at == 102.0 + 5  # when the first of them has idled 2 s
    clock.now = full.value.retry_at
    _, victim = t.admit(("10.0.0.3", 1))
    assert victim is not None and victim.peer == ("10.0.0.2", 1)


def test_a_connection_with_a_request_under_way_is_never_closed_to_make_room():
    t, clock = table(total=2, per_caller=2)
    a, _ = t.admit(("10.0.0.1", 1))
    b, _ = t.admit(("10.0.0.2", 1))
    clock.now += 5
    with t.request(a.peer), t.request(b.peer):
        with pytest.raises(TooManyConnections, match="each with a request under way") as full:
            t.admit(("10.0.0.3", 1))
    assert full.value.retry_at is None
    assert set(t.open) == {a.peer, b.peer}


# ---- a real server ----------------------------------------------------------------------------


def small_app(release: trio.Event) -> Starlette:
    async def hello(_request: Request) -> PlainTextResponse:
        return PlainTextResponse("hello")

    async def hold(_request: Request) -> PlainTextResponse:
        await release.wait()
        return PlainTextResponse("held")

    return Starlette(routes=[Route("/", hello), Route("/hold", hold)])


async def start(nursery, limits: ConnectionLimits, release: trio.Event) -> int:
    config = hypercorn_config("127.0.0.1", 0, False, keep_alive_s=60.0)
    binds = await nursery.start(serve, small_app(release), config, limits)
    return int(binds[0].rsplit(":", 1)[1])


async def connect_from(source: str, port: int) -> trio.SocketStream:
    sock = trio.socket.socket()
    await sock.bind((source, 0))
    await sock.connect(("127.0.0.1", port))
    return trio.SocketStream(sock)


async def get(stream: trio.SocketStream, path: str) -> tuple[int, bytes]:
    async with stream:
        await stream.send_all(
            f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
        )
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data.partition(b"\r\n\r\n")[2]


async def closed_by_server(stream: trio.SocketStream) -> bool:
    with trio.move_on_after(0.5):
        return await stream.receive_some(1024) == b""
    return False


async def test_slow_headers_past_the_cap_are_closed_and_a_newcomer_is_answered(nursery):
    limits = ConnectionLimits(total=8, per_caller=4, grace_s=0.5, wait_s=5.0)
    port = await start(nursery, limits, trio.Event())
    slow = []
    for i in range(40):  # from five addresses, headers begun and never finished
        stream = await connect_from(f"127.0.0.{2 + i % 5}", port)
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
        slow.append(stream)
    with trio.fail_after(10):
        status, body = await get(await connect_from("127.0.0.9", port), "/")
    assert (status, body) == (200, b"hello")
    still_open = [s for s in slow if not await closed_by_server(s)]
    assert len(still_open) <= 8 + WAITING
    for s in slow:
        await s.aclose()


async def test_a_newcomer_finding_every_place_busy_gets_503_naming_the_cap(nursery):
    release = trio.Event()
    limits = ConnectionLimits(total=2, per_caller=2, grace_s=0.5, wait_s=0.5)
    port = await start(nursery, limits, release)
    held: list[tuple[int, bytes]] = []

    async def hold(source: str) -> None:
        held.append(await get(await connect_from(source, port), "/hold"))

    nursery.start_soon(hold, "127.0.0.2")
    nursery.start_soon(hold, "127.0.0.3")
    await trio.sleep(0.5)  # both requests under way
    with trio.fail_after(5):
        status, body = await get(await connect_from("127.0.0.4", port), "/")
    assert status == 503
    error = json.loads(body)["error"]
    assert error["code"] == "too_many_connections"
    assert "2 connections, each with a request under way" in error["message"]
    release.set()
    with trio.fail_after(5):
        while len(held) < 2:
            await trio.sleep(0.05)
        status, body = await get(await connect_from("127.0.0.4", port), "/")
    assert held == [(200, b"held")] * 2 and (status, body) == (200, b"hello")
