"""Choosing a chain of nodes that covers every block: what each hop costs (its link, its blocks
at the speed this client measured or the node claims, slowed by the sessions it serves), and a
route drawn among those near the cheapest (within NEAR_BEST, or NEAR_BEST_S on a fast path), so
that sessions spread over replicas rather than all take the best one. Each hop goes to a node
serving the fewest sessions as the client knows them (its records' count plus the client's own
opened since), at random among equals. Not a draw weighted by spare capacity: that leaves even
one client's own sessions uneven (2 clients of 6 sessions over 3 replicas: one replica above 5
in 27% of draws, simulated), while clients that read the same record at once can pile onto its
node only until each counts its own sessions there, which it does as it routes them."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from swarm.errors import RouteUnavailable
from swarm.protocol import Hop
from swarm.records import (
    ONLINE,
    PREFILL,
    NodeRecord,
    block_coverage,
    coverage_gaps,
    format_blocks,
)

DEFAULT_RTT = 0.05  # seconds, for nodes not pinged yet
DEFAULT_BLOCK_TIME = 0.005  # seconds per block per token, for nodes without a throughput figure
# records of one address, and of one host, that a route dials: anyone can sign records naming
# any address, and must not aim every client at a host's ports (an address holds a relay and
# the 8 nodes it may relay for)
MAX_PER_ADDRESS = 9
MAX_PER_HOST = 16
# a decode pass takes up to 4 steps (the node's --max-batch) in little more time than one, so
# each other session stepping at a node delays a step there by about a quarter of a pass
LOAD_PER_SESSION = 0.25
# routes costing this much more than the cheapest are drawn among: a few percent, so that load
# (LOAD_PER_SESSION) and round trips that differ by little do not pin every client to one route
NEAR_BEST = 0.05
# ... or this many seconds more: the best of two pings to a node on a busy host varies by a few
# milliseconds (loopback, 12 nodes on 2 cores), which on a LAN is more than the few percent
NEAR_BEST_S = 0.005
# Prefill on one node, decode on another (P/D): a prompt shorter than this is computed where the
# session decodes; a longer one goes to a prefill node for the route's last blocks, which
# computes it, answers the first token and hands the session, cache and all, to the decode node.
PREFILL_MIN_TOKENS = 64
# ... if the cache reaches the decode node within this many seconds at the prefill node's
# measured uplink, its transfers in flight queued before it. Meanwhile the session decodes on
# the prefill node among its prompt passes; longer means that uplink is the bottleneck (caches
# arrive faster than they leave) and sessions would pile up there. 10 s sent a prefill node's
# prompts back to the decode node whenever one transfer was in flight (46 MB at the 66 Mbit/s
# a loaded loopback measured), which is what P/D is there to spare it.
MAX_HANDOFF_S = 30.0
# A session that generates fewer tokens than this after its prompt stays on the prefill node:
# moving its cache costs both nodes more than decoding its last tokens there. With 32 new
# tokens a session (scripts/bench_disagg.py, loopback), keeping them beat handing them on in
# the steady streams' TPOT p99 (115-122 ms against 169) and in TTFT (21-23 s against 33).
HANDOFF_MIN_NEW_TOKENS = 64
HANDOFF_BANDWIDTH = 12.5e6  # bytes/s assumed where the record has measured none (100 Mbit/s)


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


@dataclass(frozen=True)
class Estimates:
    """What a client knows of nodes beyond their records, by peer: round trips, seconds a block
    it measured through them, and sessions each serves as far as it can tell (the record's,
    plus those the client opened there since)."""

    rtts: Mapping[str, float] = field(default_factory=dict)
    measured: Mapping[str, float] = field(default_factory=dict)
    load: Mapping[str, float] = field(default_factory=dict)

    def sessions(self, r: NodeRecord) -> float:
        return self.load.get(r.peer, float(r.sessions))

    def per_block(self, r: NodeRecord) -> float:
        """Seconds a block of one decode step, unloaded: as measured here, or as the record
        claims (a claim anyone can inflate, which measuring corrects)."""
        measured = self.measured.get(r.peer)
        if measured is not None:
            return measured
        announced = r.throughput * (r.end - r.start)
        return 1.0 / announced if announced > 0 else DEFAULT_BLOCK_TIME

    def link(self, r: NodeRecord) -> float:
        return self.rtts.get(r.peer, DEFAULT_RTT) / 2

    def block_cost(self, r: NodeRecord) -> float:
        """Seconds a block costs on this node now, its load counted."""
        return self.per_block(r) * (1.0 + LOAD_PER_SESSION * self.sessions(r))


def hop_cost(r: NodeRecord, start: int, end: int, est: Estimates | None = None) -> float:
    """Estimated seconds one decode token spends on this hop: the link in, then the blocks."""
    est = est or Estimates()
    return est.link(r) + (end - start) * est.block_cost(r)


def block_seconds(route: list[Hop], seconds: float, rtts: Mapping[str, float]) -> float:
    """Seconds a block took in one decode step of `route` that took `seconds` from the client
    and back: what the links (half of each hop's round trip, and the last hop's way back) do
    not explain, spread over the route's blocks."""
    links = sum(rtts.get(h.peer, DEFAULT_RTT) / 2 for h in route)
    links += rtts.get(route[-1].peer, DEFAULT_RTT) / 2
    return max(0.0, seconds - links) / sum(h.end - h.start for h in route)


def handoff_seconds(r: NodeRecord, cache_bytes: int) -> float:
    """Seconds until a cache of `cache_bytes` leaves prefill node `r` for its decode node."""
    bandwidth = r.link.get("bandwidth_Bps") or HANDOFF_BANDWIDTH
    return cache_bytes * (1 + r.transfers) / bandwidth


