"""When a decode pass should wait for steps about to arrive (issue 49: batching that pays with
few streams).

A decode pass at real sizes is memory-bound: eight rows through a layer cost little more than
one. Yet with a few closed-loop sessions a node rarely sees them together: a pipeline of two
nodes and four sessions settles with each session alone in its pass, every node busy all the
time and the pair no faster than one node (each step arrives while the pass before it runs, so
each pass finds exactly one waiting). A pass that waits for a step due within a pass's time
breaks that: the two then travel together for good, through every hop.

So the node learns, per session, how long its step is away (from the pass that computed it to
the session's next step arriving: the hops after this one, the client, the hops before) and,
per pass size, what a pass costs. When the lane comes free it waits for the sessions due
soonest as long as that finishes them all sooner than two passes would:

    wait + cost(n + r) < cost(n) + cost(r)

(`n` steps waiting, `r` due in `wait`), which with a pass's fixed cost `a` (cost = a + b x rows)
is: wait less than `a`. A lone session is never held (nothing else is due); a session that
stops stepping (its reply ended, it went to a prompt pass) costs at most one wait, after which
it is late and not waited for until its next step. Sans-IO: the caller passes the clock.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from swarm.link.estimator import ewma

AWAY_GAIN = 0.3  # a session's time away moves with its route, not with one slow step
COST_GAIN = 0.2
JITTER = 0.1  # of a pass's cost: a step due is waited for this much past its forecast
FORGET_S = 5.0  # a session not seen stepping for this long is forgotten


@dataclass
class _Stream:
    done_at: float | None = None  # when its last step's pass ended
    away: float | None = None  # EWMA of a pass's end -> this session's next step arriving
    waiting: bool = False  # a step of it is queued or in a pass now

    def due(self) -> float | None:
        if self.waiting or self.done_at is None or self.away is None:
            return None
        return self.done_at + self.away


@dataclass(frozen=True)
class Hold:
    """Wait until `until` (a monotonic time) for `expected` sessions' steps; none: go now."""

    until: float
    expected: frozenset


GO = Hold(0.0, frozenset())


class Forecast:
    """Decode steps' arrivals per session and passes' costs per size, for one set of blocks."""

    def __init__(self) -> None:
        self._streams: dict[Hashable, _Stream] = {}
        self._cost: dict[int, float] = {}  # rows -> EWMA of a pass's seconds

    def arrived(self, who: Hashable, now: float) -> None:
        """A step of session `who` joined the queue."""
        stream = self._streams.setdefault(who, _Stream())
        if stream.done_at is not None and not stream.waiting:
            stream.away = ewma(stream.away, now - stream.done_at, AWAY_GAIN)
        stream.waiting = True

    def alone(self, who: Hashable, now: float) -> bool:
        """No session but `who` has stepped here lately."""
        self._forget(now)
        return set(self._streams) <= {who}

    def left(self, who: Hashable, now: float) -> None:
        """Session `who`'s step is done here (computed, failed or withdrawn)."""
        stream = self._streams.get(who)
        if stream is not None:
            stream.done_at, stream.waiting = now, False

    def passed(self, rows: int, seconds: float) -> None:
        """A decode pass of `rows` steps took `seconds`."""
        self._cost[rows] = ewma(self._cost.get(rows), seconds, COST_GAIN)

    def cost(self, rows: int) -> float | None:
        """A pass of `rows` steps, in seconds: measured, or a line through the sizes measured
        (one size measured: the same cost, as a memory-bound pass has; none: unknown)."""
        if rows in self._cost:
            return self._cost[rows]
        if not self._cost:
            return None
        sizes = sorted(self._cost)
        below = [s for s in sizes if s < rows]
        above = [s for s in sizes if s > rows]
        lo, hi = (below[-1], above[0]) if below and above else (sizes[0], sizes[-1])
        if lo == hi:
            return self._cost[lo]
        slope = max(0.0, (self._cost[hi] - self._cost[lo]) / (hi - lo))
        return max(self._cost[lo] + slope * (rows - lo), 0.0)

    def hold(self, waiting: Iterable[Hashable], now: float) -> Hold:
        """Whether the pass of the steps of `waiting` sessions, whose lane is free now, should
        wait for others due soon, and for whom."""
        waiting = set(waiting)
        self._forget(now)
        n = len(waiting)
        alone = self.cost(n)
        if alone is None or n == 0:
            return GO
        dues = sorted(
            (due, who)
            for who, s in self._streams.items()
            if who not in waiting and (due := s.due()) is not None and due >= now
        )
        best, expected = GO, []
        for r, (due, who) in enumerate(dues, 1):
            wait = due - now
            if wait >= alone:
                break  # it arrives after the pass would have ended anyway
            expected.append(who)
            together, later = self.cost(n + r), self.cost(r)
            if wait + together < alone + later:
                best = Hold(due + JITTER * alone, frozenset(expected))
        return best

    def _forget(self, now: float) -> None:
        stale = [
            who
            for who, s in self._streams.items()
            if not s.waiting and s.done_at is not None and now - s.done_at > FORGET_S
        ]
        for who in stale:
            del self._streams[who]
