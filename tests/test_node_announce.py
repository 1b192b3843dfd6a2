"""A node's announcements reach the DHT: the request that carries them stays small enough for the
DHT process's request pipe (over 16 KiB, a request could kill that process, and a node serving
all 30 blocks of the default model then never became visible)."""

from __future__ import annotations

import pickle
import time

import pytest

from devtools.launch import start_node, stop_all
from swarm.dht import MAX_REQUEST_BYTES, owner_subkey, read_nodes, start_dht, store_request
from swarm.link.options import LinkOptions
from swarm.node.uplink import Uplink
from swarm.records import NodeRecord


async def _ignore(stream, exc) -> None:
    pass


def full_record(start: int, end: int) -> NodeRecord:
    return NodeRecord(
        peer="12D3KooW" + "x" * 44,
        addr="127.0.0.1:40000",
        model="SmolLM2-135M-Instruct",
        start=start,
        end=end,
        state="online",
        fingerprint="f" * 16,
        version="0.1.0",
        num_layers=30,
        free_cache_tokens=32768,
        throughput=55.5,
        link=Uplink(LinkOptions(), _ignore).stats(),  # every figure a record carries
        updated=1.7e9,
    )


@pytest.fixture(scope="module")
def bootstrap():
    dht = start_dht()
    yield dht
    dht.shutdown()


def test_announcing_all_30_blocks_with_the_link_figures_is_a_small_request(bootstrap):
    request = store_request([full_record(0, 30)], 1.7e9, owner_subkey(bootstrap))
    assert len(request.keywords["groups"][0][0]) == 30
    assert len(pickle.dumps(request)) < MAX_REQUEST_BYTES / 2


@pytest.mark.slow
def test_a_lone_node_serving_the_whole_default_model_is_announced_every_time(bootstrap):
    from swarm.model.source import open_model

    cfg = open_model(None).config
    peers = [str(m) for m in bootstrap.get_visible_maddrs()]
    for attempt in range(3):
        node = start_node((0, 30), peers, extra=["--announce-ttl", "30"])
        try:
            node.wait_serving(300)
            deadline = time.monotonic() + 20
            state = None
            while time.monotonic() < deadline and state != "online":
                records, _, _ = read_nodes(bootstrap, cfg.name, cfg.num_layers)
                state = {r.peer: r.state for r in records}.get(node.peer)
                time.sleep(0.5)
            assert state == "online", f"start {attempt}: not announced online within 20 s"
        finally:
            stop_all([node])
