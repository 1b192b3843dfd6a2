"""Setting up a route costs a bounded number of connections however many nodes the DHT lists:
200 signed records of nodes at 200 loopback addresses, each of which answers pings (a forwarder
to a real node of its span counts every connection)."""

from __future__ import annotations

import pytest

from devtools.crowd import Crowd
from devtools.launch import start_swarm, stop_all
from swarm.client.client import Client
from swarm.client.probe import EXPLORE, PER_BLOCK
from tests.helpers.flags import exact_flags

FLAGS = exact_flags(threads=1)
SPANS = [(0, 2), (2, 4), (4, 6)]


@pytest.fixture(scope="module")
def crowded(tiny_model_dir):
    """Three real nodes, and 200 synthetic ones copying their spans and keys."""
    model = str(tiny_model_dir)
    nodes = start_swarm(SPANS, model=model, extra=FLAGS)
    peers = nodes[0].maddrs[:1]
    crowd = None
    try:
        reader = Client(peers, model=model, wire_dtype="float32")
        real = reader.nodes()
        reader.close()
        assert len(real) == 3
        crowd = Crowd(peers, real, 200)
        yield peers, model, crowd
    finally:
        if crowd is not None:
            crowd.close()
        stop_all(nodes)


@pytest.mark.slow
def test_a_route_among_hundreds_of_nodes_opens_a_few_connections_per_span(crowded):
    peers, model, crowd = crowded
    client = Client(peers, model=model, wire_dtype="float32")
    try:
        assert len(client.nodes()) == 203
        before = crowd.forwarders.total
        route = client.route()
        assert [h.end for h in route][-1] == 6
        opened = crowd.forwarders.total - before
        assert 0 < opened <= client.router.dials <= PER_BLOCK * len(SPANS) + EXPLORE
    finally:
        client.close()


@pytest.mark.slow
def test_later_routes_ping_a_few_more_nodes_each_at_most(crowded):
    peers, model, crowd = crowded
    client = Client(peers, model=model, wire_dtype="float32")
    try:
        client.route()
        for _ in range(3):
            before, dials = crowd.forwarders.total, client.router.dials
            client.route()
            # an exploring ping may go to one of the real nodes, which the crowd does not count
            assert crowd.forwarders.total - before <= client.router.dials - dials <= EXPLORE
    finally:
        client.close()
