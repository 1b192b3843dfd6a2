"""A node's compute, off the trio thread: decode steps before prefill, by queue and by CPU.

Two lanes by default, each a long-lived thread: decode steps run in one, prompt passes in the
other, so a decode step never waits behind a prompt pass in its own node. The prefill thread runs
at a lower OS priority (a positive nice value), so where cores are short (several nodes on one PC,
or a volunteer's desktop) the kernel gives a decode step the CPU ahead of any prompt pass.
With one lane, jobs share one thread, decode first, then by arrival.

A job may name its work late: `prepare` runs on the trio thread when the job reaches the head of
its lane and returns (tokens, run). Prefill uses this to take whatever has arrived by then, up to
a cap, so a long prompt becomes several passes."""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import outcome
import trio

from swarm.protocol import DECODE

log = logging.getLogger("swarm.node")


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


class Lane:
    """One worker thread, `nice` steps below the node's priority, running one function at a
    time."""

    def __init__(self, name: str, nice: int = 0):
        self.name = name
        self.nice = nice
        self.heap: list[Job] = []
        self.wake = trio.Event()
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._work.put(None)
            self._thread = None

    def _loop(self) -> None:
        if self.nice:
            try:  # on Linux a thread is a task: this sets this thread's priority only
                tid = threading.get_native_id()
                own = os.getpriority(os.PRIO_PROCESS, tid)  # inherited from the node
                os.setpriority(os.PRIO_PROCESS, tid, min(19, own + self.nice))
            except (OSError, AttributeError) as exc:
                log.warning("cannot set nice %d on the %s thread: %s", self.nice, self.name, exc)
        while (item := self._work.get()) is not None:
            fn, token, deliver = item
            result = outcome.capture(fn)
            try:
                token.run_sync_soon(deliver, result)
            except trio.RunFinishedError:
                pass  # the node stopped while this ran

    async def run(self, fn: Callable[[], Any]) -> Any:
        box: list[outcome.Outcome] = []
        finished = trio.Event()

        def deliver(result: outcome.Outcome) -> None:
            box.append(result)
            finished.set()

        self._work.put((fn, trio.lowlevel.current_trio_token(), deliver))
        await finished.wait()
        return box[0].unwrap()


class ComputeQueue:
    def __init__(self, lanes: int = 2, prefill_nice: int = 10) -> None:
        if lanes not in (1, 2):
            raise ValueError(f"a node computes in 1 or 2 lanes, not {lanes}")
        self.lanes = (
            [Lane("decode")] if lanes == 1 else [Lane("decode"), Lane("prefill", prefill_nice)]
        )
        self._order = itertools.count()
        self.busy_seconds = 0.0
        self.decode_step_seconds = 0.0  # EWMA of decode job time, for the throughput figure

    def __len__(self) -> int:
        return sum(len(lane.heap) for lane in self.lanes)

    def submit(
        self,
        phase: str,
        tokens: int,
        run: Callable[[], Any] | None,
        done,
        prepare: Callable[[], tuple[int, Callable[[], Any]] | None] | None = None,
    ) -> None:
        """Queue `run`, or the work `prepare` names when the job's turn comes (None: no work)."""
        priority = 0 if phase == DECODE else 1
        lane = self.lanes[min(priority, len(self.lanes) - 1)]
        heapq.heappush(
            lane.heap, Job(priority, next(self._order), phase, tokens, run, done, prepare)
        )
        lane.wake.set()

    async def worker(self, observe: Callable[[str, int, float], None] | None = None) -> None:
        """Run every lane until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                for lane in self.lanes:
                    lane.start()
                    nursery.start_soon(self._drain, lane, observe)
        finally:
            for lane in self.lanes:
                lane.stop()

    async def _drain(self, lane: Lane, observe) -> None:
        while True:
            while not lane.heap:
                lane.wake = trio.Event()
                await lane.wake.wait()
            job = heapq.heappop(lane.heap)
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
                result = await lane.run(run)
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
