"""End to end through a shaped link: the scheduler cuts prefill into chunks, tokens stay the same.

Two tiny-model nodes; the second sits behind a shaped relay (1 Mbps, 20 ms RTT) announced as its
--public-address, so the first node's uplink is slow. A decoding session runs while a long prompt
arrives: under molink the prompt's activations cross the link in chunks between decode steps.
Both sessions' greedy tokens must equal the unsplit model's, and the first node's own figures
(read back from its DHT record) must show that chunking took place.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from devtools.launch import start_node, stop_all
from swarm.client.client import Client
from tests.conftest import reference_greedy
from tests.helpers.flags import exact_flags
from tests.helpers.relay import free_port

ROOT = Path(__file__).resolve().parents[1]
STEP_LOG_NODE = str(ROOT / "devtools" / "step_log.py")

RATE_MBPS = 1.0
DELAY_MS = 10.0


# the opt-in pacing, timed chunk floor, prompts in arrival order and gathered prompt passes must
# not change tokens either
PACED = ("--link-pacing", "--link-min-chunk-ms", "20", "--prefill-min-pass-tokens", "16")
PACED += ("--link-prefill-order", "arrival")
VARIANTS = {"molink": (), "fifo": (), "paced": PACED}


@pytest.fixture(params=list(VARIANTS))
def shaped_swarm(request, tiny_model_dir, tmp_path):
    policy = request.param
    port, public = free_port(), free_port()
    relay = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "devtools.link_proxy",
            "--listen",
            f"127.0.0.1:{public}",
            "--target",
            f"127.0.0.1:{port}",
            "--rate-mbps",
            str(RATE_MBPS),
            "--delay-ms",
            str(DELAY_MS),
            "--buffer-kb",
            "16",
        ],
        cwd=ROOT,  # devtools/ is not installed: the relay runs from this checkout
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    common = exact_flags(ttl=3)
    common += ["--link-policy", "fifo" if policy == "fifo" else "molink", *VARIANTS[policy]]
    nodes = [start_node((0, 3), model=str(tiny_model_dir), extra=common)]
    try:
        nodes[0].wait_serving()
        nodes.append(
            start_node(
                (3, 6),
                nodes[0].maddrs[:1],
                model=str(tiny_model_dir),
                extra=[
                    *common,
                    *("--port", str(port), "--public-address", f"127.0.0.1:{public}"),
                    *("--step-log", str(tmp_path / "steps.log")),
                ],
                program=(STEP_LOG_NODE,),
            )
        )
        nodes[1].wait_serving()
        yield policy, nodes, public, tmp_path / "steps.log"
    finally:
        stop_all(nodes)
        relay.kill()
        relay.wait()


def greedy(client: Client, ids: list[int], new_tokens: int, started=None) -> list[int]:
    out = []
    with client.session(len(ids) + new_tokens) as s:
        logits = s.feed(ids)
        for _ in range(new_tokens):
            out.append(int(logits.argmax()))
            if started is not None and len(out) == 10:
                started.set()
            logits = s.feed([out[-1]])
    return out


def test_tokens_through_a_slow_link_match_the_unsplit_model(
    shaped_swarm, tiny_model_dir, tiny_reference
):
    policy, nodes, public, step_log = shaped_swarm
    client = Client(nodes[0].maddrs[:1], model=str(tiny_model_dir), wire_dtype="float32")
    try:
        assert client.route()[-1].port == public  # the second hop goes through the relay
        short = [5, 17, 300, 42, 7, 99, 123, 64]
        long = [(i * 37 + 11) % 500 + 3 for i in range(400)]  # 100 KiB of float32: ~0.8 s here
        results: dict[str, list[int]] = {}
        decoding = threading.Event()
        # a first prompt, alone: it crosses whole, in large frames, so node 0 has measured its
        # link before the one that counts (chunk floor, cap and pacing all need an estimate)
        assert greedy(client, long, 1) == reference_greedy(tiny_reference, long, 1)

        def steady():
            results["steady"] = greedy(client, short, 120, decoding)

        t = threading.Thread(target=steady)
        t.start()
        assert decoding.wait(60), "the decoding session never got going"
        results["long"] = greedy(client, long, 8)
        t.join(120)
        assert results["steady"] == reference_greedy(tiny_reference, short, 120)
        assert results["long"] == reference_greedy(tiny_reference, long, 8)

        time.sleep(1.5)  # the next announcement carries the link figures
        link = {r.peer: r.link for r in client.nodes()}[nodes[0].peer]
    finally:
        client.close()
    shown = ("chunks_sent", "chunk_tokens_mean", "prefill_held", "bandwidth_Bps", "rtt_s")
    print(policy, {k: round(link.get(k, 0.0), 4) for k in shown})  # with -s: the figures
    assert link["bytes_sent_prefill"] >= len(long) * 64 * 4, link
    if policy == "fifo":
        assert link["chunks_sent"] == 0, link
    else:
        # the prompt went in several chunks, each fewer tokens than a client step carries
        assert link["chunks_sent"] >= 3, link
        assert 0 < link["chunk_tokens_mean"] < 256, link
    if policy == "paced":
        assert link["prefill_paced"] > 0, link
    assert link["bandwidth_Bps"] == pytest.approx(RATE_MBPS * 1e6 / 8, rel=0.25), link

    # the node behind the link logged its decode steps, and each piece of the long prompt as it
    # came in and each prompt pass, ending with the prompt's last token
    lines = [line.split() for line in step_log.read_text().splitlines()]
    steps = [[float(x) for x in parts] for parts in lines if parts[0] not in ("a", "p")]
    assert len(steps) >= 100  # the steady session's decode steps
    # each with its compute's seconds on a CPU and waiting for one, within the compute's time
    for _, _, compute, cpu, runqueue in steps:
        assert cpu >= 0 and runqueue >= 0 and cpu + runqueue <= compute + 0.002
    assert sum(step[3] for step in steps) > 0
    sid = [parts for parts in lines if parts[0] == "a" and parts[5] == str(len(long))][-1][1]
    pieces = [parts for parts in lines if parts[0] == "a" and parts[1] == sid]
    assert [int(p[3]) for p in pieces] == list(
        itertools.accumulate((int(p[4]) for p in pieces[:-1]), initial=0)
    )
    assert sum(int(p[4]) for p in pieces) == len(long)
    passes = [parts for parts in lines if parts[0] == "p" and parts[1] == sid]
    assert int(passes[-1][3]) + int(passes[-1][4]) == len(long)
    assert float(passes[-1][2]) >= float(pieces[-1][2])
    if policy != "fifo":
        assert len(pieces) >= 3  # it crossed in chunks
