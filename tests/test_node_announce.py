"""A node's announcements reach the DHT: the request that carries them stays small enough for the
DHT process's request pipe (over 16 KiB, a request could kill that process, and a node serving
all 30 blocks of the default model then never became visible)."""

from __future__ import annotations

import pickle
import time

import pytest

from devtools.launch import start_node, stop_all
from swarm.dht import MAX_REQUEST_BYTES, NodeKey, read_nodes, start_dht, store_request
from swarm.link.options import LinkOptions
from swarm.node.announce import Announcer
from swarm.node.status import Status
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


def announcer() -> Announcer:
    key = NodeKey.process_wide()
    return Announcer(None, key, "127.0.0.1:1", "m", 12, "f" * 16, 0, 6, ttl=30.0, tls="")


def test_a_joining_node_announces_no_sessions_no_throughput_and_the_default_weights():
    r = announcer().record("joining")
    assert (r.sessions, r.free_cache_tokens, r.throughput, r.link) == (0, 0, 0.0, {})
    assert (r.weights, r.decode_batch, r.decode_passes, r.throttled) == ("float32", 1.0, 0, 0)


def test_a_serving_node_announces_its_figures_rounded_for_the_wire():
    status = Status(
        sessions=2,
        free_cache_tokens=900,
        link={"rtt_s": 0.01},
        throttled=3,
        throughput=41.4567,
        weights="int8",
        decode_batch=1.23456,
        decode_passes=80,
    )
    r = announcer().record("online", status)
    assert (r.sessions, r.free_cache_tokens, r.link, r.throttled) == (2, 900, {"rtt_s": 0.01}, 3)
    assert (r.throughput, r.weights, r.decode_batch, r.decode_passes) == (41.46, "int8", 1.235, 80)


@pytest.fixture(scope="module")
def bootstrap():
    dht = start_dht()
    yield dht
    dht.shutdown()


def test_announcing_all_30_blocks_with_the_link_figures_is_a_small_request(bootstrap):
    request = store_request([full_record(0, 30)], 1.7e9, NodeKey.process_wide().subkey)
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
