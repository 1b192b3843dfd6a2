"""Long prompts arriving among steady decode streams: colocated nodes vs a prefill/decode pair.

Two rounds on the default model, each with two nodes serving every block at --threads 1 (the
same cores in both):
  colocated: both nodes --role both; streams and prompts spread over them, so a node computing a
             prompt delays the decode steps of the streams it serves.
  P/D:       one --role prefill, one --role decode; streams decode on the decode node, prompts
             go to the prefill node, which answers the first token and hands each session with
             its cache to the decode node (swarm/node/handover/), decoding it meanwhile; a
             session generating fewer than --handoff-min-new tokens stays there.
Each node runs on a core of its own (taskset; --no-pin: any), as on two PCs, its threads, DHT
process and p2pd with it; the clients run on any core (--client-core: one). In each round
--streams sessions decode steadily (clients of this process); every --every seconds a session
with a --prompt token prompt arrives and generates --new tokens (another user's: a client
process of their own; --one-client: this one). Figures: the steady streams' time per output
token (TPOT, the gap between two of a stream's tokens while prompts arrive), the new sessions'
time to first token (TTFT) and their TPOT. With --rate-mbps every node sits behind its own
shaped link (devtools/link_proxy.py, both ways): prompts, results and the handed-on caches
cross them.

  .venv/bin/python scripts/bench_disagg.py [--prompts 8 --every 8] [--rate-mbps 50] [--cpu-report]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shlex
import statistics
import subprocess
import threading
import time

import bench  # noqa: F401  (first: OpenMP's wait policy, a node's, before torch loads)
import torch
from bench.local import LocalSwarm, Shape
from bench.proc import cpu_name, cpu_seconds, process_tree
from bench.stats import percentile as pct
from bench.timing import TokenTimes, greedy

from swarm.client import routing
from swarm.client.client import Client
from swarm.dht import read_swarm

COMMON = ["--announce-ttl", "10", "--max-host-cache-tokens", "65536", "--max-host-sessions", "64"]
COMMON += ["--threads", "1"]
WARMUP_S = 2.0  # streams decode this long before their quiet steps count
QUIET_S = 10.0  # ... and then this long before the first prompt: the streams' TPOT alone


class Stream:
    """A session decoding until told to stop; the time of each of its tokens."""

    def __init__(self, client: Client, prompt: list[int], max_length: int, new: int = 0):
        self.client, self.prompt, self.max_length, self.new = client, prompt, max_length, new
        self.timed = TokenTimes(0.0)
        self.moves = 0
        self.replays = 0
        self.primed = threading.Event()
        self.error: BaseException | None = None

    def run(self, stop: threading.Event) -> None:
        def primed(token: int) -> int:
            self.primed.set()
            return token

        steps = self.max_length - len(self.prompt) - 1
        steps = min(steps, self.new - 1) if self.new else steps
        try:
            with self.client.session(self.max_length) as s:
                self.timed.start = time.monotonic()
                greedy(s.feed, self.prompt, steps, time.monotonic, primed, stop.is_set, self.timed)
                self.moves = s.remote.moves if s.remote is not None else 0
                self.replays = len(s.recoveries)
        except BaseException as exc:
            self.error = exc
            self.primed.set()

    def gaps(self, lo: float = 0.0, hi: float = float("inf")) -> list[float]:
        return self.timed.gaps(lo, hi)

    @property
    def ttft(self) -> float:
        return self.timed.ttft


def start(swarm: LocalSwarm, a, name: str, role: str, core: int | None) -> None:
    # a core each, as on two PCs (its DHT process and p2pd too); the client floats. The relay is
    # the node's uplink: its Python work lands on the node's own core, not on the other node's
    # (--no-pin: anywhere)
    prefix = ["taskset", "-c", str(core)] if core is not None else []
    shape = Shape(a.rate_mbps, a.rtt_ms) if a.rate_mbps else None
    log = open(os.path.join(a.logs, f"{name}.log"), "w") if a.logs else subprocess.DEVNULL
    swarm.node((0, a.layers), [*COMMON, "--role", role], shape, prefix, stderr=log)


def arrive(client: Client, a, rng: random.Random, stop: threading.Event) -> dict:
    """The --prompts new sessions, one every --every s; their figures and when they ran."""
    begin = time.monotonic()
    arrivals = []
    for k in range(a.prompts):
        prompt = [rng.randrange(100, 40000) for _ in range(a.prompt)]
        s = Stream(client, prompt, a.prompt + a.new + 1, new=a.new)
        t = threading.Thread(target=s.run, args=(stop,))
        t.start()
        arrivals.append((s, t))
        time.sleep(max(0.0, begin + (k + 1) * a.every - time.monotonic()))
    for _, t in arrivals:
        t.join(600)
    new = [s for s, _ in arrivals]
    errors = [repr(s.error) for s in new if s.error]
    return {
        "begin": begin,
        "end": time.monotonic(),
        "ttft": [s.ttft for s in new],
        "new_tpot": [g for s in new for g in s.gaps()],
        "moves": sum(s.moves for s in new),
        "replays": sum(s.replays for s in new),
        "error": errors[0] if errors else None,
    }


def arrivals_process(peers, a, ready, go, out) -> None:
    """arrive() in a process of its own: the new sessions are other users than the streams',
    whose clients would not share one Python process (its GIL, its network loop) with them."""
    if a.client_core is not None:
        torch.set_num_threads(1)
    client = Client(peers, step_timeout=60, handoff_min_new=a.handoff_min_new)
    try:
        ready.set()
        go.wait()
        out.put(arrive(client, a, random.Random(7), threading.Event()))
    finally:
        client.close()


def run_round(swarm: LocalSwarm, a, roles: tuple[str, str]) -> dict:
    peers = swarm.peers
    client = proc = None
    stop = threading.Event()
    rng = random.Random(5)
    try:
        cores = a.cores
        for i, role in enumerate(roles):
            core = cores[i % len(cores)] if a.pin else None
            start(swarm, a, f"{'-'.join(roles)}-{i}", role, core)
        nodes, relays = swarm.nodes, swarm.relays
        if a.client_core is not None:  # first call on its core, as on a machine of its own:
            os.setpriority(os.PRIO_PROCESS, 0, -5)  # the threads started from here inherit it
        if not a.one_client:
            ctx = multiprocessing.get_context("spawn")
            ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
            proc = ctx.Process(target=arrivals_process, args=(peers, a, ready, go, out))
            proc.start()
            if not ready.wait(300):
                raise RuntimeError("the new sessions' client did not start")
        client = Client(peers, step_timeout=60, handoff_min_new=a.handoff_min_new)
        streams = [
            Stream(client, [rng.randrange(100, 40000) for _ in range(32)], 32 + 4000)
            for _ in range(a.streams)
        ]
        threads = [threading.Thread(target=s.run, args=(stop,)) for s in streams]
        for t in threads:
            t.start()
        for s in streams:
            s.primed.wait(600)
        report = None
        if a.cpu_report:
            groups = {
                f"node {i} ({r})": process_tree(n.proc.pid)
                for i, (n, r) in enumerate(zip(nodes, roles))
            }
            groups |= {f"relay {i}": [r.pid] for i, r in enumerate(relays)}
            # this process's threads only: the streams' client (its DHT is a process apart)
            groups["streams' client"] = [os.getpid()]
            if proc is not None:
                groups["new sessions' client"] = process_tree(proc.pid)
            report = CpuReport(groups)
        time.sleep(WARMUP_S)
        quiet = time.monotonic()
        relay_cpu = [cpu_seconds(r.pid) for r in relays]
        if report is not None:
            report.mark()
        time.sleep(QUIET_S)
        if report is not None:
            report.mark()
        if a.one_client:
            new = arrive(client, a, rng, stop)
        else:
            go.set()
            new = out.get(timeout=1200)
        relay_cpu = [cpu_seconds(r.pid) - c for r, c in zip(relays, relay_cpu)]
        if report is not None:
            report.mark()
        batches = decode_batches(swarm.dht) if a.cpu_report else {}
        stop.set()
        for t in threads:
            t.join(120)
        errors = [repr(s.error) for s in streams if s.error] + [new["error"]]
        if errors[0]:
            raise RuntimeError(errors[0])
        begin, end = new["begin"], new["end"]
        return {
            **new,
            "quiet": [g for s in streams for g in s.gaps(quiet, begin)],
            "tpot": [g for s in streams for g in s.gaps(begin, end)],
            "replays": new["replays"] + sum(s.replays for s in streams),
            "seconds": end - begin,
            # each relay's share of a core from the quiet phase to the last new token
            "relay_cpu": [c / (end - quiet) for c in relay_cpu],
            "cpu_report": report.lines(["quiet", "prompts"]) if report is not None else [],
            "batches": batches,
        }
    finally:
        stop.set()
        if client is not None:
            client.close()
        if proc is not None:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
        os.setpriority(os.PRIO_PROCESS, 0, 0)  # the next round's nodes start at the default
        swarm.stop_nodes()


def thread_times(pids: list[int]) -> dict[int, tuple[int, int]]:
    """Each thread of `pids`: nanoseconds on a CPU and waiting for one (Linux schedstat)."""
    out = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    run, wait, _ = f.read().split()
            except (OSError, ValueError):
                continue
            out[int(tid)] = (int(run), int(wait))
    return out


class CpuReport:
    """Where the CPU went in each phase of a round, by process group: the share of a core
    each group ran, its busiest thread's, and the share its threads waited for a CPU."""

    def __init__(self, groups: dict[str, list[int]]):
        self.groups = groups  # name -> its processes
        self.marks: list[tuple[float, dict[str, dict[int, tuple[int, int]]]]] = []

    def mark(self) -> None:
        times = {name: thread_times(pids) for name, pids in self.groups.items()}
        self.marks.append((time.monotonic(), times))

    def lines(self, phases: list[str]) -> list[str]:
        out = []
        for name in self.groups:
            cells = []
            for (t0, a), (t1, b) in zip(self.marks, self.marks[1:]):
                secs = (t1 - t0) * 1e9
                before, after = a[name], b[name]
                run = {t: after[t][0] - before.get(t, (0, 0))[0] for t in after}
                wait = sum(after[t][1] - before.get(t, (0, 0))[1] for t in after)
                busiest = max(run.values(), default=0)
                ran = sum(run.values()) / secs
                cells.append(f"{ran:4.0%} ({busiest / secs:3.0%}), waited {wait / secs:4.0%}")
            out.append(f"  {name:>22}: " + "; ".join(f"{p} {c}" for p, c in zip(phases, cells)))
        return out


