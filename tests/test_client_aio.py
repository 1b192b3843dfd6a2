"""One Client used from many trio tasks at once (issue 23): each task's session gets its own
tokens, and a task cancelled mid-step frees its session on the nodes."""

from __future__ import annotations

import threading
import time

import pytest
import trio

from swarm.client.aio import AHEAD, AsyncSession
from swarm.client.client import Client
from swarm.client.options import Sampling
from swarm.client.reply import Sampler
from swarm.errors import SessionNotFound, SwarmError
from tests.conftest import reference_greedy

PROMPTS = [[5, 17, 300, 42], [7, 99, 123, 64, 1, 2, 3], [400, 12], [33] * 9]
NEW_TOKENS = 12


async def greedy(client: Client, ids: list[int]) -> list[int]:
    out = []
    async with AsyncSession(client, len(ids) + NEW_TOKENS) as s:
        logits = await s.feed(ids)
        for _ in range(NEW_TOKENS):
            out.append(int(logits.argmax()))
            logits = await s.feed([out[-1]])
    return out


def test_trio_tasks_sharing_a_client_each_get_their_own_tokens(tiny_client, tiny_reference):
    got: dict[int, list[int]] = {}

    async def main():
        async with trio.open_nursery() as nursery:
            for i, ids in enumerate(PROMPTS):

                async def one(i=i, ids=ids):
                    got[i] = await greedy(tiny_client, ids)

                nursery.start_soon(one)

    trio.run(main)
    for i, ids in enumerate(PROMPTS):
        assert got[i] == reference_greedy(tiny_reference, ids, NEW_TOKENS)


def open_sessions(client: Client) -> int:
    return sum(r.sessions for r in client.nodes())


def wait_for_sessions(client: Client, ok, timeout: float = 20.0) -> int:
    deadline = time.monotonic() + timeout  # records refresh every announce-ttl / 3
    while not ok(n := open_sessions(client)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return n


def test_a_task_cancelled_mid_step_frees_its_session_on_the_nodes(tiny_client):
    before = open_sessions(tiny_client)  # other modules' sessions may still be open

    async def main():
        with trio.move_on_after(30) as scope:
            async with AsyncSession(tiny_client, 500) as s:
                logits = await s.feed(PROMPTS[0])
                seen = await trio.to_thread.run_sync(
                    wait_for_sessions, tiny_client, lambda n: n > before
                )
                assert seen > before, "the open session never showed in the records"
                scope.deadline = trio.current_time() + 0.3
                while True:  # stepping until cancelled, wherever that lands
                    logits = await s.feed([int(logits.argmax())])

    trio.run(main)
    assert wait_for_sessions(tiny_client, lambda n: n <= before) <= before


def reply_threads() -> int:
    return sum(t.name == "swarm-reply" and t.is_alive() for t in threading.enumerate())


def greedy_sampler() -> Sampler:
    return Sampler(Sampling())


def test_a_replys_tokens_from_a_trio_task_are_the_greedy_tokens(tiny_client, tiny_reference):
    ids = PROMPTS[1]
    got: list[int] = []

    async def main():
        async with AsyncSession(tiny_client, len(ids) + NEW_TOKENS) as s:
            async for token in s.tokens(ids, NEW_TOKENS, greedy_sampler()):
                got.append(token)

    trio.run(main)
    assert got == reference_greedy(tiny_reference, ids, NEW_TOKENS)


def test_a_reply_goes_on_while_its_callers_loop_is_busy_but_only_so_far_ahead(tiny_client):
    ids, new = PROMPTS[0], 40
    made: list[int] = []

    async def main():
        async with AsyncSession(tiny_client, len(ids) + new) as s:
            tokens = s.tokens(ids, new, greedy_sampler())
            await anext(tokens)
            # the loop blocked (a busy server): the reply's thread steps on regardless
            deadline = time.monotonic() + 30
            while len(s.decoding.tokens) < len(ids) + 1 + AHEAD and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # time for more steps, which it must not take
            made.append(len(s.decoding.tokens) - len(ids))
            await tokens.aclose()

    trio.run(main)
    assert made == [1 + AHEAD]


def test_a_reply_left_early_ends_its_thread_and_frees_its_session(tiny_client):
    before = open_sessions(tiny_client)
    threads = reply_threads()
    got: list[int] = []

    async def main():
        async with AsyncSession(tiny_client, 500) as s:
            async for token in s.tokens(PROMPTS[2], 400, greedy_sampler()):
                got.append(token)
                if len(got) == 3:
                    break

    trio.run(main)
    assert len(got) == 3
    assert reply_threads() == threads
    assert wait_for_sessions(tiny_client, lambda n: n <= before) <= before


def test_a_failed_step_raises_in_the_callers_task(tiny_client):
    threads = reply_threads()

    async def main():
        # room for the prompt only: the reply's first step cannot fit the nodes' caches
        async with AsyncSession(tiny_client, 2) as s:
            async for _ in s.tokens(PROMPTS[1], 4, greedy_sampler()):
                pass

    with pytest.raises(SwarmError, match="holds 2 tokens"):
        trio.run(main)
    assert reply_threads() == threads


def test_a_session_closed_for_good_opens_no_route_again(tiny_client):
    session = tiny_client.session(64)
    session.feed(PROMPTS[0])
    session.close(final=True)  # as an async reply's close does, maybe while its thread steps
    before = open_sessions(tiny_client)
    with pytest.raises(SessionNotFound, match="closed"):
        session.feed([1])
    assert session.remote is None
    assert wait_for_sessions(tiny_client, lambda n: n <= before, timeout=3) <= before


def test_a_session_left_mid_reply_takes_no_more_steps(tiny_client):
    async def main():
        async with AsyncSession(tiny_client, 500) as s:
            async for _ in s.tokens(PROMPTS[3], 100, greedy_sampler()):
                break
            with pytest.raises(RuntimeError, match="mid-reply"):
                await s.feed([1])

    trio.run(main)
