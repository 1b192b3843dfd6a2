"""The client from trio tasks: `await` a session's steps without blocking the caller's loop.

A `Client` runs its network on its own loop thread and its head in the calling thread. From a
trio program (an HTTP server, say), a reply's tokens are made on a thread of its own, which
steps through the client's loop and hands each token to the caller's loop as it comes: the
caller's loop is on no step's way, so a busy program (many users' requests) delays nobody's
next step, and a step costs what a synchronous caller's does. Many sessions of one Client step
at once (their heads' matmuls batch, see head_batch.py). `feed()` runs each step in a worker
thread. A step cancelled, or a reply left before its end, leaves the session's caches ahead of
what the caller has seen: the session then takes no more steps, only its close.
"""

from __future__ import annotations

import math
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from functools import partial

import torch
import trio

from swarm.client.client import Client
from swarm.client.decoding import Decoding
from swarm.client.options import MAX_NEW_TOKENS, Sampling
from swarm.client.reply import Sampler

# tokens a reply's thread may make beyond what its caller has taken: past a stop string they
# are wasted on the swarm, so few; a speculative round's tokens come at once, so not one
AHEAD = 8
# how long closing a session waits for its reply's step under way to end before closing anyway
STOP_WAIT_S = 5.0


class AsyncSession:
    """`async with AsyncSession(client, max_length) as s: logits = await s.feed(ids)`, or
    `async for token in s.tokens(ids, max_new_tokens, sampler)`; `speculative` as
    Client.session's."""

    def __init__(self, client: Client, max_length: int, speculative: str | None = None):
        self._session = client.session(max_length, speculative)
        self._broken = False
        self._ahead: _Ahead | None = None
        self.decoding: Decoding | None = None  # once tokens() began: its stats

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def feed(self, ids: list[int]) -> torch.Tensor:
        """Append tokens; logits [vocab] for the next one."""
        self._check()
        try:
            return await trio.to_thread.run_sync(self._session.feed, ids, abandon_on_cancel=True)
        except trio.Cancelled:
            self._broken = True
            raise

    async def tokens(
        self, ids: list[int], max_new_tokens: int, sampler: Sampler
    ) -> AsyncIterator[int]:
        """The reply's tokens after prompt `ids` (a Decoding: speculative where the session's
        drafter proposes), made on the reply's own thread."""
        self._check()
        session = self._session
        self.decoding = Decoding(
            session, ids, max_new_tokens, sampler, session.drafter, pool=session.client.tuners
        )
        self._ahead = ahead = _Ahead(iter(self.decoding))
        try:
            while (token := await ahead.next()) is not None:
                yield token
        finally:
            if not ahead.ended:  # left early: its thread ran ahead of what the caller saw
                self._broken = True
            ahead.stop()

    def _check(self) -> None:
        if self._broken or (self._ahead is not None and not self._ahead.ended):
            raise RuntimeError("this session was left mid-step or mid-reply; open a new one")

    async def aclose(self) -> None:
        # shielded: a cancelled caller still frees the session's caches on the nodes
        with trio.CancelScope(shield=True):
            if self._ahead is not None:  # a step under way must not reopen what is closed
                self._ahead.stop()
                await trio.to_thread.run_sync(self._ahead.join, STOP_WAIT_S)
            await trio.to_thread.run_sync(partial(self._session.close, final=True))


class _End:
    """What a reply's thread hands last: nothing (the reply ended) or what it raised."""

    def __init__(self, error: BaseException | None = None):
        self.error = error


class _Ahead:
    """A token iterator run on a thread of its own, its items handed to the trio loop that
    made this, in order. The thread makes at most AHEAD tokens the caller has not taken."""

    def __init__(self, tokens: Iterator[int]):
        self._credits = threading.Semaphore(AHEAD)
        self._stopped = threading.Event()
        self.ended = False  # the thread's last item taken
        self._send, self._receive = trio.open_memory_channel(math.inf)
        self._trio = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(
            target=self._run, args=(tokens,), name="swarm-reply", daemon=True
        )
        self._thread.start()

    async def next(self) -> int | None:
        """The next token; None once the reply ended. Raises what making it raised."""
        if self.ended:
            return None
        item = await self._receive.receive()
        if isinstance(item, _End):
            self.ended = True
            if item.error is not None:
                raise item.error
            return None
        self._credits.release()
        return item

    def stop(self) -> None:
        """End the thread after the step under way (its tokens are dropped)."""
        self._stopped.set()
        self._credits.release()  # a thread waiting for the caller must see it
        self._receive.close()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self, tokens: Iterator[int]) -> None:
        end = _End()
        try:
            while not self._stopped.is_set():
                self._credits.acquire()
                if self._stopped.is_set():
                    break
                token = next(tokens, None)
                if token is None:
                    break
                self._hand(token)
        except BaseException as exc:  # the caller's to raise, in its own task
            end = _End(exc)
        finally:
            try:
                getattr(tokens, "close", lambda: None)()  # a generator's own cleanup runs here
            finally:
                self._hand(end)

    def _hand(self, item: int | _End) -> None:
        try:
            self._trio.run_sync_soon(self._put, item)
        except trio.RunFinishedError:  # the caller's loop is gone: nobody to make tokens for
            self._stopped.set()

    def _put(self, item: int | _End) -> None:
        # runs on the caller's loop, where an exception would take the whole loop down
        try:
            self._send.send_nowait(item)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass


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
