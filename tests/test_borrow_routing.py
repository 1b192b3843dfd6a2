"""Routes for sessions longer than a node's cache (issue #52): a record says how long a session
its node could take by borrowing KV blocks, and a route prefers nodes that hold the session,
then nodes that could borrow it, then any. Pure functions of records; the swarm's own test is
tests/test_distkv.py."""

from __future__ import annotations

import math

import pytest

from swarm.client.routing import session_nodes
from swarm.records import MAX_TOKENS, NodeRecord
from tests.helpers.records import ROUTE_LAYERS as LAYERS
from tests.helpers.records import route_rec

LONG = 9000  # tokens: more than any of these nodes' free cache (4096)


def rec(peer: str, start: int, end: int, **fields) -> NodeRecord:
    base = route_rec(peer, start, end)
    return NodeRecord.from_wire({**base.to_wire(), **fields})


def borrower(peer: str, start: int, end: int, borrow_tokens: int = 20000) -> NodeRecord:
    return rec(peer, start, end, cache_tokens=8192, borrow_tokens=borrow_tokens)


def test_a_record_from_before_borrowing_was_announced_says_it_borrows_nothing():
    old = route_rec("a", 0, 6).to_wire()
    for name in ("lend_free_mb", "cache_tokens", "borrow_tokens", "session_tokens"):
        del old[name]
    r = NodeRecord.from_wire(old)
    assert (r.lend_free_mb, r.cache_tokens, r.borrow_tokens, r.session_tokens) == (0.0, 0, 0, 0)
    assert not r.borrows_for(LONG)
    assert r.holds(4096) and r.allows(LONG)  # as its free cache says; its limit unsaid


def test_a_record_says_which_session_lengths_its_node_takes_by_borrowing():
    r = rec("a", 0, 6, lend_free_mb=12.5, cache_tokens=8192, borrow_tokens=20000)
    assert r.lend_free_mb == 12.5
    assert [r.borrows_for(n) for n in (8192, 8193, 20000, 20001)] == [False, True, True, False]


@pytest.mark.parametrize(
    "fields",
    [
        {"lend_free_mb": -1.0},
        {"lend_free_mb": math.nan},
        {"lend_free_mb": math.inf},
        {"lend_free_mb": True},
        {"cache_tokens": -1},
        {"cache_tokens": 2.0},
        {"borrow_tokens": MAX_TOKENS + 1},
        {"borrow_tokens": "9000"},
        {"session_tokens": -1},
        {"session_tokens": MAX_TOKENS + 1},
        {"session_tokens": 1.5},
        {"cache_tokens": 8192, "borrow_tokens": 8192},  # a node borrows only past its cache
    ],
)
def test_a_record_with_a_borrowing_figure_out_of_bounds_is_refused(fields):
    with pytest.raises(ValueError, match="record"):
        rec("a", 0, 6, **fields)


def test_a_long_session_goes_to_nodes_holding_it_before_those_that_would_borrow():
    holds = rec("h", 0, 6, free_cache_tokens=LONG)
    records = [holds, borrower("b", 0, 6), rec("n", 0, 6)]
    assert session_nodes(records, LAYERS, LONG) == [holds]


def test_a_long_session_nobody_holds_goes_to_nodes_that_could_borrow_it():
    takes = borrower("b", 0, 6)
    records = [rec("n", 0, 6), borrower("short", 0, 6, borrow_tokens=LONG - 1), takes]
    assert session_nodes(records, LAYERS, LONG) == [takes]


def test_a_route_may_mix_nodes_holding_a_long_session_and_nodes_borrowing_for_it():
    holds, takes = rec("h", 0, 3, free_cache_tokens=LONG), borrower("b", 3, 6)
    records = [holds, rec("n", 3, 6), takes]
    assert session_nodes(records, LAYERS, LONG) == [holds, takes]


def test_a_session_goes_to_nodes_whose_session_limit_allows_it_though_others_have_the_cache():
    """Free cache is not enough: a node allowing 2048 tokens a session refuses one of 3000."""
    capped, allows = rec("capped", 0, 6, session_tokens=2048), rec("allows", 0, 6)
    assert session_nodes([capped, allows], LAYERS, 3000) == [allows]


def test_a_session_longer_than_one_session_may_keep_goes_to_a_node_that_could_borrow_it():
    """Past one address's share (here 2048 of a cache of 4096 free) a node borrows: it holds
    the session only if it could borrow it."""
    share_only = rec("share", 0, 6, cache_tokens=2048)
    takes = rec("b", 0, 6, cache_tokens=2048, borrow_tokens=20000)
    assert session_nodes([share_only, takes], LAYERS, 3000) == [takes]


def test_a_session_no_node_holds_or_borrows_goes_to_those_allowing_it_before_any():
    allows = rec("allows", 0, 6, free_cache_tokens=0)
    records = [rec("capped", 0, 6, free_cache_tokens=0, session_tokens=2048), allows]
    assert session_nodes(records, LAYERS, 3000) == [allows]


def test_a_long_session_that_no_route_can_take_may_go_anywhere():
    """A record is seconds old: a node may have room by now, or refuses and is left out."""
    records = [borrower("b", 0, 3), rec("n", 3, 6)]
    assert session_nodes(records, LAYERS, LONG) == records