def session_nodes(records: list[NodeRecord], num_layers: int, max_length: int) -> list[NodeRecord]:
    """The records a route for a session of `max_length` tokens draws from: the first of these
    that covers every block: those holding it in their free cache (`NodeRecord.holds`); those
    and the nodes able to take it by borrowing KV blocks (`NodeRecord.borrows_for`), a route
    mixing both; those whose --max-session-tokens allows it (`NodeRecord.allows`: a full node
    says so in its record, but may have room by now); else all (a node refusing it names its
    limit: `CacheFull`)."""
    holds = [r for r in records if r.holds(max_length)]
    takes = [r for r in records if r.holds(max_length) or r.borrows_for(max_length)]
    allows = [r for r in records if r.allows(max_length)]
    for tier in (holds, takes, allows):
        if not missing_blocks(tier, num_layers):
            return tier
    return records


def decode_nodes(records: list[NodeRecord], num_layers: int) -> list[NodeRecord]:
    """The records routes decode on: all but prefill nodes, unless only those cover a block."""
    others = [r for r in records if r.role != PREFILL]
    return records if missing_blocks(others, num_layers) else others


def pick_prefill(
    records: Iterable[NodeRecord],
    hop: Hop,
    cache_bytes: int,
    max_length: int,
    est: Estimates | None = None,
    max_seconds: float = MAX_HANDOFF_S,
) -> NodeRecord | None:
    """A prefill node for `hop` (usable records only): serving its blocks, with room for the
    session, its cache of `cache_bytes` handed on within `max_seconds`; the least loaded."""
    est = est or Estimates()
    fits = [
        r
        for r in records
        if r.role == PREFILL
        and r.peer != hop.peer
        and r.start <= hop.start < hop.end <= r.end
        and r.free_cache_tokens >= max_length
        and handoff_seconds(r, cache_bytes) <= max_seconds
    ]
    if not fits:
        return None
    return min(fits, key=lambda r: (est.sessions(r), handoff_seconds(r, cache_bytes), r.peer))


def find_route(
    records: Iterable[NodeRecord],
    num_layers: int,
    fingerprint: str,
    est: Estimates | None = None,
    exclude: set[str] = frozenset(),
    model: str = "the model",
    plaintext: bool = False,
    rng: random.Random | None = None,
    near: float = NEAR_BEST,
    near_s: float = NEAR_BEST_S,
    span_ok: Callable[[int, int], bool] | None = None,
) -> list[Hop]:
    """A chain of hops over block boundaries 0..num_layers costing at most `near` more than
    the cheapest; a hop may use part of a node's span (where `span_ok(start, end)`: Gemma 4's
    KV-sharing layers go with the layers they read). Each hop is drawn among the nodes that
    keep the route within that bound: of those serving the fewest sessions, one at random."""
    est = est or Estimates()
    nodes = usable(records, fingerprint, exclude, plaintext)
    gaps = missing_blocks(nodes, num_layers)
    if gaps:
        raise RouteUnavailable(f"no online node serves blocks {format_blocks(gaps)} of {model}")
    hops = _Hops(nodes, num_layers, est, span_ok)
    togo = hops.cost_to_go()
    budget = togo[0] + max(togo[0] * near, near_s) + 1e-12
    rng = rng or random
    route: list[Hop] = []
    pos, spent = 0, 0.0
    while pos < num_layers:
        # per node: its cheapest way on from here, if the route stays within the budget
        best: dict[str, tuple[float, float, int, NodeRecord]] = {}
        for r, stop, cost in hops.from_(pos):
            total = cost + togo[stop]
            if spent + total <= budget and total < best.get(r.peer, (float("inf"),))[0]:
                best[r.peer] = (total, cost, stop, r)
        # a node already on the route would be opened twice for one session: only if no other
        # node goes on from here (then its hops merge below)
        fresh = {p: o for p, o in best.items() if p not in {h.peer for h in route}}
        options = list((fresh or best).values())
        fewest = min(est.sessions(o[3]) for o in options)
        _, cost, stop, r = rng.choice([o for o in options if est.sessions(o[3]) == fewest])
        if route and route[-1].peer == r.peer:
            route[-1] = r.hop(route[-1].start, stop)
        else:
            route.append(r.hop(pos, stop))
        spent, pos = spent + cost, stop
    return route


class _Hops:
    """The hops a route may take: from a block boundary, on a node covering it, to a later
    boundary inside its span. Only boundaries where some span starts or ends matter (a hop's
    cost is linear in its blocks, so the best place to change nodes is at one of them)."""

    def __init__(self, nodes: list[NodeRecord], num_layers: int, est: Estimates, span_ok=None):
        self.num_layers = num_layers
        self.span_ok = span_ok or (lambda start, end: True)
        marks = {0, num_layers}
        for r in nodes:
            marks.update((r.start, r.end))
        self.marks = sorted(marks)
        self.nodes = [(r, est.link(r), est.block_cost(r)) for r in nodes]

    def from_(self, pos: int):
        for r, link, block in self.nodes:
            if r.start <= pos < r.end:
                for stop in self.marks:
                    if pos < stop <= r.end and self.span_ok(pos, stop):
                        yield r, stop, link + (stop - pos) * block

    def cost_to_go(self) -> dict[int, float]:
        """The cheapest cost from each boundary to the last one."""
        togo = {self.num_layers: 0.0}
        for pos in reversed(self.marks[:-1]):
            togo[pos] = min(
                (cost + togo[stop] for _, stop, cost in self.from_(pos) if stop in togo),
                default=float("inf"),
            )
        return togo
