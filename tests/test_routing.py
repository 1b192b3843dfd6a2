"""Route choice and probing as pure functions of records and what the client measured: which
nodes a route pings, and how routes spread over replicas."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from swarm.client.probe import RoundTrips, pick_probes
from swarm.client.routing import Estimates, find_route, hop_cost
from swarm.errors import RouteUnavailable
from swarm.records import NodeRecord
from tests.helpers.records import ROUTE_LAYERS as LAYERS
from tests.helpers.records import route_rec as rec

SPANS = [(0, 2), (2, 4), (4, 6)]


def replicas(n: int) -> list[NodeRecord]:
    return [rec(f"{s}-{e}-{i}", s, e) for s, e in SPANS for i in range(n)]


def cost(route, records, est) -> float:
    by_peer = {r.peer: r for r in records}
    return sum(hop_cost(by_peer[h.peer], h.start, h.end, est) for h in route)


def test_a_clients_own_sessions_spread_evenly_over_replicas():
    """Each drawn route's sessions count as the client's own for the next draw, as a client
    counts the sessions it holds: 24 over 4 replicas of each span give each replica 6."""
    records, rng = replicas(4), random.Random(7)
    rtts = {r.peer: rng.uniform(0.0003, 0.002) for r in records}  # loopback's, noisy
    own: Counter[str] = Counter()
    for _ in range(24):
        route = find_route(records, LAYERS, "f", Estimates(rtts, load=own), rng=rng)
        own.update(h.peer for h in route)
    assert sorted(own.values()) == [6] * 12


@pytest.mark.parametrize("seed", range(10))
def test_routes_drawn_by_clients_that_see_each_other_late_spread_over_replicas(seed):
    """Four clients of 6 sessions each see the others' sessions only once a record announces
    them (here: each client's before the next one starts): no replica holds 1.3 times its
    share of the 24."""
    records, rng = replicas(4), random.Random(seed)
    rtts = {r.peer: rng.uniform(0.0003, 0.002) for r in records}
    announced: Counter[str] = Counter()
    for _ in range(4):
        own: Counter[str] = Counter()
        for _ in range(6):
            load = announced + own
            route = find_route(records, LAYERS, "f", Estimates(rtts, load=load), rng=rng)
            own.update(h.peer for h in route)
        announced += own
    assert len(announced) == 12 and max(announced.values()) / 6 <= 1.3


def test_among_equal_replicas_a_route_is_drawn_at_random():
    records, rng = replicas(4), random.Random(1)
    firsts = Counter(find_route(records, LAYERS, "f", rng=rng)[0].peer for _ in range(400))
    assert len(firsts) == 4 and min(firsts.values()) > 60


def test_a_replica_serving_more_sessions_is_not_chosen_while_another_serves_fewer():
    records = replicas(2)
    busy = records[0].peer
    est = Estimates(load={busy: 3})
    rng = random.Random(3)
    firsts = Counter(find_route(records, LAYERS, "f", est, rng=rng)[0].peer for _ in range(50))
    assert firsts == {records[1].peer: 50}


def test_a_drawn_route_costs_at_most_near_best_more_than_the_cheapest():
    rng = random.Random(5)
    records = [
        rec(f"n{i}", s, e, sessions=rng.randrange(4), throughput=rng.uniform(50, 200))
        for i, (s, e) in enumerate(SPANS * 5 + [(0, 6), (1, 5), (3, 6)])
    ]
    est = Estimates(rtts={r.peer: rng.uniform(0.001, 0.02) for r in records})
    best = cost(find_route(records, LAYERS, "f", est, near=0.0, near_s=0.0), records, est)
    for _ in range(50):
        route = find_route(records, LAYERS, "f", est, rng=rng, near=0.1, near_s=0.0)
        assert [(h.start, h.end) for h in route][0][0] == 0 and route[-1].end == LAYERS
        assert all(a.end == b.start for a, b in zip(route, route[1:]))
        assert cost(route, records, est) <= best * 1.1 + 1e-12


def test_a_route_uses_part_of_a_span_to_chain_overlapping_ones():
    records = [rec("a", 0, 4), rec("b", 3, 6)]
    route = find_route(records, LAYERS, "f")
    assert [(h.peer, h.start, h.end) for h in route] in (
        [("a", 0, 3), ("b", 3, 6)],
        [("a", 0, 4), ("b", 4, 6)],
    )


def test_a_route_never_goes_through_one_node_twice():
    """Overlapping spans offer a hop to stop part-way on a node and go on from there on the same
    one, at one round trip more: near the cheapest, but a session opens once a node."""
    records = [rec("a", 0, 2), rec("b", 1, 5), rec("c", 4, 6)]
    est = Estimates(rtts={"a": 0.001, "b": 0.001, "c": 0.001})
    rng = random.Random(2)
    for _ in range(200):
        peers = [h.peer for h in find_route(records, LAYERS, "f", est, rng=rng)]
        assert len(peers) == len(set(peers))


def test_a_node_measured_slow_loses_to_one_whose_claim_is_modest():
    liar, honest = rec("liar", 0, 6, throughput=1e9), rec("honest", 0, 6, throughput=50.0)
    est = Estimates(measured={"liar": 0.05})
    routes = {find_route([liar, honest], LAYERS, "f", est)[0].peer for _ in range(20)}
    assert routes == {"honest"}


def test_missing_blocks_are_named():
    with pytest.raises(RouteUnavailable, match="4:6"):
        find_route([rec("a", 0, 4)], LAYERS, "f")


def by_cost(r: NodeRecord) -> float:
    return 1.0 / r.throughput


def test_probes_ask_a_few_nodes_per_block_of_hundreds():
    records = [rec(f"n{i:03d}", *SPANS[i % 3]) for i in range(200)]
    picks = pick_probes(records, LAYERS, RoundTrips(), 0.0, by_cost, per_block=3, budget=32)
    assert len(picks) == 9
    assert Counter((r.start, r.end) for r in picks) == {span: 3 for span in SPANS}


def test_probes_take_every_blocks_first_node_before_any_blocks_second():
    records = [rec(f"w{i}", 0, 6, throughput=10.0) for i in range(3)]
    records += [rec(f"n{i:03d}", *SPANS[i % 3], throughput=1e3) for i in range(60)]
    picks = pick_probes(records, LAYERS, RoundTrips(), 0.0, by_cost, per_block=3, budget=4)
    assert {(r.start, r.end) for r in picks[:3]} == set(SPANS)


def test_nodes_measured_recently_are_not_pinged_again():
    records = replicas(4)
    trips = RoundTrips(max_age=60.0)
    for r in records[::4]:  # one node of each span answered 10 s ago
        trips.answered(r.peer, 0.001, now=90.0)
    picks = pick_probes(records, LAYERS, trips, 100.0, by_cost, per_block=3)
    assert len(picks) == 6 and not {r.peer for r in picks} & {r.peer for r in records[::4]}
    assert len(pick_probes(records, LAYERS, trips, 151.0, by_cost, per_block=3)) == 9


def test_exploring_probes_pick_nodes_beyond_those_already_picked():
    records = [rec(f"n{i:03d}", *SPANS[i % 3]) for i in range(30)]
    first = pick_probes(records, LAYERS, RoundTrips(), 0.0, by_cost, per_block=3)
    more = pick_probes(records, LAYERS, RoundTrips(), 0.0, by_cost, 8, budget=3, already=first)
    assert len(more) == 3 and not {r.peer for r in more} & {r.peer for r in first}


def test_nodes_that_failed_a_ping_lately_are_skipped_unless_nothing_else_is_left():
    records = replicas(1)
    trips = RoundTrips(failed_for=10.0)
    trips.silent(records[0].peer, now=95.0)
    assert records[0] not in pick_probes(records, LAYERS, trips, 100.0, by_cost)
    assert records[0] in pick_probes(records, LAYERS, trips, 100.0, by_cost, retry_failed=True)
    assert records[0] in pick_probes(records, LAYERS, trips, 106.0, by_cost)
