"""What a client learns about nodes to route by, and the route it draws from the records: round
trips (probe.py), seconds a block it measured through each node, and the sessions it opened at
each, which the nodes' records, written every few seconds, do not show yet."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence

from swarm.client.probe import MAX_DIALS, Prober, RoundTrips, jittered
from swarm.client.routing import (
    LOAD_PER_SESSION,
    Estimates,
    block_seconds,
    bounded,
    find_route,
)
from swarm.link.estimator import ewma
from swarm.protocol import Hop
from swarm.records import NodeRecord

MEASURE_GAIN = 0.3  # EWMA gain of a node's measured seconds a block
# a node measured slow may have been slow from load that has gone, and routes that avoid it do
# not measure it again: after this its record speaks for it again (a node that lied about its
# speed costs a client one session this often)
MEASURED_MAX_AGE_S = 60.0


class Router:
    """A client's routing knowledge. Thread-safe: sessions route from many threads; the pings
    run on the client's trio loop (`run`)."""

    def __init__(self, run, rng: random.Random | None = None, budget: int = MAX_DIALS):
        self._run, self.rng, self.budget = run, rng or random.Random(), budget
        self.trips = RoundTrips()
        self.prober = Prober(self.trips)
        self._lock = threading.RLock()  # route() holds it around estimates() and opened()
        self._measured: dict[str, tuple[float, float]] = {}  # peer -> (seconds a block, when)
        self._mine: dict[str, list[float]] = {}  # peer -> wall times of our sessions open there
        self._load: dict[str, float] = {}  # peer -> sessions there when last routed through

    @property
    def dials(self) -> int:
        """Pings sent for routes since the client started."""
        return self.prober.dials

    def route(
        self,
        records: Sequence[NodeRecord],
        num_layers: int,
        fingerprint: str,
        exclude: set[str],
        model: str,
        plaintext: bool,
        hold: bool = False,
        span_ok=None,
    ) -> tuple[list[Hop], float]:
        """Ping what the route needs measured (probe.py), then draw it from the nodes that
        answered recently. `hold`: count a session of ours on it at once (the token `closed`
        takes; 0.0 if not held), so sessions routed at the same moment see each other."""
        records = bounded(records, {p for p in self.trips.all() if p not in exclude})
        est = self.estimates(records)
        rank = jittered(lambda r: est.block_cost(r) + est.link(r) / (r.end - r.start), self.rng)
        self._run(self.prober.probe, records, num_layers, rank, self.budget)
        now = time.monotonic()
        reachable = [r for r in records if self.trips.good(r.peer, now)]
        with self._lock:  # the draw and the hold together: a concurrent route sees this one
            est = self.estimates(reachable)
            route = find_route(
                *(reachable, num_layers, fingerprint, est, exclude, model, plaintext, self.rng),
                span_ok=span_ok,
            )
            return route, (self.opened(route) if hold else 0.0)

    def estimates(self, records: Sequence[NodeRecord]) -> Estimates:
        now = time.monotonic()
        with self._lock:
            measured = {
                peer: seconds
                for peer, (seconds, when) in self._measured.items()
                if now - when < MEASURED_MAX_AGE_S
            }
            # a record counts the sessions open when it was written; ours opened since come on top
            load = {
                r.peer: r.sessions + sum(1 for t in self._mine.get(r.peer, ()) if t > r.updated)
                for r in records
            }
            self._load.update(load)
            if len(self._load) > 4 * len(load) + 1024:  # peers long gone
                self._load = dict(load)
        return Estimates(self.trips.all(), measured, load)

    def observe_step(self, route: list[Hop], seconds: float) -> None:
        """A one-token step through `route` took `seconds`: what each of its nodes really does
        replaces what its record claims, in the routes chosen from now on."""
        per_block = block_seconds(route, seconds, self.trips.all())
        now = time.monotonic()
        with self._lock:
            for hop in route:
                # kept as if unloaded (routes multiply in the load of their time): a node
                # measured while busy is not avoided once it no longer is
                others = max(0.0, self._load.get(hop.peer, 0.0) - 1.0)
                unloaded = per_block / (1.0 + LOAD_PER_SESSION * others)
                before = self._measured.get(hop.peer, (None, 0.0))[0]
                self._measured[hop.peer] = (ewma(before, unloaded, MEASURE_GAIN), now)

    def opened(self, route: list[Hop]) -> float:
        """A session of ours on `route`; returns the token `closed` takes."""
        when = time.time()  # records are dated in DHT time, which is wall-clock time
        with self._lock:
            for hop in route:
                self._mine.setdefault(hop.peer, []).append(when)
        return when

    def closed(self, route: list[Hop], when: float) -> None:
        with self._lock:
            for hop in route:
                mine = self._mine.get(hop.peer, [])
                if when in mine:
                    mine.remove(when)
                if not mine:
                    self._mine.pop(hop.peer, None)

    def failed(self, peer: str) -> None:
        """`peer` failed a session: routes ping it again before they use it."""
        self.trips.forget(peer)
