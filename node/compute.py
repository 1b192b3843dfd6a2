"""One compute worker per node: decode steps before waiting prefill work, off the trio thread."""

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
    run: Callable[[], Any] = field(compare=False)
    done: Callable[[Any, Exception | None, float], Any] = field(compare=False)  # async


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

    def submit(self, phase: str, tokens: int, run: Callable[[], Any], done) -> None:
        job = Job(0 if phase == DECODE else 1, next(self._order), phase, tokens, run, done)
        heapq.heappush(self._heap, job)
        self._wake.set()

    async def worker(self, observe: Callable[[str, int, float], None] | None = None) -> None:
        while True:
            while not self._heap:
                self._wake = trio.Event()
                await self._wake.wait()
            job = heapq.heappop(self._heap)
            started = time.perf_counter()
            result, error = None, None
            try:
                result = await trio.to_thread.run_sync(job.run, limiter=self._limiter)
            except Exception as exc:  # reported to the session's owner by `done`
                error = exc
            elapsed = time.perf_counter() - started
            self.busy_seconds += elapsed
            if job.phase == DECODE and error is None:
                a = 0.2 if self.decode_step_seconds else 1.0
                self.decode_step_seconds += a * (elapsed - self.decode_step_seconds)
            if observe is not None and error is None:
                observe(job.phase, job.tokens, elapsed)
            await job.done(result, error, elapsed)
