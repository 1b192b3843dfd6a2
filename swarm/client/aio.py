"""The client from trio tasks: `await` a session's steps without blocking the caller's loop.

A `Client` runs its network on its own loop thread and its head in the calling thread. From a
trio program (an HTTP server, say), each step goes to a worker thread, so the program's other
tasks run meanwhile and many sessions of one Client step at once (their heads' matmuls batch,
see head_batch.py). Cancelling a step abandons its thread's wait; the session is then closed,
since its caches no longer match what the caller has seen.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import torch
import trio

from swarm.client.client import Client
from swarm.client.decoding import Decoding
from swarm.client.options import MAX_NEW_TOKENS, Sampling
from swarm.client.reply import Sampler


class AsyncSession:
    """`async with AsyncSession(client, max_length) as s: logits = await s.feed(ids)`, or
    `async for token in s.tokens(ids, max_new_tokens, sampler)`; `speculative` as
    Client.session's."""

    def __init__(self, client: Client, max_length: int, speculative: str | None = None):
        self._session = client.session(max_length, speculative)
        self._broken = False
        self.decoding: Decoding | None = None  # once tokens() began: its stats

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def feed(self, ids: list[int]) -> torch.Tensor:
        """Append tokens; logits [vocab] for the next one."""
        return await self._in_thread(self._session.feed, ids)

    async def tokens(
        self, ids: list[int], max_new_tokens: int, sampler: Sampler
    ) -> AsyncIterator[int]:
        """The reply's tokens after prompt `ids` (a Decoding: speculative where the session's
        drafter proposes), each step or round in a worker thread."""
        session = self._session
        self.decoding = Decoding(
            session, ids, max_new_tokens, sampler, session.drafter, pool=session.client.tuners
        )
        tokens = iter(self.decoding)
        while (token := await self._in_thread(next, tokens, None)) is not None:
            yield token

    async def _in_thread(self, fn, *args):
        if self._broken:
            raise RuntimeError("this session was cancelled mid-step; open a new one")
        try:
            return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
        except trio.Cancelled:
            self._broken = True
            raise

    async def aclose(self) -> None:
        # shielded: a cancelled caller still frees the session's caches on the nodes
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(self._session.close)


async def astream(
    client: Client,
    prompt: str | list[dict[str, str]],
    max_new_tokens: int = MAX_NEW_TOKENS,
    stop: Sequence[str] = (),
    speculative: str | None = None,
    **sampling,
) -> AsyncIterator[str]:
    """`Client.stream` for trio tasks: the reply's text piece by piece."""
    ids = await trio.to_thread.run_sync(client.encode, prompt)
    sampler = Sampler(Sampling(**sampling))
    text = client.reply_text(stop)
    async with AsyncSession(client, len(ids) + max_new_tokens, speculative) as session:
        async for token in session.tokens(ids, max_new_tokens, sampler):
            piece, done = text.add(token)
            if piece:
                yield piece
            if done:
                return
        if tail := text.flush():
            yield tail
