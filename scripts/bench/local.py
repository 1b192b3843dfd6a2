"""A local swarm for a benchmark: its DHT, its nodes, shaped relays in front of some, all stopped
on leaving the `with` block, whatever happened in it."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from bench import ROOT
from devtools.launch import NodeProcess, start_node, stop_all
from swarm.dht import start_dht, visible_maddrs


@dataclass(frozen=True)
class Shape:
    """A shaped link (devtools/link_proxy.py, both ways) in front of a node."""

    rate_mbps: float
    rtt_ms: float
    buffer_kb: float = 256
    queue_log: str | None = None  # the relay logs its bottleneck's queue here
    # the link is not a process beside the nodes: its relay comes before their work wherever it
    # shares a core with them (without the privilege, nice warns and runs it at 0)
    nice: bool = True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_relay(
    listen: int, target: int, shape: Shape, prefix: Sequence[str] = ()
) -> subprocess.Popen:
    """`python -m devtools.link_proxy` from 127.0.0.1:`listen` to 127.0.0.1:`target`."""
    cmd = [*prefix, *(["nice", "-n", "-10"] if shape.nice else []), sys.executable]
    cmd += ["-m", "devtools.link_proxy", "--listen", f"127.0.0.1:{listen}"]
    cmd += ["--target", f"127.0.0.1:{target}", "--rate-mbps", str(shape.rate_mbps)]
    cmd += ["--delay-ms", str(shape.rtt_ms / 2), "--buffer-kb", f"{shape.buffer_kb:g}"]
    if shape.queue_log:
        cmd += ["--queue-log", shape.queue_log]
    # devtools/ is not installed: the relay runs from this checkout
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class LocalSwarm:
    """A DHT bootstrap of its own (`peers` to join it) and the nodes and relays started through
    it: `with LocalSwarm() as swarm: node = swarm.node((0, 30), shape=Shape(50, 20))`."""

    def __init__(self) -> None:
        self.nodes: list[NodeProcess] = []
        self.relays: list[subprocess.Popen] = []
        self.dht = None  # the bootstrap's hivemind DHT, to read the swarm's records
        self.peers: list[str] = []

    def __enter__(self) -> LocalSwarm:
        self.dht = start_dht()
        self.peers = visible_maddrs(self.dht)[:1]
        return self

    def __exit__(self, *exc) -> None:
        self.stop_nodes()
        self.dht.shutdown()

    def node(
        self,
        span: tuple[int, int] | None,
        extra: Sequence[str] = (),
        shape: Shape | None = None,
        prefix: Sequence[str] = (),
        wait: bool = True,
        **launch,
    ) -> NodeProcess:
        """A node joining this swarm (behind a relay of `shape`, the address it announces);
        with `wait`, once it serves. `prefix` runs both (`taskset -c 1`, say)."""
        extra = list(extra)
        if shape is not None:
            port, public = free_port(), free_port()
            self.relays.append(start_relay(public, port, shape, prefix))
            extra += ["--port", str(port), "--public-address", f"127.0.0.1:{public}"]
        node = start_node(span, self.peers, extra=extra, prefix=prefix, **launch)
        self.nodes.append(node)
        if wait:
            node.wait_serving()
        return node

    def stop_nodes(self) -> None:
        """Every node and relay started so far (a round's end); the DHT stays."""
        nodes, relays = self.nodes, self.relays
        self.nodes, self.relays = [], []
        stop_all(nodes)
        for r in relays:
            r.kill()
            r.wait()
