"""Sessions spread over replicas by load: a client counts the sessions it opened at each node,
and the sessions other clients hold there as the nodes' records announce them."""

from __future__ import annotations

import threading
import time
from collections import Counter
from contextlib import contextmanager

import pytest

from devtools.launch import start_swarm, stop_all
from swarm.client.client import Client
from tests.helpers.flags import exact_flags

FLAGS = exact_flags(threads=1)
PROMPT = [5, 50, 150, 250]


@pytest.fixture(scope="module")
def replicas(tiny_model_dir):
    """Three nodes serving every block; records refreshed every 2 s."""
    extra = [*FLAGS, "--announce-ttl", "6"]
    nodes = start_swarm([(0, 6)] * 3, model=str(tiny_model_dir), extra=extra)
    yield nodes
    stop_all(nodes)


def client(nodes, model_dir) -> Client:
    """A client that sees every node's record."""
    c = Client(nodes[0].maddrs[:1], model=str(model_dir), wire_dtype="float32")
    deadline = time.monotonic() + 30
    while len(c.nodes()) < len(nodes) and time.monotonic() < deadline:
        time.sleep(0.5)
    return c


@contextmanager
def held_sessions(clients: list[Client], each: int, exclude=()):
    """`each` sessions per client, opened at once from threads and held while the block runs;
    yields the peers of their first hops once all are open."""
    peers: list[str] = []
    opened = threading.Barrier(len(clients) * each + 1)
    release = threading.Event()

    def hold(c: Client) -> None:
        with c.session(len(PROMPT) + 4) as s:
            s.excluded |= set(exclude)
            s.feed(PROMPT)
            peers.append(s.remote.route[0].peer)
            opened.wait()
            release.wait()

    threads = [threading.Thread(target=hold, args=(c,)) for c in clients for _ in range(each)]
    for t in threads:
        t.start()
    try:
        opened.wait(timeout=120)
        yield peers
    finally:
        release.set()
        for t in threads:
            t.join()


def sessions_announced(c: Client, peer: str) -> int:
    return next((r.sessions for r in c.nodes() if r.peer == peer), 0)


def announced(c: Client) -> dict[str, int]:
    return {r.peer: r.sessions for r in c.nodes()}


def wait_announced(c: Client, want: dict[str, int]) -> dict[str, int]:
    deadline = time.monotonic() + 30
    while (now := announced(c)) != want and time.monotonic() < deadline:
        time.sleep(0.5)
    return now


@pytest.mark.slow
def test_concurrent_clients_spread_their_sessions_over_replicas(replicas, tiny_model_dir):
    clients = [client(replicas, tiny_model_dir) for _ in range(2)]
    try:
        with held_sessions(clients, 6) as peers:
            counts = Counter(peers)
        assert len(peers) == 12 and set(counts) == {n.peer for n in replicas}
        assert max(counts.values()) <= 5  # 1.3 times the mean of 4
    finally:
        for c in clients:
            c.close()


@pytest.mark.slow
def test_a_replica_whose_record_shows_it_busy_gets_few_new_sessions(replicas, tiny_model_dir):
    busy, *others = replicas
    first, second = client(replicas, tiny_model_dir), client(replicas, tiny_model_dir)
    idle = {n.peer: 0 for n in replicas}
    try:
        assert wait_announced(second, idle) == idle  # sessions of earlier tests are gone
        with held_sessions([first], 6, exclude={n.peer for n in others}):
            assert wait_announced(second, {**idle, busy.peer: 6})[busy.peer] == 6
            with held_sessions([second], 6) as peers:
                assert Counter(peers)[busy.peer] <= 1
    finally:
        for c in (first, second):
            c.close()