def decode_batches(dht) -> dict[str, float]:
    """Each node's decode steps per decode pass so far, by role, as its record tells."""
    view = read_swarm(dht)
    return {f"{r.role} {r.peer[-6:]}": r.decode_batch for rs in view.nodes.values() for r in rs}


def summary(r: dict) -> str:
    ms = lambda x: f"{1000 * x:.0f}"  # noqa: E731
    return (
        f"steady TPOT p50 {ms(pct(r['tpot'], 0.5))} ms, p99 {ms(pct(r['tpot'], 0.99))} ms"
        f" ({len(r['tpot'])} tokens; before the prompts p50 {ms(pct(r['quiet'], 0.5))},"
        f" p99 {ms(pct(r['quiet'], 0.99))}); new sessions: TTFT p50 {pct(r['ttft'], 0.5):.2f} s,"
        f" max {max(r['ttft']):.2f} s, TPOT p50 {ms(pct(r['new_tpot'], 0.5))} ms,"
        f" p99 {ms(pct(r['new_tpot'], 0.99))} ms; {r['moves']} handed on, {r['replays']}"
        f" replayed, {r['seconds']:.0f} s"
        + (
            "; relays' CPU " + ", ".join(f"{c:.0%}" for c in r["relay_cpu"]) + " of a core"
            if r["relay_cpu"]
            else ""
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--streams", type=int, default=4, help="sessions decoding steadily")
    p.add_argument("--prompts", type=int, default=8, help="long prompts arriving, one by one")
    p.add_argument("--prompt", type=int, default=2000, help="tokens of each")
    p.add_argument("--every", type=float, default=8.0, help="seconds between their arrivals")
    p.add_argument("--new", type=int, default=32, help="tokens each new session generates")
    p.add_argument("--layers", type=int, default=30, help="the model's layer count")
    p.add_argument("--rate-mbps", type=float, default=0.0, help="shape every node's link")
    p.add_argument("--rtt-ms", type=float, default=20.0, help="its round trip, when shaped")
    p.add_argument("--logs", help="a folder for the nodes' logs")
    p.add_argument(
        "--no-pin", dest="pin", action="store_false", help="let the nodes share every core"
    )
    p.add_argument("--node-args", default="", help="more options for every node")
    p.add_argument(
        "--one-client",
        action="store_true",
        help="the new sessions in the streams' client process (default: a process of their own)",
    )
    p.add_argument(
        "--client-core",
        type=int,
        help="run the client (this process, one torch thread, nice -5) on this core only: 0"
        " shares the first node's core (P/D: the prefill node's) but comes first there, as if"
        " the user's machine were not a node",
    )
    p.add_argument(
        "--cpu-report",
        action="store_true",
        help="print where the CPU went before and during the prompts: each node (with its DHT"
        " process and p2pd), relay and client, and how long their threads waited for a CPU",
    )
    p.add_argument(
        "--handoff-min-new",
        type=int,
        default=routing.HANDOFF_MIN_NEW_TOKENS,
        help="the client's rule: sessions generating fewer new tokens stay on the prefill node"
        " (0: every session is handed on)",
    )
    a = p.parse_args()
    COMMON.extend(shlex.split(a.node_args))
    a.cores = sorted(os.sched_getaffinity(0))  # the nodes', before the client is confined
    if a.client_core is not None:
        os.sched_setaffinity(0, {a.client_core})
        torch.set_num_threads(1)
    link = f"{a.rate_mbps:g} Mbit/s, RTT {a.rtt_ms:g} ms" if a.rate_mbps else "loopback"
    pinned = "each node on a core of its own" if a.pin else "nodes on any core"
    if a.client_core is not None:
        pinned += f", the client on core {a.client_core}"
    print(f"CPU: {cpu_name()}; every node's link: {link}; {pinned}", flush=True)
    print(
        f"{a.streams} steady streams; {a.prompts} prompts of {a.prompt} tokens, one every"
        f" {a.every:g} s, each then generating {a.new}; sessions generating fewer than"
        f" {a.handoff_min_new} stay on the prefill node",
        flush=True,
    )
    results = {}
    with LocalSwarm() as swarm:
        for name, roles in (("colocated", ("both", "both")), ("P/D", ("prefill", "decode"))):
            results[name] = r = run_round(swarm, a, roles)
            print(f"{name:>9}: {summary(r)}", flush=True)
            if r["cpu_report"]:
                print("  share of a core (busiest thread), share waiting for a CPU, by phase:")
                print("\n".join(r["cpu_report"]), flush=True)
                batches = ", ".join(f"{k} {v:.2f}" for k, v in r["batches"].items())
                print(f"  decode steps per decode pass: {batches}", flush=True)
    c, d = results["colocated"], results["P/D"]
    tpot = pct(d["tpot"], 0.99) / pct(c["tpot"], 0.99)
    ttft = statistics.median(d["ttft"]) / statistics.median(c["ttft"])
    print(
        f"P/D vs colocated, {link}: steady TPOT p99 {tpot:.2f}x (goal <= 0.7x),"
        f" TTFT p50 {ttft:.2f}x (goal <= 1.3x)"
    )


if __name__ == "__main__":
    main()
