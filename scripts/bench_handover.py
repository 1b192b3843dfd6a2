"""A node serving 8 sessions ~1,000 tokens deep leaves: how long does each session stall?

One run, two rounds on the default model (every block on one node, so a session's route is that
node): in each, 8 sessions open on a node, feed a prompt of --depth tokens and decode steadily;
a replica (the whole model too) starts, then the node gets SIGTERM.
  handover: the node hands each session's cache to the replica (swarm/node/handover/).
  replay:   the node runs --handover off --grace 0: its sessions' clients route anew and replay
            every token so far as a prompt on the replica (what a crash costs too).
A session's stall is the longest gap between two of its tokens from the signal on. With
--rate-mbps the replica sits behind a shaped link (devtools/link_proxy.py, both ways): the
cache crosses it in one case, the replayed prompt's activations in the other.

  .venv/bin/python scripts/bench_handover.py [--sessions 8 --depth 1000] [--rate-mbps 50]
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import statistics
import subprocess
import threading
import time

from bench.local import LocalSwarm, Shape
from bench.proc import cpu_name
from bench.stats import percentile as pct
from bench.timing import TokenTimes, greedy

from devtools.launch import NodeProcess
from swarm.client.client import Client

COMMON = ["--announce-ttl", "10", "--max-host-cache-tokens", "32768", "--max-host-sessions", "32"]
COMMON += ["--threads", "1"]
AFTER_S = 3.0  # decoding goes on this long after every session has a token past the node's exit


def start_replica(swarm: LocalSwarm, a) -> NodeProcess:
    shape = Shape(a.rate_mbps, a.rtt_ms) if a.rate_mbps else None
    return swarm.node((0, a.layers), COMMON, shape=shape, stderr=log_to(a, "replica"))


def log_to(a, name: str):
    """Where a node's log goes: --logs DIR/NAME.log, or nowhere."""
    if not a.logs:
        return subprocess.DEVNULL
    return open(os.path.join(a.logs, f"{name}-{a.round}.log"), "w")


class Stream:
    """One session decoding until told to stop; the time of each token."""

    def __init__(self, client: Client, prompt: list[int], max_length: int):
        self.client, self.prompt, self.max_length = client, prompt, max_length
        self.timed = TokenTimes(time.monotonic())
        self.primed = threading.Event()
        self.error: BaseException | None = None
        self.recoveries: list[float] = []
        self.moves = 0

    def run(self, stop: threading.Event, go: threading.Event) -> None:
        def primed(token: int) -> int:
            self.primed.set()
            go.wait()  # all start decoding together: every cache is as deep at the leave
            return token

        try:
            with self.client.session(self.max_length) as s:
                steps = self.max_length - len(self.prompt)
                greedy(s.feed, self.prompt, steps, time.monotonic, primed, stop.is_set, self.timed)
                self.recoveries = s.recoveries
                self.moves = s.remote.moves if s.remote is not None else 0
        except BaseException as exc:
            self.error = exc
            self.primed.set()

    @property
    def times(self) -> list[float]:
        """When each decoded token came (not the prompt pass's)."""
        return self.timed.times[1:]

    def stall(self, since: float) -> tuple[float, float]:
        """The longest gap between tokens from `since` on (the gap spanning it counts), and
        when it began, in seconds after `since`."""
        before = [t for t in self.times if t < since]
        after = [t for t in self.times if t >= since]
        points = before[-1:] + after
        gaps = [(b - a, a - since) for a, b in zip(points, points[1:])]
        return max(gaps) if gaps else (float("nan"), float("nan"))


