"""A compute lane: one long-lived worker thread running one function at a time, and what
the OS gave each function's thread (compute.py queues the work for the lanes)."""

from __future__ import annotations

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

log = logging.getLogger("swarm.node")


SCHEDSTAT = "/proc/thread-self/schedstat"


@dataclass(frozen=True)
class Usage:
    """What one job's thread got from the OS: seconds on a CPU, and seconds it was ready to run
    but waited for one (Linux schedstat; 0 where the kernel does not tell). A job's wall time
    beyond both was spent blocked (the GIL, a lock)."""

    cpu_s: float = 0.0
    runqueue_s: float = 0.0


class ThreadClock:
    """The calling thread's CPU time so far (the thread's CPU clock: schedstat's own figure
    for a running thread lags to the last tick, 4 ms at HZ=250), and its run-queue time from
    schedstat if it can be read."""

    def __init__(self) -> None:
        try:
            self._file = open(SCHEDSTAT, "rb", buffering=0)  # noqa: SIM115 (kept for the thread)
        except OSError:
            self._file = None

    def read(self) -> tuple[float, float]:
        if self._file is not None:
            try:
                self._file.seek(0)
                _, wait_ns, _ = self._file.read().split()
                return time.thread_time(), int(wait_ns) / 1e9
            except (OSError, ValueError):
                self._file = None
        return time.thread_time(), 0.0

    def run(self, fn: Callable[[], Any]) -> tuple[outcome.Outcome, Usage]:
        """`fn`'s outcome, and what this thread got from the OS while it ran."""
        cpu0, wait0 = self.read()
        result = outcome.capture(fn)
        cpu1, wait1 = self.read()
        return result, Usage(cpu1 - cpu0, wait1 - wait0)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


@dataclass(order=True)
class Job:
    """A place in a lane's queue (compute.py)."""

    priority: int
    rank: float  # among jobs of one priority: lower first
    order: int
    go: trio.Event = field(default_factory=trio.Event, compare=False)  # the lane is ours
    released: trio.Event = field(default_factory=trio.Event, compare=False)
    abandoned: bool = field(default=False, compare=False)


class Handoff:
    """Work handed to a lane's thread: its outcome, and what the thread got, once done."""

    def __init__(self) -> None:
        self._box: list[tuple[outcome.Outcome, Usage]] = []
        self._finished = trio.Event()

    def deliver(self, result: outcome.Outcome, usage: Usage) -> None:
        self._box.append((result, usage))
        self._finished.set()

    async def wait(self) -> tuple[outcome.Outcome, Usage]:
        # once handed over the work runs to its end; waiting for it keeps one job per lane
        # and keeps a session's cache in its scope until the thread is done with it
        with trio.CancelScope(shield=True):
            await self._finished.wait()
        return self._box[0]


class Lane:
    """One worker thread, `nice` steps below the node's priority, running one function at a
    time."""

    def __init__(self, name: str, nice: int = 0):
        self.name = name
        self.nice = nice
        self.heap: list[Job] = []
        self.holder: Job | None = None  # the job whose turn it is
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
        clock = ThreadClock()
        while (item := self._work.get()) is not None:
            fn, token, deliver = item
            result, usage = clock.run(fn)
            try:
                token.run_sync_soon(deliver, result, usage)
            except trio.RunFinishedError:
                pass  # the node stopped while this ran
        clock.close()

    def submit(self, fn: Callable[[], Any]) -> Handoff:
        """Hand `fn` to this lane's thread now (from the trio thread)."""
        if self._thread is None:
            raise trio.ClosedResourceError(f"the {self.name} lane has stopped")
        handoff = Handoff()
        self._work.put((fn, trio.lowlevel.current_trio_token(), handoff.deliver))
        return handoff

    async def run(self, fn: Callable[[], Any]) -> tuple[outcome.Outcome, Usage]:
        """Run `fn` in this lane's thread: its outcome, and what the thread got from the OS."""
        return await self.submit(fn).wait()

    @property
    def idle(self) -> bool:
        """The lane's thread runs, and no job holds the lane or waits for it."""
        free = self.holder is None or self.holder.released.is_set()
        return self._thread is not None and not self.heap and free
