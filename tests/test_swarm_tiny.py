"""A tiny random Llama split across real node processes on a real DHT: fast end-to-end checks."""

from __future__ import annotations

from tests.conftest import reference_greedy, swarm_greedy


def test_client_finds_every_node_on_the_dht(tiny_client, tiny_swarm):
    found = {r.peer: (r.start, r.end, r.state) for r in tiny_client.nodes()}
    assert found == {n.peer: (*n.layers, "online") for n in tiny_swarm}


def test_route_covers_all_blocks_using_sub_ranges_of_overlapping_spans(tiny_client):
    route = tiny_client.route()
    assert route[0].start == 0 and route[-1].end == 6
    assert all(a.end == b.start for a, b in zip(route, route[1:]))


def test_greedy_tokens_match_the_unsplit_model(tiny_client, tiny_reference):
    ids = [5, 17, 300, 42, 7, 99, 123, 64]
    expected = reference_greedy(tiny_reference, ids, 24)
    assert swarm_greedy(tiny_client, ids, 24) == expected


def test_a_long_prompt_matches_the_unsplit_model(tiny_client, tiny_reference):
    ids = [(i * 37 + 11) % 500 + 3 for i in range(200)]
    assert swarm_greedy(tiny_client, ids, 8) == reference_greedy(tiny_reference, ids, 8)