def run_round(swarm: LocalSwarm, a, handover: bool) -> dict:
    grace = ["--grace", str(a.grace)] if handover else ["--handover", "off", "--grace", "0"]
    a.round = "handover" if handover else "replay"
    leaving = swarm.node((0, a.layers), [*COMMON, *grace], stderr=log_to(a, "leaving"))
    client = Client(swarm.peers, step_timeout=30)
    stop = threading.Event()
    streams = [
        Stream(client, [(7 * i + 13 * j) % 5000 + 100 for j in range(a.depth)], a.depth + 2000)
        for i in range(a.sessions)
    ]
    go = threading.Event()
    threads = [threading.Thread(target=s.run, args=(stop, go)) for s in streams]
    try:
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for s in streams:
            s.primed.wait(1800)
        errors = [s.error for s in streams if s.error]
        if errors:
            raise errors[0]
        print(f"  {a.sessions} sessions primed in {time.monotonic() - t0:.1f} s", flush=True)
        start_replica(swarm, a)
        go.set()
        time.sleep(2.0)  # a few tokens of steady decoding before the leave
        left = time.monotonic()
        leaving.proc.send_signal(signal.SIGTERM)
        leaving.proc.wait(600)  # every session handed over (or, with grace 0, cut off)
        gone = time.monotonic()
        deadline = gone + 600
        while time.monotonic() < deadline:
            if all(any(t > gone for t in s.times) for s in streams):
                break
            if any(s.error for s in streams):
                break
            time.sleep(0.05)
        time.sleep(AFTER_S)
        stop.set()
        for t in threads:
            t.join(120)
        errors = [s.error for s in streams if s.error]
        if errors:
            raise errors[0]
        leaving.proc.wait(120)
        stalls = [s.stall(left)[0] for s in streams]
        when = [s.stall(left)[1] for s in streams]
        steady = [
            statistics.median(b - x for x, b in zip(s.times, s.times[1:]) if b < left)
            for s in streams
        ]
        return {
            "stalls": stalls,
            "when": when,
            "steady": statistics.median(steady),
            "replays": sum(len(s.recoveries) for s in streams),
            "moves": sum(s.moves for s in streams),
            "said": [line for line in leaving.lines if "hand" in line],
        }
    finally:
        stop.set()
        go.set()
        client.close()
        swarm.stop_nodes()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--depth", type=int, default=1000, help="prompt tokens before the leave")
    p.add_argument("--layers", type=int, default=30, help="the model's layer count")
    p.add_argument("--rate-mbps", type=float, default=0.0, help="shape the replica's link")
    p.add_argument("--rtt-ms", type=float, default=20.0, help="its round trip, when shaped")
    p.add_argument("--logs", help="a folder for the nodes' logs")
    p.add_argument("--grace", type=float, default=120.0, help="the leaving node's, to hand over")
    p.add_argument("--node-args", default="", help="more options for every node")
    a = p.parse_args()
    COMMON.extend(shlex.split(a.node_args))
    link = f"{a.rate_mbps:g} Mbit/s, RTT {a.rtt_ms:g} ms" if a.rate_mbps else "loopback"
    print(f"CPU: {cpu_name()}; link to the replica: {link}", flush=True)
    results = {}
    with LocalSwarm() as swarm:
        for name, handover in (("handover", True), ("replay", False)):
            print(f"round {name}:", flush=True)
            results[name] = r = run_round(swarm, a, handover)
            for line in r["said"]:
                print(f"  node: {line}")
            print(
                "  stalls (s, began s after the signal): "
                + ", ".join(f"{x:.2f} at {w:.1f}" for x, w in sorted(zip(r["stalls"], r["when"])))
            )
            print(
                f"  stall p50 {pct(r['stalls'], 0.5):.3f} s, p99 {pct(r['stalls'], 0.99):.3f} s"
                f" (steady step {r['steady'] * 1000:.0f} ms; {r['moves']} handed over,"
                f" {r['replays']} replayed)",
                flush=True,
            )
    h, r = results["handover"]["stalls"], results["replay"]["stalls"]
    ratio = pct(h, 0.99) / pct(r, 0.99)
    print(
        f"{a.sessions} sessions, {a.depth} tokens deep, {link}: stall p50/p99 handover"
        f" {pct(h, 0.5):.3f}/{pct(h, 0.99):.3f} s, replay {pct(r, 0.5):.3f}/{pct(r, 0.99):.3f} s;"
        f" handover p99 = {ratio:.2f}x replay's (goal <= 0.3x)"
    )


if __name__ == "__main__":
    main()
