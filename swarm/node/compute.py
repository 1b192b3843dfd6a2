"""A node's compute, off the trio thread: decode steps before prefill, by queue and by CPU.

Two lanes by default, each a long-lived thread: decode steps run in one, prompt passes in the
other, so a decode step never waits behind a prompt pass in its own node. The prefill thread runs
at a lower OS priority (a positive nice value), so where cores are short (several nodes on one PC,
or a volunteer's desktop) the kernel gives a decode step the CPU ahead of any prompt pass.
With one lane, jobs share one thread, decode first.

Prompt passes wait in their lane shortest-first by default: a prompt's next pass is ranked by when
the prompt began to arrive plus the compute its tokens still need (at the node's measured
seconds per prompt token), so the prompt that would be done first goes first, and a long prompt
that has waited longer than a newcomer needs goes before it. "round-robin" ranks every pass
alike: waiting prompts take turns, a pass each.

Work is awaited: `await queue.run(phase, fn, tokens)`. A prompt pass may take its place early
(`reserve`) and name its work when its turn comes, to take whatever has arrived by then, up to a
cap, so a long prompt becomes several passes.

Decode steps of different sessions batch (`await queue.decode(key, item, run_batch)`): each
step queues for the decode lane as before, and the first whose turn comes takes every step
waiting with the same key (up to `max_batch`) into one call; the others get their share of its
results without a turn of their own. A step that arrives while a pass runs joins the next
one. (Decode is memory-bound: reading a layer's weights once for eight rows costs little more
than for one.) With `gather` the pass whose turn has come may wait a little for steps due soon
(gather.py: only where that finishes them all sooner).

A lone session's decode step that finds the decode lane idle needs no turn: the task that read
it starts its pass at once (`decode_now`, from the session's `take_step`), holding the lane as
a turn would, and the session's task takes the result (`finish`). The lane threads themselves
are lane.py's."""

from __future__ import annotations

import functools
import heapq
import itertools
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import outcome
import trio

from swarm.link.estimator import ewma
from swarm.node.config import PASS_ORDERS, ComputeConfig
from swarm.node.gather import Forecast
from swarm.node.lane import Handoff, Job, Lane, ThreadClock, Usage
from swarm.protocol import DECODE


def _pass_of(
    run_batch: Callable[[list[Any]], list[outcome.Outcome]], items: list[Any]
) -> list[outcome.Outcome]:
    outs = run_batch(items)
    if len(outs) != len(items):
        raise RuntimeError(f"a pass of {len(items)} steps gave {len(outs)} results")
    return outs


@dataclass(frozen=True)
class Done:
    """A finished job: its function's result, wall seconds, and what its thread got."""

    result: Any
    elapsed: float
    usage: Usage


@dataclass(eq=False)
class _Rider:
    """A decode step waiting to join a pass; `ready` is set when its turn comes or when another
    step's pass has computed it (then `done` holds its share)."""

    item: Any
    who: Hashable = None  # its session, for the forecast of arrivals
    ready: trio.Event = field(default_factory=trio.Event)
    ticket: Ticket | None = None
    done: Done | None = None
    taken: bool = False  # into another step's pass


@dataclass(frozen=True)
class Early:
    """A decode step's pass started as the step arrived (ComputeQueue.decode_now)."""

    ticket: Ticket
    handoff: Handoff
    forecast: Forecast
    who: Hashable
    started: float


