"""A route whose blocks nobody serves yet, but a node announcing itself joining will, waits for
it (up to swarm.client.client.JOIN_WAIT_S) and says so, rather than fail at once: in churn, a
replacement is often on its way."""

from __future__ import annotations

import logging
import time

import pytest

from devtools.launch import stop_all
from swarm.client.client import Client
from swarm.records import JOINING
from tests.helpers.flags import exact_flags
from tests.helpers.liars import honest_and_liar

FLAGS = exact_flags(threads=1)


@pytest.mark.slow
def test_a_route_waits_for_a_joining_node_to_serve_the_missing_blocks(tiny_model_dir, caplog):
    model = str(tiny_model_dir)
    nodes = honest_and_liar(model, [(0, 3)], (3, 6), FLAGS, wait_for_liar=False, SLOW_LOAD_S=10)
    peers = nodes[0].maddrs[:1]
    try:
        client = Client(peers, model=model, wire_dtype="float32")
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                states = {r.peer: r.state for r in client.nodes()}
                if len(states) == 2:
                    break
                time.sleep(0.2)
            assert JOINING in states.values()  # blocks 3:6 are on their way, not served yet
            with caplog.at_level(logging.WARNING, logger="swarm.client"):
                route = client.route()
            assert [(h.start, h.end) for h in route] == [(0, 3), (3, 6)]
            assert "waiting up to 60 s for 1 joining" in caplog.text
        finally:
            client.close()
    finally:
        stop_all(nodes)
