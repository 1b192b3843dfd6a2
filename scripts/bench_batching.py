"""Many users at once: N concurrent sessions, each in its own client process (issue 23).

Through a 2-node and a 3-node local swarm at the defaults (--threads 1 per node), for N in 1, 2,
4, 8, 16: every client connects, feeds its own short prompt, then all decode --new-tokens greedy
tokens at once. Prints per swarm: aggregate decode tokens/s (all sessions' decode tokens over
the span from the first decode step to the last), per-session time per output token p50 and p99
(every step of every session), and each node's mean decode batch over the run (from its DHT
record's pass counters). Goals: 8 sessions >= 4x one session's aggregate tokens/s, TPOT p99 at
8 sessions <= 2.5x a lone session's.

    .venv/bin/python scripts/bench_batching.py [--sessions 1,2,4,8,16] [--nodes 2,3]
    .venv/bin/python scripts/bench_batching.py --model /tmp/swarm-l8b/l8b-16.Q4_K.gguf \
        --nodes 1,2 --sessions 1,4    # real-size layers: does a pipeline overlap its stages?
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from bench.proc import cpu_seconds
from bench.stats import percentile

GOAL_SPEEDUP_AT_8 = 4.0
GOAL_P99_AT_8 = 2.5


def client_main(a) -> None:
    """One user: connect, prefill, say ready, wait for the go line, decode, print timings."""
    import torch

    from swarm.client.client import Client
    from swarm.model.sampling import Sampler

    # a user's own machine would give its head every core; here N clients share two with the
    # nodes, and idle OpenMP threads spinning between matmuls would take them from everyone
    torch.set_num_threads(1)

    client = Client(a.peers.split(","), model=a.model)
    if client.config.vocab < 10000:  # a synthetic file: no tokenizer, ids of its own
        ids = [(37 * i + 11 * a.index) % (client.config.vocab - 50) + 50 for i in range(16)]
    else:
        ids = client.encode(f"User {a.index}: tell me a story about the number {a.index}.")
    with client.session(len(ids) + a.new_tokens + 1) as s:
        if a.picks:  # a reply's session: the last node picks (greedy), the client loads no head
            s.sampler = Sampler()
        step = s.pick if a.picks else (lambda ids: int(s.feed(ids).argmax()))
        token = step(ids)
        print("ready", flush=True)
        sys.stdin.readline()  # everyone decodes at once
        steps, start, cpu = [], time.time(), time.process_time()
        for _ in range(a.new_tokens):
            t = time.perf_counter()
            token = step([token])
            steps.append(time.perf_counter() - t)
        end, cpu = time.time(), time.process_time() - cpu
    print(json.dumps({"start": start, "end": end, "steps": steps, "cpu": cpu}), flush=True)
    client.close()


def run_sessions(
    peers: str,
    n: int,
    new_tokens: int,
    node_pids: list[int],
    model: str | None = None,
    picks: bool = False,
) -> dict:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--client",
                "--peers",
                peers,
                "--index",
                str(i),
                "--new-tokens",
                str(new_tokens),
                *(["--model", model] if model else []),
                *(["--picks"] if picks else []),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for i in range(n)
    ]
    for p in procs:
        line = p.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"a client failed before decoding: {line!r}")
    node_cpu = cpu_seconds(*node_pids, children=True)
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    runs = []
    for p in procs:
        out = p.stdout.readline()
        p.wait(60)
        runs.append(json.loads(out))
    node_cpu = cpu_seconds(*node_pids, children=True) - node_cpu
    steps = [s for r in runs for s in r["steps"]]
    span = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    return {
        "tok_s": len(steps) / span,
        "p50": percentile(steps, 0.5),
        "p99": percentile(steps, 0.99),
        # CPU per decode token: where the time goes on a machine shared by nodes and clients
        "node_cpu_ms": node_cpu / len(steps) * 1000,
        "client_cpu_ms": sum(r["cpu"] for r in runs) / len(steps) * 1000,
        "wall_ms": span / len(steps) * 1000,
    }


def pass_counters(client) -> dict[str, tuple[int, float]]:
    return {r.peer: (r.decode_passes, r.decode_batch) for r in client.nodes()}


def fresh_counters(client, before, ttl: float) -> dict[str, tuple[int, float]]:
    deadline = time.monotonic() + ttl + 5
    while True:
        now = pass_counters(client)
        if all(now.get(p, (0, 0))[0] != before.get(p, (0, 0))[0] for p in now):
            return now
        if time.monotonic() > deadline:
            return now
        time.sleep(0.5)


def batch_means(before, after) -> list[float]:
    out = []
    for peer, (passes, mean) in sorted(after.items()):
        p0, m0 = before.get(peer, (0, 1.0))
        if passes > p0:
            out.append((passes * mean - p0 * m0) / (passes - p0))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", default="1,2,4,8,16")
    p.add_argument("--nodes", default="2,3")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--max-batch", type=int, default=None, help="pass to the nodes (default theirs)")
    p.add_argument("--model", help="a GGUF file (default: the default model)")
    p.add_argument("--node-args", default="", help="more options for every node")
    p.add_argument(
        "--picks", action="store_true", help="the last node picks each token (as replies do)"
    )
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--peers", help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.client:
        return client_main(a)

    from devtools.launch import even_spans, start_swarm, stop_all
    from swarm.client.client import Client
    from swarm.model.source import open_model

    layers = open_model(a.model).config.num_layers
    ttl = 3.0
    extra = ["--threads", "1", "--announce-ttl", str(ttl), *shlex.split(a.node_args)]
    if a.max_batch:
        extra += ["--max-batch", str(a.max_batch)]
    table = []
    for parts in (int(x) for x in a.nodes.split(",")):
        nodes = start_swarm(even_spans(layers, parts), model=a.model, extra=extra)
        try:
            peers = ",".join(nodes[0].maddrs[:1])
            watcher = Client(nodes[0].maddrs[:1], model=a.model)
            for n in (int(x) for x in a.sessions.split(",")):
                before = fresh_counters(watcher, {}, 0)
                pids = [node.pid for node in nodes]
                result = run_sessions(peers, n, a.new_tokens, pids, a.model, a.picks)
                result["batch"] = batch_means(before, fresh_counters(watcher, before, ttl))
                result.update(nodes=parts, sessions=n, load=os.getloadavg()[0])
                table.append(result)
                print(json.dumps(result), flush=True)
            watcher.close()
        finally:
            stop_all(nodes)
    report(table)


def report(table) -> None:
    print(
        "\n| nodes | sessions | aggregate decode tok/s | x one session | TPOT p50 ms | "
        "TPOT p99 ms | p99 / lone p99 | mean batch per node | CPU ms a token: nodes / clients |"
        " load |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        lone = next(
            (x for x in table if x["nodes"] == r["nodes"] and x["sessions"] == 1), r
        )  # without a lone run in the table, ratios are to the row itself
        batches = " / ".join(f"{b:.1f}" for b in r["batch"]) or "-"
        print(
            f"| {r['nodes']} | {r['sessions']} | {r['tok_s']:.1f}"
            f" | {r['tok_s'] / lone['tok_s']:.2f}"
            f" | {r['p50'] * 1000:.1f} | {r['p99'] * 1000:.1f} | {r['p99'] / lone['p99']:.2f}"
            f" | {batches} | {r['node_cpu_ms']:.1f} / {r['client_cpu_ms']:.1f}"
            f" | {r['load']:.1f} |"
        )
    for parts in sorted({r["nodes"] for r in table}):
        rows = {r["sessions"]: r for r in table if r["nodes"] == parts}
        if 1 in rows and 8 in rows:
            speedup = rows[8]["tok_s"] / rows[1]["tok_s"]
            p99 = rows[8]["p99"] / rows[1]["p99"]
            print(
                f"{parts} nodes: 8 sessions {speedup:.2f}x one session's tok/s (goal >= "
                f"{GOAL_SPEEDUP_AT_8}); TPOT p99 {p99:.2f}x a lone session's (goal <= "
                f"{GOAL_P99_AT_8})"
            )


if __name__ == "__main__":
    main()