class Ticket:
    """A place in a lane's queue. Its turn comes when the lane is free and no job ranked before
    it waits; then it runs at most one function and releases the lane (or releases it unused).
    A prompt pass takes its ticket early, to keep its place, and names its work only when its
    turn comes, so it takes whatever has arrived by then."""

    def __init__(self, queue: ComputeQueue, lane: Lane, job: Job, phase: str):
        self._queue, self._lane, self._job, self.phase = queue, lane, job, phase

    async def turn(self) -> None:
        await self._job.go.wait()

    async def run(self, fn: Callable[[], Any], tokens: int) -> Done:
        """Run `fn` in the lane (the turn must have come); raises what `fn` raised."""
        assert self._job.go.is_set() and not self._job.released.is_set()
        started = time.perf_counter()
        ran, usage = await self._lane.run(fn)
        elapsed = time.perf_counter() - started
        self.release()
        self._queue._account(self.phase, tokens, elapsed, ran)
        return Done(ran.unwrap(), elapsed, usage)

    def release(self) -> None:
        """Give the place or the lane up (idempotent)."""
        if self._job.go.is_set():
            self._job.released.set()
        else:
            self._job.abandoned = True


class ComputeQueue:
    def __init__(
        self,
        lanes: int = ComputeConfig.lanes,
        prefill_nice: int = ComputeConfig.prefill_nice,
        prefill_order: str = ComputeConfig.prefill_order,
        observe: Callable[[str, int, float], None] | None = None,
        max_batch: int = ComputeConfig.max_batch,
        gather: bool = False,
    ) -> None:
        """`observe(phase, tokens, seconds)`: told of each job that succeeded; `max_batch`: most
        decode steps in one pass; `gather`: a pass may wait for steps due soon."""
        if lanes not in (1, 2):
            raise ValueError(f"a node computes in 1 or 2 lanes, not {lanes}")
        if prefill_order not in PASS_ORDERS:
            raise ValueError(
                f"unknown prompt pass order {prefill_order!r}; choose from {PASS_ORDERS}"
            )
        self.prefill_order = prefill_order
        self.lanes = (
            [Lane("decode")] if lanes == 1 else [Lane("decode"), Lane("prefill", prefill_nice)]
        )
        self.observe = observe
        self.max_batch = max_batch
        self._riders: dict[Hashable, list[_Rider]] = {}
        self.gather = gather
        self._forecasts: dict[Hashable, Forecast] = {}
        self._joined: dict[Hashable, trio.Event] = {}  # set when a step joins a key's queue
        self.decode_passes = 0
        self.decode_pass_rows = 0
        self._order = itertools.count()
        self.busy_seconds = 0.0
        self.decode_step_seconds = 0.0  # EWMA of decode job time, for the throughput figure
        self.prefill_token_seconds: float | None = None  # EWMA of a prompt pass's time per token

    def __len__(self) -> int:
        return sum(len(lane.heap) for lane in self.lanes)

    def reserve(self, phase: str, rank: float = 0.0, go: trio.Event | None = None) -> Ticket:
        """A place in the queue from now. Decode steps go before prompt passes; among jobs of a
        phase the lowest `rank` goes first (see prefill_rank), then the earliest reserved."""
        priority = 0 if phase == DECODE else 1
        lane = self.lanes[min(priority, len(self.lanes) - 1)]
        job = Job(priority, rank, next(self._order))
        if go is not None:
            job.go = go
        heapq.heappush(lane.heap, job)
        lane.wake.set()
        return Ticket(self, lane, job, phase)

    async def run(self, phase: str, fn: Callable[[], Any], tokens: int, rank: float = 0.0) -> Done:
        """Queue `fn`, wait for its turn, run it in its lane's thread."""
        ticket = self.reserve(phase, rank)
        try:
            await ticket.turn()
            return await ticket.run(fn, tokens)
        finally:
            ticket.release()

    async def aside(self, fn: Callable[[], Any], tokens: int) -> Done:
        """A decode step's `fn` in a worker thread beside the lanes: a pass that waits on
        another node at every layer (a borrowing session's lender) would hold the decode
        lane, and every other session's steps, through each of those round trips; it
        mostly waits, so it takes its CPU beside the lane's."""

        def timed() -> tuple[outcome.Outcome, Usage]:
            clock = ThreadClock()
            try:
                return clock.run(fn)
            finally:
                clock.close()

        started = time.perf_counter()
        with trio.CancelScope(shield=True):  # the thread has the session's cache till its end
            ran, usage = await trio.to_thread.run_sync(timed)
        elapsed = time.perf_counter() - started
        self._account(DECODE, tokens, elapsed, ran)
        return Done(ran.unwrap(), elapsed, usage)

    async def decode(
        self,
        key: Hashable,
        item: Any,
        run_batch: Callable[[list[Any]], list[outcome.Outcome]],
        who: Hashable = None,
    ) -> Done:
        """One decode step, `item`, computed in a pass with whatever other steps of the same
        `key` wait when the lane comes free: `run_batch(items)` runs in the lane's thread and
        returns an outcome per item, so one item's failure is its own. Returns this item's
        Done (its outcome unwrapped: raises what its item raised). `who`: the step's session,
        whose next step the pass of others may wait for."""
        rider = _Rider(item, who)
        waiting = self._riders.setdefault(key, [])
        waiting.append(rider)
        forecast = None
        if who is not None:
            forecast = self._forecast(key)
            forecast.arrived(who, time.monotonic())
            if (joined := self._joined.pop(key, None)) is not None:  # a pass holds for steps
                joined.set()
        ticket = rider.ticket = self.reserve(DECODE, go=rider.ready)
        try:
            try:
                await rider.ready.wait()
            except trio.Cancelled:
                if rider.taken:
                    # another step's pass reads this session's cache: leaving (which frees
                    # it) waits until that pass is done, as the leading step's does
                    with trio.CancelScope(shield=True):
                        await rider.ready.wait()
                raise
            if rider.done is None:  # our turn: take everything waiting with us
                if self.gather and forecast is not None:
                    await self._gather(key, forecast, waiting)
                await self._decode_pass(rider, waiting, run_batch, forecast)
        finally:
            if forecast is not None:
                forecast.left(who, time.monotonic())
            if rider in waiting:
                waiting.remove(rider)
            if not waiting and self._riders.get(key) is waiting:
                del self._riders[key]
            ticket.release()
        return Done(rider.done.result.unwrap(), rider.done.elapsed, rider.done.usage)

    async def _gather(self, key: Hashable, forecast: Forecast, waiting: list[_Rider]) -> None:
        """Hold the lane, unused, for the steps the forecast says are worth waiting for; go as
        soon as they have all come (or the pass is full)."""
        started = time.monotonic()
        hold = forecast.hold((r.who for r in waiting), started)
        if not hold.expected:
            return
        with trio.move_on_after(hold.until - started):
            while len(waiting) < self.max_batch and not hold.expected <= {r.who for r in waiting}:
                joined = self._joined.setdefault(key, trio.Event())
                await joined.wait()

    async def _decode_pass(
        self,
        leader: _Rider,
        waiting: list[_Rider],
        run_batch: Callable[[list[Any]], list[outcome.Outcome]],
        forecast: Forecast | None = None,
    ) -> None:
        waiting.remove(leader)
        batch = [leader, *waiting[: self.max_batch - 1]]
        del waiting[: self.max_batch - 1]
        for rider in batch[1:]:
            rider.taken = True
            rider.ticket.release()  # taken along: its own place in the queue goes unused
        ticket = leader.ticket
        started = time.perf_counter()
        ran, usage = await ticket._lane.run(
            functools.partial(_pass_of, run_batch, [r.item for r in batch])
        )
        elapsed = time.perf_counter() - started
        ticket.release()
        outs = self._passed(len(batch), elapsed, ran, forecast)
        for rider, out in zip(batch, outs):
            rider.done = Done(out, elapsed, usage)
            rider.ready.set()

    def decode_now(
        self,
        key: Hashable,
        item: Any,
        run_batch: Callable[[list[Any]], list[outcome.Outcome]],
        who: Hashable,
    ) -> Early | None:
        """Start a decode step's pass at once, from the task that received the step, where the
        decode lane is idle and no other session steps through these blocks: the pass `decode`
        would give it, without the turns of the node's tasks on the way to it (a scheduler
        batch each, its code out of the caches between passes). None: it queues (`decode`),
        as every step does where several sessions step (steps arriving in one burst, each
        started as it came, would go one a pass). `finish` gives the pass's Done."""
        lane = self.lanes[0]
        if not lane.idle:
            return None
        now, forecast = time.monotonic(), self._forecast(key)
        if not forecast.alone(who, now):
            return None
        started = time.perf_counter()
        handoff = lane.submit(functools.partial(_pass_of, run_batch, [item]))
        forecast.arrived(who, now)
        job = Job(0, 0.0, next(self._order))
        job.go.set()  # the lane is this step's from now: the lane's drain takes it as given
        heapq.heappush(lane.heap, job)
        lane.wake.set()
        return Early(Ticket(self, lane, job, DECODE), handoff, forecast, who, started)

    async def finish(self, early: Early) -> Done:
        """The Done of a pass `decode_now` started (raises what its step raised)."""
        try:
            ran, usage = await early.handoff.wait()
        finally:
            early.ticket.release()
            early.forecast.left(early.who, time.monotonic())
        elapsed = time.perf_counter() - early.started
        (out,) = self._passed(1, elapsed, ran, early.forecast)
        return Done(out.unwrap(), elapsed, usage)

    def _forecast(self, key: Hashable) -> Forecast:
        """The forecast of steps through blocks `key` (made at their first step)."""
        if (forecast := self._forecasts.get(key)) is None:
            forecast = self._forecasts[key] = Forecast()
        return forecast

    def _passed(
        self, rows: int, elapsed: float, ran: outcome.Outcome, forecast: Forecast | None
    ) -> list[outcome.Outcome]:
        """Count a decode pass of `rows` steps; the outcome of each."""
        self.decode_passes += 1
        self.decode_pass_rows += rows
        if forecast is not None and isinstance(ran, outcome.Value):
            forecast.passed(rows, elapsed)
        self._account(DECODE, rows, elapsed, ran)
        return ran.unwrap() if isinstance(ran, outcome.Value) else [ran] * rows

    @property
    def mean_decode_batch(self) -> float:
        """Decode steps per decode pass so far (1.0 before any)."""
        return self.decode_pass_rows / self.decode_passes if self.decode_passes else 1.0

    def prefill_rank(self, since: float, tokens_left: int) -> float:
        """The rank of a prompt's next pass: (shortest) `since`, when the prompt began to
        arrive, plus the compute its `tokens_left` need, so the prompt that would be done first
        goes first and a prompt that has waited longer than a newcomer needs goes before it;
        by arrival until a pass has been timed. Round-robin: every pass alike."""
        if self.prefill_order == "round-robin":
            return 0.0
        if self.prefill_token_seconds is None:
            return since
        return since + tokens_left * self.prefill_token_seconds

    async def worker(self) -> None:
        """Hand every lane to its jobs in turn, until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                for lane in self.lanes:
                    lane.start()
                    nursery.start_soon(self._drain, lane)
        finally:
            for lane in self.lanes:
                lane.stop()

    async def _drain(self, lane: Lane) -> None:
        while True:
            while not lane.heap:
                lane.wake = trio.Event()
                await lane.wake.wait()
            job = heapq.heappop(lane.heap)
            if job.abandoned:
                continue
            lane.holder = job
            job.go.set()
            await job.released.wait()
            lane.holder = None

    def _account(self, phase: str, tokens: int, elapsed: float, ran: outcome.Outcome) -> None:
        self.busy_seconds += elapsed
        if isinstance(ran, outcome.Error):
            return
        if phase == DECODE:
            self.decode_step_seconds = ewma(self.decode_step_seconds or None, elapsed, 0.2)
        elif tokens > 0:
            self.prefill_token_seconds = ewma(self.prefill_token_seconds, elapsed / tokens, 0.25)
        if self.observe is not None:
            self.observe(phase, tokens, elapsed)
