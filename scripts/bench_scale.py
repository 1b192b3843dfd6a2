"""A swarm of many on one machine: what a node costs, how long a route takes to set up as the
swarm grows, how sessions spread over replicas, and whether generations survive churn.

Tiny random Llama (6 layers), every node `--threads 1`, spans 0:2, 2:4, 4:6 in turn; a bootstrap
DHT peer of the benchmark's own, which is never killed. Sections (--only picks some):
  memory  PSS of one node with its DHT process and p2p daemon, and how many this machine holds
  health  the health page's view, page and JSON of 100 nodes (made-up records), rendered
  routes  route setup p50/p99 and pings per route: cold (a new client: records read, nodes
          pinged), reread (records read again, round trips cached: a session more than a
          second after the last) and warm (both cached: sessions starting together), at 3, 12
          and 24 nodes and with 200 synthetic records more (devtools/crowd.py: each at its own
          loopback address, answering pings)
  spread  12 nodes (4 replicas of each span), --sessions concurrent sessions from --clients
          client processes for --duration s, generating --new tokens each then opening anew:
          concurrent sessions per replica (time-averaged) max / mean, and aggregate tokens/s;
          `today` (the cheapest route, load ignored: the routing before issue #37) then `load`
  churn   12 nodes, --churn-sessions greedy sessions, kill -9 of a random node every 10 s and a
          replacement on its span started from a short-lived thread, for --churn-duration s:
          generations completed and matching an undisturbed run, recovery stall p50/p99

  .venv/bin/python scripts/bench_scale.py [--only routes spread churn memory]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict

import psutil
from bench.stats import p50_p99_ms as ms
from bench.stats import percentile as pct

from devtools.launch import start_node, stop_all
from swarm.client.client import Client
from swarm.dht import start_dht, visible_maddrs
from swarm.errors import RouteUnavailable

SPANS = [(0, 2), (2, 4), (4, 6)]
FLAGS = ["--weights", "float32", "--wire-dtype", "float32", "--threads", "1"]
PROMPTS = [[5, 50, 150, 250], [11, 22, 33, 44, 55], [7, 70, 170], [300, 30, 3, 13]]


class Swarm:
    def __init__(self, model: str, ttl: float):
        self.model, self.ttl = model, ttl
        self.bootstrap = start_dht()
        self.peers = visible_maddrs(self.bootstrap)[:1]
        self.nodes: list = []

    def grow(self, total: int) -> None:
        """Start or stop nodes until `total` serve, spans in turn."""
        if len(self.nodes) > total:
            stop_all(self.nodes[total:])
            del self.nodes[total:]
        extra = [*FLAGS, "--announce-ttl", str(self.ttl)]
        new = [
            start_node(SPANS[i % 3], self.peers, model=self.model, extra=extra)
            for i in range(len(self.nodes), total)
        ]
        for n in new:
            n.wait_serving()
        self.nodes += new

    def close(self) -> None:
        stop_all(self.nodes)
        self.bootstrap.shutdown()


# ---- memory -------------------------------------------------------------------------------


def pss(pid: int) -> int:
    proc = psutil.Process(pid)
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_full_info().pss
        except psutil.Error:
            pass
    return total


def memory(swarm: Swarm, _a) -> None:
    per_node = statistics.median(pss(n.pid) for n in swarm.nodes)
    free = psutil.virtual_memory().available
    total = psutil.virtual_memory().total
    print(
        f"memory: a node (with its DHT process and p2pd) {per_node / 2**20:.0f} MiB PSS;"
        f" {free / 2**30:.1f} of {total / 2**30:.1f} GiB available now holds"
        f" ~{int(free // per_node)} more nodes"
    )


def health(_swarm, _a) -> None:
    """The health page and JSON of a model with 100 nodes over 10 spans, from made-up records
    (the page renders from the snapshot alone)."""
    from swarm.health.render import render_page
    from swarm.health.snapshot import DhtStatus, Known, Snapshot, build_model_view
    from swarm.records import ModelRecord, NodeRecord

    now = time.time()
    records = [
        NodeRecord(f"peer{i:03d}", f"10.0.0.{i}:7000", "m", 3 * (i % 10), 3 * (i % 10) + 3,
                   "online", "fp", "0", 30, throughput=20.0, sessions=i % 3, updated=now)
        for i in range(100)
    ]  # fmt: skip
    known = [Known(r, now + 30) for r in records]
    took: dict[str, list[float]] = {"view": [], "page": [], "json": []}
    for _ in range(20):
        t = time.perf_counter()
        model = build_model_view(ModelRecord("m", 30, "fp"), known, {}, now)
        snap = Snapshot(taken_at=now, dht=DhtStatus("ok", now, 0.01), models=(model,))
        took["view"].append(time.perf_counter() - t)
        t = time.perf_counter()
        html = render_page(snap, 10)
        took["page"].append(time.perf_counter() - t)
        t = time.perf_counter()
        json.dumps(snap.to_json())
        took["json"].append(time.perf_counter() - t)
    figures = ", ".join(f"{k} {statistics.median(v) * 1e3:.1f} ms" for k, v in took.items())
    print(f"health, 100 nodes over 10 spans: {figures} (median of 20); page {len(html)} bytes")


# ---- routes -------------------------------------------------------------------------------


def count_pings() -> list[int]:
    """Count every ping the client sends for routes, in this tree's routing (before #37 the
    client module pinged; since, swarm.client.probe does)."""
    import swarm.client.client as client_module

    counter = [0]
    modules = [client_module]
    try:
        import swarm.client.probe as probe_module

        modules.append(probe_module)
    except ImportError:
        pass
    for module in modules:
        real = module.ping

        async def counted(hop, *, timeout, rounds=1, _real=real):
            counter[0] += 1
            return await _real(hop, timeout=timeout, rounds=rounds)

        module.ping = counted
    return counter


def forget(client: Client) -> None:
    """Drop what the client learnt of round trips and records: its next route is a
    newcomer's."""
    if hasattr(client, "router"):
        from swarm.client.router import Router

        client.router = Router(client.loop.run)
        client._records = None
    else:
        client._rtts.clear()


