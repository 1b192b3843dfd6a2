"""Start and stop node processes on this machine: the local swarm script, benchmarks and tests."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from swarm.process import PARENT_ENV

NODE_LOGS_ENV = "SWARM_NODE_LOGS"
_MADDR = re.compile(r"--initial-peers (/\S+)")
_SERVING = re.compile(
    r"serving blocks (\d+):(\d+) on (\S+) \(peer (\S+)\)(?:, TLS key (\w+))?(?:, relayed by (\S+))?"
)


@dataclass
class NodeProcess:
    proc: subprocess.Popen
    layers: tuple[int, int] | None  # None: the node chooses (known once it serves)
    lines: list[str] = field(default_factory=list)
    maddrs: list[str] = field(default_factory=list)
    addr: str = ""
    peer: str = ""
    tls: str = ""  # the key id it proves ("": --plaintext)
    relay: str = ""  # the peer id of its relay, if nobody can dial it (then addr is the relay's)
    _queue: queue.Queue = field(default_factory=queue.Queue)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._queue.put(line)
        self._queue.put(None)

    @property
    def host_port(self) -> tuple[str, int]:
        """Where a plain TCP connection reaches it (its `addr` as a pair)."""
        host, _, port = self.addr.rpartition(":")
        return host, int(port)

    def wait_serving(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(
                    f"node {self.layers} exited with {self.proc.wait()}:\n" + "\n".join(self.lines)
                )
            if m := _MADDR.search(line):
                self.maddrs.append(m.group(1))
            if m := _SERVING.search(line):
                self.layers = (int(m.group(1)), int(m.group(2)))
                self.addr, self.peer, self.tls = m.group(3), m.group(4), m.group(5) or ""
                self.relay = m.group(6) or ""
                return
        raise TimeoutError(
            f"node {self.layers} not serving after {timeout} s:\n" + "\n".join(self.lines)
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        code = self.proc.wait()
        self.reap_group()
        return code

    def reap_group(self) -> None:
        """Kill what the node left in its process group: a node that died abruptly leaves its
        hivemind DHT process and p2pd daemon behind (~200 MiB each)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def hop(self, start: int | None = None, end: int | None = None):
        """The route hop that reaches this node for blocks start:end (default: its span)."""
        from swarm.address import parse_host_port
        from swarm.protocol import Hop

        host, port = parse_host_port(self.addr)
        start = self.layers[0] if start is None else start
        end = self.layers[1] if end is None else end
        return Hop(host, port, start, end, self.peer, self.tls, self.relay)

    @property
    def pid(self) -> int:
        return self.proc.pid


def start_node(
    layers: tuple[int, int] | None,
    initial_peers: Sequence[str] = (),
    model: str | None = None,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    stderr=subprocess.DEVNULL,
    program: Sequence[str] = ("-m", "swarm.node"),
    prefix: Sequence[str] = (),
) -> NodeProcess:
    """Start `python -m swarm.node` (or `python <program>`, a script that runs a node) in a new
    process; call wait_serving() before using it. `layers` None: the node picks its own.
    `prefix`: a command that runs it (`ip netns exec NAME`, say)."""
    cmd = [*prefix, sys.executable, *program]
    if layers is not None:
        cmd += ["--layers", f"{layers[0]}:{layers[1]}"]
    if model:
        cmd += ["--model", str(model)]
    if initial_peers:
        cmd += ["--initial-peers", *initial_peers]
    cmd += list(extra)
    log = None
    if stderr is subprocess.DEVNULL and os.environ.get(NODE_LOGS_ENV):
        # a failing test's nodes can be read afterwards: SWARM_NODE_LOGS=DIR pytest ...
        os.makedirs(os.environ[NODE_LOGS_ENV], exist_ok=True)
        stderr = log = tempfile.NamedTemporaryFile(
            "w", dir=os.environ[NODE_LOGS_ENV], prefix="node-", suffix=".log", delete=False
        )
    proc = subprocess.Popen(
        cmd,
        # its own process group, so stop() can reap its helpers; but not its own session: with
        # the kernel's autogroups each session gets an equal share of the CPU whatever the nice
        # values inside it, and a node's niced prompt passes must yield to other nodes' decode
        process_group=0,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        # the node watches this process and stops when it exits (swarm.process.watch_parent)
        env={**os.environ, "PYTHONUNBUFFERED": "1", PARENT_ENV: str(os.getpid()), **(env or {})},
    )
    if log is not None:
        log.close()  # the child holds its own copy
    node = NodeProcess(proc, layers)
    threading.Thread(target=node._pump, daemon=True).start()
    return node


def start_swarm(
    spans: Sequence[tuple[int, int]],
    model: str | None = None,
    extra: Sequence[str] = (),
    stderr=subprocess.DEVNULL,
) -> list[NodeProcess]:
    """The first node starts a new DHT; the others join it. Returns once all serve."""
    nodes = [start_node(spans[0], model=model, extra=extra, stderr=stderr)]
    try:
        nodes[0].wait_serving()
        peers = nodes[0].maddrs[:1]
        for span in spans[1:]:
            nodes.append(start_node(span, peers, model=model, extra=extra, stderr=stderr))
        for n in nodes[1:]:
            n.wait_serving()
    except BaseException:
        stop_all(nodes)
        raise
    return nodes


def stop_all(nodes: Sequence[NodeProcess], sig: int = signal.SIGTERM) -> None:
    for n in nodes:
        if n.proc.poll() is None:
            n.proc.send_signal(sig)
    for n in nodes:
        n.stop(sig)


def even_spans(num_layers: int, parts: int) -> list[tuple[int, int]]:
    bounds = [round(i * num_layers / parts) for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))
