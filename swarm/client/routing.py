"""Choosing a chain of nodes that covers every block, lowest estimated latency first."""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Iterable

from swarm.errors import RouteUnavailable
from swarm.protocol import Hop
from swarm.records import ONLINE, NodeRecord, block_coverage, coverage_gaps, format_blocks

DEFAULT_RTT = 0.05  # seconds, for nodes not pinged yet
DEFAULT_BLOCK_TIME = 0.005  # seconds per block per token, for nodes without a throughput figure
# records of one address, and of one host, that a route dials: anyone can sign records naming
# any address, and must not aim every client at a host's ports (an address holds a relay and
# the 8 nodes it may relay for)
MAX_PER_ADDRESS = 9
MAX_PER_HOST = 16


def usable(
    records: Iterable[NodeRecord],
    fingerprint: str,
    exclude: set[str] = frozenset(),
    plaintext: bool = False,
):
    """The records a route may use: online, the same model, not excluded, and with TLS unless
    `plaintext` (an experiment's client may use nodes run with --plaintext)."""
    return [
        r
        for r in records
        if r.state == ONLINE
        and r.fingerprint == fingerprint
        and r.peer not in exclude
        and (r.tls or plaintext)
    ]


def bounded(records: Iterable[NodeRecord], known: Iterable[str] = ()) -> list[NodeRecord]:
    """At most MAX_PER_ADDRESS records of one address and MAX_PER_HOST of one host, those of
    `known` peers (which answered this client before) first, then the rest in random order."""
    known = set(known)
    order = sorted(records, key=lambda r: (r.peer not in known, random.random()))
    per_address: Counter[str] = Counter()
    per_host: Counter[str] = Counter()
    kept = []
    for r in order:
        host = r.addr.rpartition(":")[0]
        if per_address[r.addr] < MAX_PER_ADDRESS and per_host[host] < MAX_PER_HOST:
            per_address[r.addr] += 1
            per_host[host] += 1
            kept.append(r)
    return kept


def missing_blocks(records: Iterable[NodeRecord], num_layers: int) -> list[tuple[int, int]]:
    return coverage_gaps(block_coverage(records, num_layers))


def hop_cost(
    r: NodeRecord,
    start: int,
    end: int,
    rtts: dict[str, float],
    measured: dict[str, float] | None = None,
) -> float:
    """Estimated seconds one decode token spends on this hop: the link in, then the blocks, at
    the seconds a block this client measured through the node if it has (`measured`), else at
    the throughput its record announces (a claim anyone can inflate)."""
    per_block = (measured or {}).get(r.peer)
    if per_block is None:
        announced = r.throughput * (r.end - r.start)
        per_block = 1.0 / announced if announced > 0 else DEFAULT_BLOCK_TIME
    return rtts.get(r.peer, DEFAULT_RTT) / 2 + (end - start) * per_block


def block_seconds(route: list[Hop], seconds: float, rtts: dict[str, float]) -> float:
    """Seconds a block took in one decode step of `route` that took `seconds` from the client
    and back: what the links (half of each hop's round trip, and the last hop's way back) do
    not explain, spread over the route's blocks."""
    links = sum(rtts.get(h.peer, DEFAULT_RTT) / 2 for h in route)
    links += rtts.get(route[-1].peer, DEFAULT_RTT) / 2
    return max(0.0, seconds - links) / sum(h.end - h.start for h in route)


def find_route(
    records: Iterable[NodeRecord],
    num_layers: int,
    fingerprint: str,
    rtts: dict[str, float] | None = None,
    exclude: set[str] = frozenset(),
    model: str = "the model",
    plaintext: bool = False,
    measured: dict[str, float] | None = None,
) -> list[Hop]:
    """Shortest path over block boundaries 0..num_layers; a hop may use part of a node's span.
    `measured`: seconds a block, by peer, as this client found them (see hop_cost)."""
    rtts = rtts or {}
    nodes = usable(records, fingerprint, exclude, plaintext)
    gaps = missing_blocks(nodes, num_layers)
    if gaps:
        raise RouteUnavailable(f"no online node serves blocks {format_blocks(gaps)} of {model}")
    best = {0: 0.0}
    prev: dict[int, tuple[int, NodeRecord]] = {}
    queue = [(0.0, 0)]
    while queue:
        cost, pos = heapq.heappop(queue)
        if pos == num_layers:
            break
        if cost > best.get(pos, float("inf")):
            continue
        for r in nodes:
            if not r.start <= pos < r.end:
                continue
            for stop in range(pos + 1, r.end + 1):
                c = cost + hop_cost(r, pos, stop, rtts, measured)
                if c < best.get(stop, float("inf")):
                    best[stop] = c
                    prev[stop] = (pos, r)
                    heapq.heappush(queue, (c, stop))
    route, pos = [], num_layers
    while pos > 0:
        start, r = prev[pos]
        route.append(r.hop(start, pos))
        pos = start
    return route[::-1]