def route_figures(client: Client, pings: list[int], label: str, cold: int, warm: int) -> None:
    read = []
    for _ in range(5):
        t = time.perf_counter()
        records = client.nodes()
        read.append(time.perf_counter() - t)
    kinds = ("cold", "reread", "warm")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    dials: dict[str, list[int]] = {k: [] for k in kinds}
    failed: list[str] = []
    for kind, n in (("cold", cold), ("reread", cold), ("warm", warm)):
        for _ in range(n):
            if kind == "cold":
                forget(client)
            elif kind == "reread" and hasattr(client, "_records"):
                client._records = None  # a new session more than a second after the last
            before = pings[0]
            t = time.perf_counter()
            try:
                client.route()
            except RouteUnavailable as exc:  # counted; the figures are of the routes found
                failed.append(str(exc))
                continue
            times[kind].append(time.perf_counter() - t)
            dials[kind].append(pings[0] - before)
    print(
        f"routes, {label} ({len(records)} records; reading them {ms(read)}):"
        + "; ".join(
            f" {k} {ms(times[k])}, {statistics.mean(dials[k]):.1f} pings (max {max(dials[k])})"
            for k in kinds
            if times[k]
        )
        + (f"; {len(failed)} failed: {failed[0]}" if failed else "")
    )


def routes(swarm: Swarm, a) -> None:
    pings = count_pings()
    for total in (3, 12, 24):
        swarm.grow(total)
        time.sleep(2)  # the newest records reach the bootstrap peer
        client = Client(swarm.peers, model=swarm.model, wire_dtype="float32")
        try:
            route_figures(client, pings, f"{total} nodes", a.cold, a.warm)
        finally:
            client.close()
    from devtools.crowd import Crowd

    client = Client(swarm.peers, model=swarm.model, wire_dtype="float32")
    one_per_span = {(r.start, r.end): r for r in client.nodes()}
    crowd = Crowd(swarm.peers, list(one_per_span.values()), a.synthetic)
    try:
        time.sleep(2)
        label = f"24 nodes and {a.synthetic} synthetic"
        route_figures(client, pings, label, a.cold, a.warm)
        print(f"  connections to synthetic nodes: {crowd.forwarders.total}")
    finally:
        crowd.close()
        client.close()


