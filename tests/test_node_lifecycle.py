"""A node process announces itself, is found, and leaves the DHT on shutdown or death."""

from __future__ import annotations

import os
import signal
import time

import pytest

from devtools.launch import start_node, stop_all
from swarm.dht import read_nodes, start_dht, visible_maddrs
from swarm.model.source import open_model

TTL = 6.0


@pytest.fixture(scope="module")
def bootstrap():
    dht = start_dht()
    yield dht
    dht.shutdown()


def states(dht, model_dir) -> dict[str, str]:
    cfg = open_model(str(model_dir)).config
    records, _, _ = read_nodes(dht, cfg.name, cfg.num_layers)
    return {r.peer: r.state for r in records}


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"{what} not seen within {timeout} s (last: {last})")


def test_node_announces_online_and_goes_offline_on_sigterm(bootstrap, tiny_model_dir):
    peers = visible_maddrs(bootstrap)
    node = start_node(
        (0, 6), peers, model=str(tiny_model_dir), extra=["--announce-ttl", str(TTL), "--grace", "2"]
    )
    try:
        node.wait_serving()
        # its own process group (stop_all reaps its helpers) in the launcher's session: Linux
        # shares CPU between sessions equally, so a node in a session of its own would take its
        # share whatever nice value its prompt passes run at
        assert os.getpgid(node.proc.pid) == node.proc.pid != os.getpgid(0)
        assert os.getsid(node.proc.pid) == os.getsid(0)
        wait_for(lambda: states(bootstrap, tiny_model_dir).get(node.peer) == "online", 15, "online")
        node.proc.send_signal(signal.SIGTERM)
        wait_for(
            lambda: states(bootstrap, tiny_model_dir).get(node.peer) in ("offline", None),
            15,
            "offline",
        )
        assert node.proc.wait(30) == 0
        assert any("going offline" in line for line in node.lines)
    finally:
        stop_all([node])


def test_killed_nodes_record_expires(bootstrap, tiny_model_dir):
    peers = visible_maddrs(bootstrap)
    node = start_node((2, 4), peers, model=str(tiny_model_dir), extra=["--announce-ttl", str(TTL)])
    try:
        node.wait_serving()
        wait_for(lambda: states(bootstrap, tiny_model_dir).get(node.peer) == "online", 15, "online")
        node.proc.kill()
        t = time.monotonic()
        wait_for(lambda: node.peer not in states(bootstrap, tiny_model_dir), TTL + 10, "expiry")
        assert time.monotonic() - t <= TTL + 10
    finally:
        stop_all([node])


def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def command(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def test_the_dht_process_and_its_daemon_run_at_the_nice_asked_for(bootstrap, tiny_model_dir):
    peers = visible_maddrs(bootstrap)
    node = start_node((0, 2), peers, model=str(tiny_model_dir), extra=["--dht-nice", "7"])
    try:
        node.wait_serving()
        own = os.getpriority(os.PRIO_PROCESS, node.proc.pid)
        # the DHT process is the node's child that started the p2p daemon
        dht = [(c, d) for c in children(node.proc.pid) for d in children(c) if command(d) == "p2pd"]
        assert len(dht) == 1, [(c, command(c)) for c in children(node.proc.pid)]
        for pid in dht[0]:
            assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, own + 7)
        assert own == os.getpriority(os.PRIO_PROCESS, 0)  # the node itself is not niced
        wait_for(lambda: states(bootstrap, tiny_model_dir).get(node.peer) == "online", 15, "online")
    finally:
        stop_all([node])
