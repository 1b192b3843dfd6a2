"""A long prompt's pass spread over two replicas of a span (issue #52): the session's node
computes the pass's first rows, a replica serving the same blocks the rest, over the keys and
values streamed between them; the tokens are an unsplit run's, whatever the replica does.
Real DHT, node processes, TLS."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import trio

from devtools.launch import start_node, start_swarm, stop_all
from swarm.client.client import Client
from swarm.protocol import Error
from swarm.spreading import SpreadKv, SpreadOpen, SpreadRows
from swarm.transport import connect
from swarm.wire import pack_tensor
from tests.conftest import reference_greedy
from tests.helpers.flags import exact_flags
from tests.helpers.relay import free_port, shaped_relay

PROMPT = [(7 * i + 3) % 500 + 5 for i in range(120)]
NEW = 8
SPREAD = ["--spread-prompt-tokens", "32"]  # the 120-token prompt spreads
FLAGS = [*exact_flags(ttl=20), *SPREAD]


def _client(node, path) -> Client:
    return Client(node.maddrs[:1], model=str(path), wire_dtype="float32")


def _greedy(client: Client, prompt: list[int], new: int) -> tuple[list[int], list]:
    out = []
    with client.session(len(prompt) + new) as s:
        logits = s.feed(prompt)
        for _ in range(new):
            out.append(int(logits.argmax()))
            logits = s.feed([out[-1]])
        return out, s.recoveries


@pytest.fixture(scope="module")
def replicas(tiny_model_dir, tmp_path_factory):
    """Two nodes serving every block: whichever a session opens on spreads to the other."""
    log_path = tmp_path_factory.mktemp("spread") / "nodes.stderr"
    with open(log_path, "w") as log:
        nodes = start_swarm([(0, 6), (0, 6)], model=str(tiny_model_dir), extra=FLAGS, stderr=log)
    yield nodes, log_path
    stop_all(nodes)


def test_a_prompt_spread_over_two_replicas_gives_the_unsplit_tokens(
    replicas, tiny_model_dir, tiny_reference
):
    nodes, log_path = replicas
    client = _client(nodes[0], tiny_model_dir)
    try:
        out, recoveries = _greedy(client, PROMPT, NEW)
    finally:
        client.close()
    assert out == reference_greedy(tiny_reference, PROMPT, NEW)
    log = log_path.read_text()
    assert "spread, rows from" in log and "computing its" not in log  # the replica computed
    assert not recoveries


@pytest.fixture
def slow_replica(tiny_model_dir, tmp_path):
    """A node, and (started by the test) a replica behind a 1 Mbit/s relay: its part of a pass
    takes seconds to cross, time to kill it mid-pass."""
    port = free_port()
    log_path = tmp_path / "owner.stderr"
    with shaped_relay(port, rate_mbps=1, delay_ms=5) as public, open(log_path, "w") as log:
        nodes = [start_node((0, 6), model=str(tiny_model_dir), extra=FLAGS, stderr=log)]
        extra = [*FLAGS, "--port", str(port), "--public-address", f"127.0.0.1:{public}"]

        def start_replica():
            nodes.append(
                start_node((0, 6), nodes[0].maddrs[:1], model=str(tiny_model_dir), extra=extra)
            )
            nodes[-1].wait_serving()
            return nodes[-1]

        try:
            nodes[0].wait_serving()
            yield nodes[0], start_replica, log_path
        finally:
            stop_all(nodes)


def test_a_replica_killed_mid_pass_leaves_the_owner_to_finish_with_the_same_tokens(
    slow_replica, tiny_model_dir, tiny_reference
):
    owner, start_replica, log_path = slow_replica
    prompt = [(11 * i + 5) % 500 + 3 for i in range(480)]  # the model holds 512
    client = _client(owner, tiny_model_dir)
    try:
        with client.session(len(prompt) + NEW) as s:  # opened on the owner: the only node yet
            replica = start_replica()
            while replica.peer not in {r.peer for r in client.nodes()}:
                time.sleep(0.5)
            time.sleep(2.5)  # the owner's directory reads the DHT again
            killer = threading.Thread(target=_kill_once_spread, args=(replica, log_path))
            killer.start()
            logits = s.feed(prompt)
            out = []
            for _ in range(NEW):
                out.append(int(logits.argmax()))
                logits = s.feed([out[-1]])
            killer.join()
            recoveries = s.recoveries
    finally:
        client.close()
    assert out == reference_greedy(tiny_reference, prompt, NEW)
    log = log_path.read_text()
    assert "spread, rows from" in log and "computing its" in log  # the owner took the rest
    assert not recoveries  # the client saw nothing of it


def _kill_once_spread(replica, log_path: Path) -> None:
    """Kill `replica` once the owner has spread a pass to it (its rows cross for seconds)."""
    deadline = time.monotonic() + 60
    while "spread, rows from" not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    replica.proc.kill()


async def _ask(node, *frames):
    """Send `frames` to `node` on a fresh connection: its answer to the last one."""
    conn = await connect(*node.host_port, tls=node.tls)
    try:
        with trio.fail_after(30):
            for f in frames:
                await conn.send(f)
            replies = []
            for _ in frames:
                replies.append(await conn.receive())
                if isinstance(replies[-1], Error):
                    return replies[-1]
            return replies[-1]
    finally:
        await conn.aclose()


def test_a_forged_spread_frame_gets_a_typed_error_and_the_node_serves_on(
    replicas, tiny_model_dir, tiny_reference, fingerprint
):
    node = replicas[0][0]
    kv = pack_tensor(torch.zeros(1, 4, 32), "float32")
    forged = trio.run(_ask, node, SpreadKv("f" * 32, 0, 0, kv, kv))  # no such spread here
    assert isinstance(forged, Error) and forged.code == "protocol"
    other = trio.run(_ask, node, SpreadOpen("g" * 32, "0" * 64, 0, 6, 64, 64))
    assert isinstance(other, Error) and other.code == "spread_refused"  # other weights
    taken = SpreadOpen("h" * 32, fingerprint, 0, 6, 64, 64)
    wrong = SpreadRows("h" * 32, 0, pack_tensor(torch.zeros(1, 4, 63), "float32"))
    malformed = trio.run(_ask, node, taken, wrong)
    assert isinstance(malformed, Error) and malformed.code == "shape_mismatch"
    client = _client(node, tiny_model_dir)
    try:
        out, _ = _greedy(client, PROMPT[:8], 4)
    finally:
        client.close()
    assert out == reference_greedy(tiny_reference, PROMPT[:8], 4)