# ---- spread and churn: sessions in client processes ---------------------------------------


def worker(spec: dict) -> None:
    """One client process: `sessions` threads each generating until `until`; prints a JSON
    line per generation."""
    if spec["policy"] == "today":
        cheapest_route_only()
    client = Client(spec["peers"], model=spec["model"], wire_dtype="float32")
    lock = threading.Lock()

    def run(i: int) -> None:
        rng = random.Random(spec["seed"] * 1000 + i)
        while time.time() < spec["until"]:
            prompt = rng.choice(PROMPTS)
            out, row = [], {"opened": time.time(), "route": [], "recoveries": []}
            try:
                with client.session(len(prompt) + spec["new"]) as s:
                    logits = s.feed(prompt)
                    row["route"] = [h.peer for h in s.remote.route]
                    for _ in range(spec["new"]):
                        out.append(int(logits.argmax()))
                        logits = s.feed([out[-1]])
                    row["recoveries"] = s.recoveries
            except Exception as exc:  # counted, and the next generation goes on
                row["error"] = f"{type(exc).__name__}: {exc}"
            row.update(closed=time.time(), prompt=prompt, tokens=out)
            with lock:
                print(json.dumps(row), flush=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(spec["sessions"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    client.close()


def cheapest_route_only() -> None:
    """Route as before issue #37: every node pinged anew for each route, then the cheapest
    route by round trip and speed, load ignored (call before making the client)."""
    import swarm.client.probe as probe
    import swarm.client.router as router
    from swarm.client.routing import Estimates

    real = router.find_route

    def cheapest(records, num_layers, fingerprint, est, *rest):
        est = Estimates(est.rtts, est.measured)
        return real(records, num_layers, fingerprint, est, *rest[:3], near=0.0, near_s=0.0)

    router.find_route = cheapest
    probe.PER_BLOCK = 1 << 10  # every node of every block
    defaults = probe.RoundTrips.__init__.__defaults__
    # a round trip is good for the route that measured it (and those drawn within a second)
    probe.RoundTrips.__init__.__defaults__ = (1.0, *defaults[1:])


def run_clients(swarm: Swarm, a, policy: str, sessions: int, seconds: float) -> list[dict]:
    until = time.time() + seconds
    procs = []
    for c in range(a.clients):
        spec = dict(
            peers=swarm.peers, model=swarm.model, policy=policy, seed=c, new=a.new, until=until,
            sessions=sessions // a.clients + (c < sessions % a.clients),
        )  # fmt: skip
        cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    rows = []
    for p in procs:
        out, _ = p.communicate()
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rows


def spread(swarm: Swarm, a) -> None:
    swarm.grow(12)
    replicas = {n.peer for n in swarm.nodes[:12]}
    for policy in a.policies:
        t0 = time.time()
        rows = run_clients(swarm, a, policy, a.sessions, a.duration)
        seconds = time.time() - t0
        busy: dict[str, float] = defaultdict(float)
        for row in rows:
            for peer in row["route"]:
                busy[peer] += row["closed"] - row["opened"]
        mean_sessions = [busy.get(p, 0.0) / seconds for p in replicas]
        mean = statistics.mean(mean_sessions)
        tokens = sum(len(r["tokens"]) for r in rows)
        errors = sum("error" in r for r in rows)
        print(
            f"spread, {policy}: {a.sessions} sessions over 12 nodes for {seconds:.0f} s:"
            f" sessions per replica {min(mean_sessions):.1f}-{max(mean_sessions):.1f},"
            f" max/mean {max(mean_sessions) / mean:.2f}; {tokens / seconds:.1f} tokens/s;"
            f" {len(rows)} generations, {errors} failed"
        )


def churn(swarm: Swarm, a) -> None:
    from transformers import LlamaForCausalLM

    from swarm.model.tiny import reference_greedy

    swarm.grow(12)
    reference = LlamaForCausalLM.from_pretrained(swarm.model).eval()
    expected = {tuple(p): reference_greedy(reference, p, a.new) for p in PROMPTS}
    stop = threading.Event()
    kills: list[float] = []
    replacements: list = []

    def killer() -> None:
        rng = random.Random(1)
        extra = [*FLAGS, "--announce-ttl", str(swarm.ttl)]
        while not stop.wait(10.0):
            victim = rng.choice(swarm.nodes)
            victim.proc.send_signal(signal.SIGKILL)
            started: list = []  # from a thread that ends at once, as a harness would (issue #37)
            t = threading.Thread(
                target=lambda span=victim.layers, out=started: out.append(
                    start_node(span, swarm.peers, model=swarm.model, extra=extra)
                )
            )
            t.start()
            t.join()
            swarm.nodes[swarm.nodes.index(victim)] = started[0]
            replacements.append(started[0])
            victim.stop()
            kills.append(time.time())

    k = threading.Thread(target=killer)
    k.start()
    try:
        rows = run_clients(swarm, a, "load", a.churn_sessions, a.churn_duration)
    finally:
        stop.set()
        k.join()
    for n in replacements:
        if n in swarm.nodes:
            n.wait_serving()
    right = sum(r["tokens"] == expected[tuple(r["prompt"])] for r in rows)
    stalls = [s for r in rows for s in r["recoveries"]]
    errors = [r["error"] for r in rows if "error" in r]
    print(
        f"churn: {len(kills)} kills in {a.churn_duration:.0f} s, {a.churn_sessions} sessions:"
        f" {right}/{len(rows)} generations completed with the reference tokens,"
        f" {len(stalls)} recoveries, stall p50 {pct(stalls, 0.5):.2f} s,"
        f" p99 {pct(stalls, 0.99):.2f} s, max {max(stalls, default=0):.2f} s"
    )
    for e in sorted(set(errors))[:5]:
        print(f"  failed: {e} (x{errors.count(e)})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--only", nargs="*", default=["memory", "health", "routes", "spread", "churn"])
    p.add_argument("--cold", type=int, default=20, help="cold routes per swarm size")
    p.add_argument("--warm", type=int, default=50, help="warm routes per swarm size")
    p.add_argument("--synthetic", type=int, default=200)
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--policies", nargs="*", default=["today", "load"], help="spread's routings")
    p.add_argument("--clients", type=int, default=4, help="client processes sharing them")
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--new", type=int, default=32, help="tokens each generation")
    p.add_argument("--churn-sessions", type=int, default=12)
    p.add_argument("--churn-duration", type=float, default=180.0)
    p.add_argument("--ttl", type=float, default=9.0, help="the nodes' --announce-ttl")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(json.loads(a.worker))
    from swarm.model.tiny import save_tiny_llama

    model = tempfile.mkdtemp(prefix="tiny-llama")
    save_tiny_llama(model)
    print(f"bench_scale: {os.cpu_count()} cores; sections {' '.join(a.only)}", flush=True)
    swarm = Swarm(model, a.ttl)
    try:
        for name in ("memory", "health", "spread", "churn", "routes"):
            if name in a.only:
                if name == "memory":
                    swarm.grow(3)
                globals()[name](swarm, a)
                sys.stdout.flush()
    finally:
        swarm.close()


if __name__ == "__main__":
    main()
