"""A stopped (SIGSTOP) node on a route is blamed by the data-plane heartbeat, naming its hop,
long before the step timeout: whether it is the first, a middle or the last hop."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import trio

from devtools.launch import start_swarm, stop_all
from swarm.client.session import RemoteSession
from swarm.dht import read_nodes, start_dht
from swarm.errors import PeerFailed
from swarm.heartbeat import Heartbeat
from swarm.model.source import open_model
from swarm.model.tiny import TINY
from swarm.protocol import Hop
from tests.helpers.flags import exact_flags

STEP_TIMEOUT = 30.0  # the fallback the heartbeat must beat by far


@pytest.fixture(scope="module")
def chain(tiny_model_dir):
    nodes = start_swarm(
        [(0, 2), (2, 4), (4, 6)],
        model=str(tiny_model_dir),
        extra=exact_flags(ttl=10),
    )
    wait_online(nodes, str(tiny_model_dir))
    yield nodes
    for n in nodes:
        if n.proc.poll() is None:
            os.kill(n.pid, signal.SIGCONT)
    stop_all(nodes)


def wait_online(nodes, model: str, timeout: float = 60.0) -> None:
    """Until the DHT announces every node online: each dials only next hops announced so."""
    config = open_model(model).config
    dht = start_dht(nodes[0].maddrs[:1], client_mode=True)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            records, _, _ = read_nodes(dht, config.name, config.num_layers)
            if {r.peer for r in records if r.state == "online"} >= {n.peer for n in nodes}:
                return
            time.sleep(0.5)
        raise TimeoutError("nodes not announced online")
    finally:
        dht.shutdown()


def route_of(nodes) -> list[Hop]:
    return [n.hop() for n in nodes]


@pytest.mark.parametrize("hop", [0, 1, 2])
async def test_a_stopped_node_on_the_route_is_blamed_by_the_heartbeat(chain, tiny_model_dir, hop):
    fingerprint = open_model(str(tiny_model_dir)).fingerprint()
    hidden = TINY["hidden_size"]
    session = RemoteSession(
        route_of(chain), fingerprint, hidden, 32, "float32", step_timeout=STEP_TIMEOUT
    )
    await session.open()
    await session.step(torch.randn(1, 4, hidden))
    os.kill(chain[hop].pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        with pytest.raises(PeerFailed) as caught:
            await session.step(torch.randn(1, 1, hidden))
        blamed_after = time.monotonic() - t0
    finally:
        os.kill(chain[hop].pid, signal.SIGCONT)
        with trio.move_on_after(5):
            await session.aclose()
    exc = caught.value
    assert exc.hop == hop and exc.peer == chain[hop].peer, exc
    assert "no answer to pings" in str(exc)
    print(f"hop {hop} blamed after {blamed_after:.2f} s")
    assert blamed_after < STEP_TIMEOUT / 3


def test_a_peer_behind_a_busy_send_queue_is_not_yet_owing_an_answer():
    beat = Heartbeat(timeout=1.5)
    beat.pinged(0.0)
    beat.queued(1.0, busy=True)  # a prompt still leaving this host at 1 s
    assert not beat.hung(2.0)
    assert beat.hung(2.5)


def test_any_frame_from_the_peer_answers_its_pings():
    beat = Heartbeat(timeout=1.5)
    beat.pinged(0.0)
    beat.pinged(1.0)  # the clock runs from the first unanswered ping
    assert beat.hung(1.5)
    beat.heard()
    assert not beat.hung(10.0)
