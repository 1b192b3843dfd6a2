"""Which nodes a route pings, and the round trips a client remembers, so that setting up a route
costs a bounded number of dials however many nodes the swarm holds.

A round trip stays good for RTT_MAX_AGE_S; a node that did not answer a ping is left alone
for FAILED_FOR_S. A route wants PER_BLOCK measured nodes on every block (choice for spreading
load, spares for failures): it pings, in parallel, the best-looking nodes not measured recently
until each block has them, at most MAX_DIALS in all, and EXPLORE more towards KNOWN_PER_BLOCK,
so that a busy client comes to know the replicas it spreads its sessions over a few per route
(knowing 3 of 4, a client would leave the fourth idle). Only if some block then has no node
that answered does it ping again, the next best of those blocks' nodes; in the last round,
nodes that failed lately too (a ping lost on a busy host must not cost the only replica long).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import trio

from swarm.protocol import Hop
from swarm.records import NodeRecord
from swarm.transport import ping

RTT_MAX_AGE_S = 120.0  # a path's round trip changes slowly; a node's load is in its record
FAILED_FOR_S = 10.0  # a dead node's record expires within a TTL (30 s); a busy one recovers
PER_BLOCK = 3  # measured nodes a route wants on each block
KNOWN_PER_BLOCK = 8  # ... and a client comes to know, EXPLORE more a route
EXPLORE = 3
MAX_DIALS = 32  # pings one route may send (a 30-block model of 1-block spans still routes)
MAX_ROUNDS = 3  # after the first, only blocks with no answering node are pinged for
PING_ROUNDS = 2  # the best of two: a first round trip can include the node waking a task up
PING_TIMEOUT_S = 2.0  # a node just started, on a busy host, can take over 1 s to answer first
MAX_REMEMBERED = 4096  # round trips kept; the oldest go first beyond this


@dataclass
class RoundTrips:
    """Round trips by peer, with when they were measured, and when pings failed (sans-IO)."""

    max_age: float = RTT_MAX_AGE_S
    failed_for: float = FAILED_FOR_S
    _rtt: dict[str, tuple[float, float]] = field(default_factory=dict)  # peer -> (rtt, when)
    _failed: dict[str, float] = field(default_factory=dict)  # peer -> when
    # pings write from the client's trio thread while sessions' threads read
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def rtt(self, peer: str) -> float | None:
        found = self._rtt.get(peer)
        return found[0] if found else None

    def all(self) -> dict[str, float]:
        with self._lock:
            return {peer: rtt for peer, (rtt, _) in self._rtt.items()}

    def fresh(self, peer: str, now: float) -> bool:
        found = self._rtt.get(peer)
        return found is not None and now - found[1] < self.max_age

    def failed(self, peer: str, now: float) -> bool:
        when = self._failed.get(peer)
        return when is not None and now - when < self.failed_for

    def answered(self, peer: str, rtt: float, now: float) -> None:
        with self._lock:
            self._failed.pop(peer, None)
            self._rtt.pop(peer, None)  # re-inserted last: dicts keep order, oldest first
            self._rtt[peer] = (rtt, now)
            while len(self._rtt) > MAX_REMEMBERED:
                del self._rtt[next(iter(self._rtt))]

    def forget(self, peer: str) -> None:
        """`peer` failed a session: a route pings it again before using it."""
        with self._lock:
            self._rtt.pop(peer, None)

    def silent(self, peer: str, now: float) -> None:
        """`peer` did not answer a ping: routes leave it out for a while."""
        with self._lock:
            self._rtt.pop(peer, None)
            self._failed[peer] = now
            if len(self._failed) > MAX_REMEMBERED:
                recent = {p: t for p, t in self._failed.items() if now - t < self.failed_for}
                self._failed = recent

    def good(self, peer: str, now: float) -> bool:
        return self.fresh(peer, now) and not self.failed(peer, now)


def pick_probes(
    records: Sequence[NodeRecord],
    num_layers: int,
    trips: RoundTrips,
    now: float,
    rank: Callable[[NodeRecord], float],
    per_block: int = PER_BLOCK,
    budget: int = MAX_DIALS,
    retry_failed: bool = False,
    already: Sequence[NodeRecord] = (),
) -> list[NodeRecord]:
    """The records to ping so that every block has `per_block` nodes measured recently: the
    best by `rank` (lower first) first, every block's first node before any block's second.
    Nodes whose ping failed lately are left out unless `retry_failed`; `already`: picked for
    pinging before (counted as measured, not picked again)."""
    have = [0] * num_layers
    picked = {r.peer for r in already}
    for r in records:
        if r.peer in picked or trips.good(r.peer, now):
            for b in range(r.start, r.end):
                have[b] += 1
    order = sorted(
        (
            r
            for r in records
            if not trips.fresh(r.peer, now)
            and (retry_failed or not trips.failed(r.peer, now))
            and r.peer not in picked
        ),
        key=rank,
    )
    chosen: list[NodeRecord] = []
    for depth in range(1, per_block + 1):
        for r in order:
            if len(chosen) >= budget:
                return chosen
            if r in chosen or all(have[b] >= depth for b in range(r.start, r.end)):
                continue
            chosen.append(r)
            for b in range(r.start, r.end):
                have[b] += 1
    return chosen


def covered(records: Iterable[NodeRecord], num_layers: int, trips: RoundTrips, now: float) -> bool:
    """Whether every block has a node that answered recently."""
    have = [False] * num_layers
    for r in records:
        if trips.good(r.peer, now):
            for b in range(r.start, r.end):
                have[b] = True
    return all(have)


class Prober:
    """Pings for routes, on the client's trio loop: a peer pinged by one route is not pinged
    again by another running at once, which waits for that answer instead."""

    def __init__(self, trips: RoundTrips, timeout: float = PING_TIMEOUT_S):
        self.trips, self.timeout = trips, timeout
        self.dials = 0  # pings sent since the client started (benchmarks report it)
        self._inflight: dict[str, trio.Event] = {}

    async def probe(
        self,
        records: Sequence[NodeRecord],
        num_layers: int,
        rank: Callable[[NodeRecord], float],
        budget: int = MAX_DIALS,
    ) -> int:
        """Ping what pick_probes names, then again only while some block lacks an answering
        node; returns the pings sent."""
        sent = 0
        for round_ in range(MAX_ROUNDS):
            now = time.monotonic()
            if round_ and covered(records, num_layers, self.trips, now):
                break
            want, last = (PER_BLOCK if round_ == 0 else 1), round_ == MAX_ROUNDS - 1
            left = budget - sent
            picks = pick_probes(records, num_layers, self.trips, now, rank, want, left, last)
            if round_ == 0:
                more = min(EXPLORE, left - len(picks))
                picks += pick_probes(
                    records, num_layers, self.trips, now, rank, KNOWN_PER_BLOCK, more,
                    already=picks,
                )  # fmt: skip
            if not picks:
                break
            sent += await self.ping_all({r.peer: r.hop() for r in picks})
        return sent

    async def ping_all(self, hops: dict[str, Hop]) -> int:
        """Ping `hops` in parallel (those another route is pinging: wait for its answer);
        returns the pings this call sent."""
        mine = {peer: hop for peer, hop in hops.items() if peer not in self._inflight}
        theirs = [self._inflight[peer] for peer in hops if peer not in mine]
        for peer in mine:
            self._inflight[peer] = trio.Event()
        self.dials += len(mine)
        async with trio.open_nursery() as nursery:
            for peer, hop in mine.items():
                nursery.start_soon(self._one, peer, hop)
            for event in theirs:
                nursery.start_soon(event.wait)
        return len(mine)

    async def _one(self, peer: str, hop: Hop) -> None:
        try:
            reach = await ping(hop, timeout=self.timeout, rounds=PING_ROUNDS)
            now = time.monotonic()
            if reach.rtt_s is None:
                self.trips.silent(peer, now)
            else:
                self.trips.answered(peer, reach.rtt_s, now)
        finally:
            self._inflight.pop(peer).set()


async def round_trips(hops: dict[str, Hop], timeout: float) -> dict[str, float]:
    """Round trips in seconds of the peers that answered a ping within `timeout`."""
    out: dict[str, float] = {}

    async def one(peer: str, hop: Hop) -> None:
        reach = await ping(hop, timeout=timeout)
        if reach.rtt_s is not None:
            out[peer] = reach.rtt_s

    async with trio.open_nursery() as nursery:
        for peer, hop in hops.items():
            nursery.start_soon(one, peer, hop)
    return out


def jittered(cost: Callable[[NodeRecord], float], rng: random.Random) -> Callable:
    """`cost` times a random factor in [1, 2): nodes that look alike (throughputs measured at
    start on a busy host differ by that much) are pinged in a different order by each client,
    so every replica gets measured, and used, by some of them."""
    return lambda r: cost(r) * (1.0 + rng.random())
