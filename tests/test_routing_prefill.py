"""Where a client computes a long prompt (swarm.client.routing): on a prefill node serving the
decode hop's blocks, when its cache can reach the decode node soon enough; routes decode on the
other nodes."""

from __future__ import annotations

from dataclasses import replace

from swarm.client.routing import (
    HANDOFF_BANDWIDTH,
    MAX_HANDOFF_S,
    Estimates,
    decode_nodes,
    find_route,
    handoff_seconds,
    pick_prefill,
)
from swarm.records import DECODE, PREFILL, NodeRecord
from tests.helpers.records import ROUTE_LAYERS as LAYERS
from tests.helpers.records import route_rec as rec

MB = 1_000_000


def prefill(peer: str, start: int = 0, end: int = LAYERS, **kw) -> NodeRecord:
    return replace(rec(peer, start, end), role=PREFILL, **kw)


def test_routes_decode_on_nodes_that_are_not_prefill_nodes():
    records = [rec("d", 0, LAYERS), prefill("p")]
    for _ in range(20):
        assert [h.peer for h in find_route(decode_nodes(records, LAYERS), LAYERS, "f")] == ["d"]


def test_a_prefill_node_decodes_blocks_nobody_else_serves():
    records = [rec("d", 0, 3), prefill("p")]
    assert {r.peer for r in decode_nodes(records, LAYERS)} == {"d", "p"}


def test_a_prefill_node_serving_the_hops_blocks_is_picked():
    hop = rec("d", 3, LAYERS).hop()
    records = [prefill("p", 0, LAYERS), rec("b", 0, LAYERS), replace(rec("x", 0, 6), role=DECODE)]
    assert pick_prefill(records, hop, 10 * MB, 128).peer == "p"


def test_a_prefill_node_not_covering_the_hop_is_not_picked():
    hop = rec("d", 2, LAYERS).hop()
    assert pick_prefill([prefill("p", 3, LAYERS)], hop, MB, 128) is None


def test_a_prefill_node_without_room_for_the_session_is_not_picked():
    hop = rec("d", 0, LAYERS).hop()
    full = prefill("p", free_cache_tokens=100)
    assert pick_prefill([full], hop, MB, 128) is None
    assert pick_prefill([full], hop, MB, 100).peer == "p"


def test_a_cache_too_slow_to_hand_on_stays_with_the_decode_node():
    hop = rec("d", 0, LAYERS).hop()
    link = {"bandwidth_Bps": 6.25 * MB}  # 50 Mbit/s
    fast_enough = int(0.9 * MAX_HANDOFF_S * link["bandwidth_Bps"])
    assert pick_prefill([prefill("p", link=link)], hop, fast_enough, 128).peer == "p"
    assert pick_prefill([prefill("p", link=link)], hop, 2 * fast_enough, 128) is None


def test_caches_a_prefill_node_is_sending_count_before_the_new_one():
    r = prefill("p", link={"bandwidth_Bps": 10 * MB})
    assert handoff_seconds(r, 20 * MB) == 2.0
    assert handoff_seconds(replace(r, transfers=2), 20 * MB) == 6.0


def test_a_prefill_node_that_measured_no_bandwidth_is_assumed_a_fast_home_link():
    assert handoff_seconds(prefill("p"), int(HANDOFF_BANDWIDTH)) == 1.0


def test_the_least_loaded_prefill_node_is_picked():
    hop = rec("d", 0, LAYERS).hop()
    records = [prefill("busy", sessions=3), prefill("idle", sessions=1)]
    assert pick_prefill(records, hop, MB, 128).peer == "idle"
    # the client's own sessions opened there since count too
    est = Estimates(load={"busy": 0, "idle": 5})
    assert pick_prefill(records, hop, MB, 128, est).peer == "busy"


def test_the_decode_node_itself_is_no_prefill_node_for_its_hop():
    p = prefill("p")
    assert pick_prefill([p], p.hop(), MB, 128) is None
