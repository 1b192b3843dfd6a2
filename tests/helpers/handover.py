"""What the hand-over tests share: prompts without near-ties, full nodes of the tiny model, what
a node says about the sessions it handed over, sessions generating across a node's leave, and a
cache's slabs (and states) cut into chunks as the uplink cuts them."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

import torch

from devtools.launch import NodeProcess, start_node, stop_all
from swarm.client.client import Client
from swarm.protocol import STATE_PARTS, KvChunk, StateChunk
from swarm.wire import pack_tensor
from tests.helpers.flags import exact_flags

# prompts whose greedy continuations never come within 0.08 of a tie between the two likeliest
# tokens (a random tiny model has many near-ties, where float noise of 1e-5 between two runs of a
# node may pick either)
PROMPTS = [
    [271, 256, 451, 178, 376, 232, 150],
    [177, 358, 182, 307, 257, 299, 411],
    [38, 433, 50, 486, 141, 245, 359, 343, 36],
    [89, 315, 62, 255, 33, 114, 396],
]
LONG_PROMPT = [  # 48 tokens (a margin of 0.065): ~86 KB of cache to move by the time it leaves
    *(385, 369, 356, 165, 476, 144, 155, 4, 372, 389, 307, 472, 415, 327, 487, 485, 36, 15),
    *(425, 122, 57, 246, 369, 492, 241, 491, 400, 200, 407, 131, 470, 223, 420, 255, 70, 478),
    *(257, 96, 7, 413, 479, 381, 158, 424, 357, 398, 80, 313),
]
_LEFT = re.compile(r"left with (\d+) prompt passes .*here (\d+), to replicas (\d+)")


def left_with(node: NodeProcess, timeout: float = 60.0) -> tuple[int, int, int]:
    """Stop `node`; its prompt passes, sessions handed over to it and by it."""
    node.stop(signal.SIGTERM, timeout)
    for line in node.lines:
        if m := _LEFT.search(line):
            return int(m.group(1)), int(m.group(2)), int(m.group(3))
    raise AssertionError("the node did not say what it did:\n" + "\n".join(node.lines))


def wait_for_lines(node: NodeProcess, needle: str, count: int, timeout: float = 30.0) -> None:
    """Until `node` has said `needle` in `count` lines: here, sessions handed over (their
    clients, waiting, read where to only with their next step)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(needle in line for line in list(node.lines)) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"not {count} {needle!r} from the node:\n" + "\n".join(node.lines))


def start_full_node(
    model_dir, peers, *extra: str, layers=(0, 6), stderr=subprocess.DEVNULL
) -> NodeProcess:
    """A node serving `layers` (every block) of the tiny model, serving once this returns."""
    node = start_node(layers, peers, str(model_dir), [*exact_flags(ttl=10), *extra], stderr=stderr)
    try:
        node.wait_serving()
    except BaseException:
        stop_all([node])
        raise
    return node


def chunks(phase, size: int = 3) -> list[KvChunk]:
    """A phase's slabs cut into chunks of `size` positions, as the uplink cuts them."""
    out = []
    for layer, (first, keys, values) in enumerate(phase):
        for i in range(0, keys.shape[1], size):
            k, v = keys[:, i : i + size], values[:, i : i + size]
            dtype = "bfloat16" if keys.dtype == torch.bfloat16 else "float32"
            out.append(KvChunk("s", layer, first + i, pack_tensor(k, dtype), pack_tensor(v, dtype)))
    return out


def state_chunks(states, rows: int = 5) -> list[StateChunk]:
    """`state_slabs`' states cut into chunks of `rows` rows of each part, as the sender cuts
    them."""
    out = []
    for layer, *parts in states:
        for part, t in zip(STATE_PARTS, parts):
            for i in range(0, t.shape[1], rows):
                out.append(
                    StateChunk("s", layer, part, i, pack_tensor(t[:, i : i + rows], "float32"))
                )
    return out


NEW = 20
PAUSE_AT = 8  # tokens each session generates before the node leaves


@dataclass
class Finished:
    """How a session ended: its recoveries (replays), hops handed over, its route's nodes."""

    recoveries: list[float]
    moves: int
    peers: list[str]


def generate_across_a_leave(
    client: Client, prompts, leave
) -> tuple[list[list[int]], list[Finished]]:
    """Greedy tokens of one session per prompt, all at once; once each has PAUSE_AT tokens,
    `leave()` runs while they wait, then they go on."""
    out: list[list[int]] = [[] for _ in prompts]
    sessions: list = [None] * len(prompts)
    errors: list[BaseException] = []
    paused = threading.Barrier(len(prompts) + 1)
    go = threading.Event()

    def run(i: int) -> None:
        try:
            with client.session(len(prompts[i]) + NEW) as s:
                sessions[i] = s
                logits = s.feed(prompts[i])
                for k in range(NEW):
                    if k == PAUSE_AT:
                        paused.wait(60)
                        go.wait(120)
                    out[i].append(int(logits.argmax()))
                    logits = s.feed([out[i][-1]])
                peers = [h.peer for h in s.remote.route]
                sessions[i] = Finished(s.recoveries, s.remote.moves, peers)
        except BaseException as exc:
            errors.append(exc)
            paused.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    try:
        paused.wait(120)
        leave()
    finally:
        go.set()
        for t in threads:
            t.join(180)
    if errors:
        raise errors[0]
    return out, sessions


def client_of(peers, model_dir) -> Client:
    return Client(peers, model=str(model_dir), wire_dtype="float32", step_timeout=10)


def handed_over_across_a_leave(model_dir, dht_peers, prompts, grace: int) -> list[list[int]]:
    """One session per prompt on a node that gets SIGTERM mid-generation once a replica is up:
    their greedy tokens, each checked to have moved to the replica (no recovery, no prompt pass
    there) and the leaving node to have exited cleanly."""
    leaving = start_full_node(model_dir, dht_peers, "--grace", str(grace))
    client = client_of(dht_peers, model_dir)
    replica = None
    try:

        def leave() -> None:
            nonlocal replica
            replica = start_full_node(model_dir, dht_peers)
            leaving.proc.send_signal(signal.SIGTERM)
            wait_for_lines(leaving, "handed over to", len(prompts))

        out, sessions = generate_across_a_leave(client, prompts, leave)
        moved = [([], 1, [replica.peer])] * len(prompts)
        assert [(s.recoveries, s.moves, s.peers) for s in sessions] == moved
        assert leaving.proc.wait(60) == 0
        assert left_with(replica) == (0, len(prompts), 0)  # no prompt pass there: no replay
    finally:
        client.close()
        stop_all([leaving] + ([replica] if replica else []))
    return out
