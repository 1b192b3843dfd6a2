"""One compute worker per node: decode steps before waiting prefill work, off the trio thread.

A job may name its work late: `prepare` runs on the trio thread when the job reaches the head of
the queue and returns (tokens, run). Prefill uses this to take whatever has arrived by then, up
to a cap, so a long prompt becomes several passes with queued decode steps between them."""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from swarm.protocol import DECODE


@dataclass(order=True)
class Job:
    priority: int
    order: int
    phase: str = field(compare=False)
    tokens: int = field(compare=False)
    run: Callable[[], Any] | None = field(compare=False)
    done: Callable[[Any, Exception | None, float], Any] = field(compare=False)  # async
    prepare: Callable[[], tuple[int, Callable[[], Any]] | None] | None = field(
        default=None, compare=False
    )


class ComputeQueue:
    """Jobs ordered decode-first, then by arrival; one runs at a time in a worker thread."""

    def __init__(self) -> None:
        self._heap: list[Job] = []
        self._order = itertools.count()
        self._wake = trio.Event()
        self._limiter = trio.CapacityLimiter(1)
        self.busy_seconds = 0.0
        self.decode_step_seconds = 0.0  # EWMA of decode job time, for the throughput figure

    def __len__(self) -> int:
        return len(self._heap)

    def submit(
        self,
        phase: str,
        tokens: int,
        run: Callable[[], Any] | None,
        done,
        prepare: Callable[[], tuple[int, Callable[[], Any]] | None] | None = None,
    ) -> None:
        """Queue `run`, or the work `prepare` names when the job's turn comes (None: no work)."""
        job = Job(0 if phase == DECODE else 1, next(self._order), phase, tokens, run, done, prepare)
        heapq.heappush(self._heap, job)
        self._wake.set()

    async def worker(self, observe: Callable[[str, int, float], None] | None = None) -> None:
        while True:
            while not self._heap:
                self._wake = trio.Event()
                await self._wake.wait()
            job = heapq.heappop(self._heap)
            run, tokens = job.run, job.tokens
            if job.prepare is not None:
                work = job.prepare()
                if work is None:
                    continue
                tokens, run = work
            assert run is not None
            started = time.perf_counter()
            result, error = None, None
            try:
                result = await trio.to_thread.run_sync(run, limiter=self._limiter)
            except Exception as exc:  # reported to the session's owner by `done`
                error = exc
            elapsed = time.perf_counter() - started
            self.busy_seconds += elapsed
            if job.phase == DECODE and error is None:
                a = 0.2 if self.decode_step_seconds else 1.0
                self.decode_step_seconds += a * (elapsed - self.decode_step_seconds)
            if observe is not None and error is None:
                observe(job.phase, tokens, elapsed)
            await job.done(result, error, elapsed)
