"""The API server's generation slots, shared fairly between callers."""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx  # what this openai client is built on
import openai
import pytest
import trio
import trio.testing

from devtools.launch import start_swarm, stop_all
from swarm.api.fair import FairSlots
from tests.helpers.api import ApiServer
from tests.helpers.flags import exact_flags

MAX_CONNECTIONS = 64


async def hold(slots: FairSlots, caller: str, release: trio.Event, got: list[str]) -> None:
    async with slots.slot(caller):
        got.append(caller)
        await release.wait()


async def test_one_caller_holds_at_most_its_share_of_the_slots(nursery):
    slots, release, got = FairSlots(total=4, per_caller=2), trio.Event(), []
    for _ in range(5):
        nursery.start_soon(hold, slots, "greedy", release, got)
    await trio.testing.wait_all_tasks_blocked()
    assert got == ["greedy"] * 2 and slots.waiting == 3
    release.set()


async def test_a_newcomer_is_served_before_a_callers_backlog(nursery):
    slots, got, never = FairSlots(total=2, per_caller=2), [], trio.Event()
    one = trio.Event()
    nursery.start_soon(hold, slots, "greedy", one, got)
    await trio.testing.wait_all_tasks_blocked()
    for _ in range(5):  # one more holder, then a backlog of four
        nursery.start_soon(hold, slots, "greedy", never, got)
    await trio.testing.wait_all_tasks_blocked()
    nursery.start_soon(hold, slots, "newcomer", never, got)
    await trio.testing.wait_all_tasks_blocked()
    one.set()  # a slot comes free: the newcomer takes it, not greedy's backlog
    await trio.testing.wait_all_tasks_blocked()
    assert slots.held == {"greedy": 1, "newcomer": 1} and slots.waiting == 4
    nursery.cancel_scope.cancel()


async def test_a_caller_cancelled_while_waiting_leaves_no_slot_taken(nursery):
    slots, release, got = FairSlots(total=1, per_caller=1), trio.Event(), []
    nursery.start_soon(hold, slots, "a", release, got)
    await trio.testing.wait_all_tasks_blocked()
    with trio.move_on_after(0.01):
        await hold(slots, "b", trio.Event(), got)
    release.set()
    await trio.testing.wait_all_tasks_blocked()
    assert slots.held == {} and slots.waiting == 0 and got == ["a"]


def test_no_slots_is_an_error():
    with pytest.raises(ValueError):
        FairSlots(total=0, per_caller=1)


# ---- through the API server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_api(tiny_model_dir):
    """An API server with 4 generation slots, at most 2 for one caller; idle connections
    closed after 2 s; 64 connections, 16 for one address. Its own nodes: the shared tiny
    swarm's session counts are other tests'."""
    nodes = start_swarm([(0, 3), (3, 6)], model=str(tiny_model_dir), extra=exact_flags(ttl=6))
    extra = ("--max-requests", "4", "--max-caller-requests", "2", "--idle-timeout", "2")
    extra += ("--max-connections", str(MAX_CONNECTIONS), "--max-caller-connections", "16")
    try:
        server = ApiServer.start(nodes[0].maddrs[:1], tiny_model_dir, *extra)
        yield server
        server.stop()
    finally:
        stop_all(nodes)


def caller(server: ApiServer, address: str) -> openai.OpenAI:
    transport = httpx.HTTPTransport(local_address=address)
    return server.openai(http_client=httpx.Client(transport=transport, timeout=120))


@pytest.mark.slow
def test_a_callers_short_request_does_not_wait_behind_anothers_many_streams(
    small_api, tiny_model_dir
):
    greedy, polite = caller(small_api, "127.0.0.1"), caller(small_api, "127.0.0.2")
    ask = [{"role": "user", "content": "Tell me a long story about the sea."}]
    done: list[str] = []

    def stream(who: str, client: openai.OpenAI, tokens: int) -> None:
        reply = client.chat.completions.create(
            model=tiny_model_dir.name, messages=ask, max_tokens=tokens, temperature=0, stream=True
        )
        for _ in reply:
            pass
        done.append(who)

    with ThreadPoolExecutor(7) as pool:
        for _ in range(6):  # two generate, four wait for greedy's share
            pool.submit(stream, "greedy", greedy, 300)
        time.sleep(1.0)
        pool.submit(stream, "polite", polite, 1).result(timeout=120)
        assert done.count("greedy") <= 2, done  # polite took a free slot at once
    assert done.count("greedy") == 6


def test_a_prompt_far_past_the_context_is_refused_before_tokenizing(small_api, tiny_model_dir):
    client = caller(small_api, "127.0.0.3")
    huge = "word " * 200_000  # a megabyte: no tokenizer needed to see it cannot fit 512 tokens
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=tiny_model_dir.name, prompt=huge, max_tokens=1)
    assert refused.value.code == "context_length_exceeded"
    assert "characters cannot fit" in refused.value.message


def test_a_connection_that_never_finishes_its_headers_is_closed(small_api):
    host, port = small_api.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as slow:
        slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        started = time.monotonic()
        assert slow.recv(1024) == b""  # closed by the server
        assert time.monotonic() - started < 10


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_thousand_slow_connections_take_few_descriptors_and_a_request_is_still_answered(
    small_api, tiny_model_dir
):
    host, port = small_api.url.removeprefix("http://").rsplit(":", 1)
    pid = small_api.proc.pid
    before, peak, done = open_fds(pid), [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], open_fds(pid))
            time.sleep(0.005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    slow: list[socket.socket] = []
    try:
        for i in range(1100):  # from 50 addresses: more than the cap, more than any share
            s = socket.create_connection(
                (host, int(port)), timeout=10, source_address=(f"127.0.1.{1 + i % 50}", 0)
            )
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # no more
            slow.append(s)
        reply = caller(small_api, "127.0.0.9").chat.completions.create(
            model=tiny_model_dir.name, messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )
        assert reply.choices[0].finish_reason in ("length", "stop")
    finally:
        done.set()
        sampler.join()
        for s in slow:
            s.close()
    # the table's places, the refusals under way, a few for the request's own connections
    assert peak[0] - before <= MAX_CONNECTIONS + 16 + 8, (before, peak[0])
    assert small_api.proc.poll() is None
