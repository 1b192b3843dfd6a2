"""Coverage and gaps, computed once (swarm/records.py) for placement, routing and health."""

from __future__ import annotations

from swarm.node.placement import coverage as counted_coverage
from swarm.records import block_coverage, coverage, coverage_gaps, format_blocks
from tests.helpers.records import rec

LAYERS = 6


def test_coverage_counts_the_nodes_and_sums_the_throughput_of_each_block():
    blocks = coverage([rec("a", 0, 4, tps=10), rec("b", 2, 6, tps=5)], LAYERS)
    assert [b.nodes for b in blocks] == [1, 1, 2, 2, 1, 1]
    assert [b.throughput for b in blocks] == [10, 10, 15, 15, 5, 5]


def test_a_span_past_the_last_block_is_cut():
    assert block_coverage([rec("a", 4, 9)], LAYERS) == (0, 0, 0, 0, 1, 1)


def test_gaps_are_half_open_ranges_of_blocks_nobody_serves():
    assert coverage_gaps((0, 1, 0, 0, 2, 0)) == [(0, 1), (2, 4), (5, 6)]


def test_block_ranges_read_start_colon_end():
    assert format_blocks([(0, 1), (2, 4)]) == "0:1, 2:4"


def test_placement_counts_online_and_joining_nodes_but_not_offline_ones_or_itself():
    records = [
        rec("a", 0, 2),
        rec("b", 2, 4, "joining"),
        rec("c", 4, 6, "offline"),
        rec("me", 0, 6),
    ]
    blocks = counted_coverage(records, LAYERS, exclude=frozenset({"me"}))
    assert [b.nodes for b in blocks] == [1, 1, 1, 1, 0, 0]
