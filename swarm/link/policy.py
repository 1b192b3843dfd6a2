"""Link policies: which queued volume goes next, and how many tokens of it.

`MolinkPolicy` is Algorithm 1 of MoLink ("Distributed LLM Serving on Consumer-Grade GPUs by
Reconciling Computation and Communication", 2025; docs/design.md, "The link scheduler"). A
waiting weight W counts decisions at which both FIFOs held work. While W < max_wait a decode
volume goes whole; otherwise a prefill volume goes, whole if W >= max_wait (so prefill cannot
starve), else as a chunk sized just in time, and W resets. A chunk is as many tokens as the link
carries (at `margin` of its estimated bandwidth) in T_a (freetime.py), less the backlog already
on the link (flight.py), and no fewer than the floor. With no decode session active a prefill
goes whole: there is nothing to protect. The in-flight cap and pacing (flight.py) may hold a
chunk back.

Which waiting prefill goes next is not Algorithm 1's concern (it takes the head of one queue).
Here, by default, it is the one whose prompt needs the least link time left, less the time its
oldest unsent bytes have waited here (`prefill_order="shortest"`): shortest-remaining-first
lowers the mean time to first token when prompts overlap, and the credit for waiting means a
long prompt goes before any newcomer that needs less time than it has waited, so it cannot
starve. `prefill_order="arrival"` takes the oldest.

`FifoPolicy` sends whole volumes in arrival order: what concurrent socket sends amount to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from swarm.link.flight import Flight, whole_tokens
from swarm.link.freetime import Window
from swarm.link.links import Links
from swarm.link.options import LinkOptions
from swarm.link.queues import Queued, Queues
from swarm.link.stats import LinkCounters
from swarm.protocol import DECODE, PREFILL


@dataclass(frozen=True)
class Go:
    """Send the next `tokens` of `item` now."""

    item: Queued
    tokens: int


@dataclass(frozen=True)
class Hold:
    """A prefill waits, though the link is free: for pacing until `until`, or (None) for
    acknowledgements."""

    until: float | None = None


Decision = Go | Hold | None  # None: nothing to send


class Policy(Protocol):
    waiting_weight: int
    last_window: Window | None  # T_a at the last chunk sized, for the stats

    def decide(self, now: float) -> Decision: ...


class FifoPolicy:
    """Whole volumes in arrival order."""

    waiting_weight = 0
    last_window = None

    def __init__(self, queues: Queues):
        self._queues = queues

    def decide(self, now: float) -> Decision:
        heads = (self._queues.first_eligible(DECODE), self._queues.first_eligible(PREFILL))
        pick = min((q for q in heads if q), key=lambda q: q.vid, default=None)
        return None if pick is None else Go(pick, pick.left)


class MolinkPolicy:
    """MoLink's Algorithm 1 with just-in-time prefill chunks."""

    def __init__(
        self,
        options: LinkOptions,
        queues: Queues,
        links: Links,
        flight: Flight,
        free_time: Callable[[float], Window | None],
        counters: LinkCounters,
    ):
        self._options = options
        self._queues = queues
        self._links = links
        self._flight = flight
        self._free_time = free_time
        self._counters = counters
        self._next_prefill = PREFILL_PICKS[options.prefill_order]
        self.waiting_weight = 0  # W
        self.last_window: Window | None = None

    def decide(self, now: float) -> Decision:
        decode = self._queues.first_eligible(DECODE)
        prefill = self._queues.first_eligible(PREFILL)
        if decode and prefill:
            self.waiting_weight += 1
        if decode and self.waiting_weight < self._options.max_wait:
            return Go(decode, decode.left)
        if prefill is None:
            return None
        prefill = self._next_prefill(self._queues, self._links, now) or prefill
        if decode:  # W reached N: the prefill has waited long enough
            tokens = prefill.left
            self._counters.w_resets += 1
        else:
            dest = prefill.volume.dest
            if self._flight.must_hold(prefill, now):
                self._counters.prefill_held += 1
                return Hold()
            wait = self._flight.pace_wait(dest, now)
            if wait > 0:
                self._counters.prefill_paced += 1
                return Hold(until=now + wait)
            tokens = self._count_chunk(prefill, now)
        self.waiting_weight = 0
        # the link time lost while the oldest prefill here waited (to the cap, to pacing, or to
        # a driver slow to come back)
        oldest = self._queues.waiting(PREFILL)[0].enqueued
        self._counters.prefill_idle_s += self._links.idle(prefill.volume.dest, oldest, now)
        return Go(prefill, tokens)

    def chunk_tokens(self, prefill: Queued, now: float) -> int:
        """How many of the tokens left of `prefill` to send now (W < N): all of them with no
        decode session to protect, else what the link carries in T_a less its backlog."""
        window = self._free_time(now)
        self.last_window = window
        if window is None:
            return prefill.left
        volume = prefill.volume
        bandwidth = self._links.bandwidth(volume.dest)
        tokens = 0
        t_a = window.t_a - self._flight.backlog(volume.dest, now)
        if bandwidth is not None and t_a > 0:
            tokens = whole_tokens(self._options.margin * bandwidth * t_a, volume.bytes_per_token)
        return min(prefill.left, max(self._flight.floor_tokens(volume), tokens))

    def _count_chunk(self, prefill: Queued, now: float) -> int:
        tokens = self.chunk_tokens(prefill, now)
        if self.last_window is None:
            self._counters.prefill_whole_idle += 1
        else:
            self._counters.count_chunk(tokens)
        return tokens


def oldest_prefill(queues: Queues, links: Links, now: float) -> Queued | None:
    """The eligible prefill volume queued first."""
    return queues.first_eligible(PREFILL)


def shortest_prefill(queues: Queues, links: Links, now: float) -> Queued | None:
    """The eligible prefill volume whose prompt would be done first: the fewest seconds of its
    phase left to send, less how long its oldest unsent bytes have waited here (so a long prompt
    cannot starve behind a stream of short ones); the earliest queued among equals. Without a
    bandwidth estimate, the fewest tokens left."""

    def key(q: Queued) -> tuple[float, int]:
        bandwidth = links.bandwidth(q.volume.dest)
        if bandwidth is None:
            return float(q.phase_left), q.vid
        left_s = q.phase_left * q.volume.bytes_per_token / bandwidth
        return left_s - (now - q.enqueued), q.vid

    return min(queues.eligible(PREFILL), key=key, default=None)


PREFILL_PICKS: dict[str, Callable[[Queues, Links, float], Queued | None]] = {
    "arrival": oldest_prefill,
    "shortest": shortest_prefill,
}
