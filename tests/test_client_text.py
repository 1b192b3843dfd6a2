"""Replies as text through real nodes of the default model: generate, stream, stop strings, and
the same from trio tasks."""

from __future__ import annotations

import pytest
import trio

from devtools.launch import start_swarm, stop_all
from swarm.client.aio import astream
from swarm.client.client import Client

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def client():
    nodes = start_swarm([(0, 15), (15, 30)], extra=["--threads", "1"])
    try:
        c = Client(nodes[0].maddrs[:1])
        yield c
        c.close()
    finally:
        stop_all(nodes)


def test_streamed_pieces_make_up_the_generated_reply(client):
    whole = client.generate(CHAT, max_new_tokens=24)
    pieces = list(client.stream(CHAT, max_new_tokens=24))
    assert len(pieces) > 1 and "".join(pieces) == whole and whole.strip()


def test_interleaved_replies_each_count_their_own_tokens(client):
    short = client.stream(CHAT, max_new_tokens=4)
    other = client.stream([{"role": "user", "content": "Count to twenty."}], max_new_tokens=12)
    short_text = next(short)
    other_text = "".join(other)  # all of another reply on the same client, meanwhile
    short_text += "".join(short)
    decode = client.tokenizer.decode
    assert decode(short.tokens, skip_special_tokens=True) == short_text
    assert decode(other.tokens, skip_special_tokens=True) == other_text
    assert len(short.tokens) <= 4 < len(other.tokens)


def test_a_stop_string_ends_the_reply_before_it(client):
    whole = client.generate(CHAT, max_new_tokens=24)
    stop = whole.split()[2]  # a word from the reply's middle
    cut = client.generate(CHAT, max_new_tokens=24, stop=[stop])
    assert cut == whole[: whole.index(stop)]


def test_trio_tasks_stream_the_same_replies_at_once(client):
    want = client.generate(CHAT, max_new_tokens=16)
    got: list[str] = ["", "", ""]

    async def main():
        async with trio.open_nursery() as nursery:
            for i in range(len(got)):

                async def one(i=i):
                    async for piece in astream(client, CHAT, max_new_tokens=16):
                        got[i] += piece

                nursery.start_soon(one)

    trio.run(main)
    assert got == [want] * len(got)
