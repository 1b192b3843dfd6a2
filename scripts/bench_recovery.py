"""Kill -9 (or SIGSTOP) a node on the route mid-generation, many times; report success and stall.

Each trial generates greedily through a redundant tiny-model swarm, faults the node at a route
hop after 10 tokens, and checks the final tokens against an undisturbed run. The stall is the
time from the fault to the next token. The faulted node is replaced before the next trial.

  .venv/bin/python scripts/bench_recovery.py --trials 20 [--fault stop]
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time

from bench.stats import percentile

from devtools.launch import start_node, stop_all
from swarm.client.client import Client
from swarm.dht import start_dht, visible_maddrs
from swarm.model.tiny import save_tiny_llama

SPANS = [(0, 3), (0, 3), (3, 6), (3, 6)]
PROMPT = [11, 22, 33, 44, 55, 66, 77]
NEW = 30
EXTRA = ["--weights", "float32", "--wire-dtype", "float32", "--announce-ttl", "20"]


def greedy(client: Client, fault=None, at: int = 10):
    out, stall = [], None
    with client.session(len(PROMPT) + NEW) as s:
        logits = s.feed(PROMPT)
        for i in range(NEW):
            t = None
            if i == at and fault is not None:
                fault(s.remote.route)
                t = time.monotonic()
            out.append(int(logits.argmax()))
            logits = s.feed([out[-1]])
            if t is not None:
                stall = time.monotonic() - t
    return out, stall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--fault", choices=["kill", "stop"], default="kill")
    p.add_argument("--step-timeout", type=float, default=3.0)
    a = p.parse_args()
    model_dir = tempfile.mkdtemp(prefix="tiny-llama")
    save_tiny_llama(model_dir)
    # a bootstrap peer that is never faulted: fresh nodes join through it, whoever has died
    bootstrap = start_dht()
    peers = visible_maddrs(bootstrap)[:1]
    nodes = [start_node(span, peers, model=model_dir, extra=EXTRA) for span in SPANS]
    for n in nodes:
        n.wait_serving()
    client = Client(peers, model=model_dir, wire_dtype="float32", step_timeout=a.step_timeout)
    try:
        expected, _ = greedy(client)
        ok, stalls = 0, []
        for trial in range(a.trials):
            hop = trial % 2
            victim = {}

            def fault(route, hop=hop, victim=victim):
                node = next(n for n in nodes if n.peer == route[hop].peer)
                victim["node"] = node
                if a.fault == "kill":
                    node.proc.kill()
                else:
                    os.kill(node.pid, signal.SIGSTOP)

            try:
                out, stall = greedy(client, fault)
                good = out == expected
            except Exception as exc:  # a failed recovery is a result, not a crash
                print(f"trial {trial}: {type(exc).__name__}: {exc}")
                good, stall = False, None
            ok += good
            if stall is not None:
                stalls.append(stall)
            print(
                f"trial {trial:2d} hop {hop}: {'ok ' if good else 'BAD'} stall {stall or 0:.2f} s",
                flush=True,
            )
            dead = victim["node"]
            if a.fault == "stop":
                os.kill(dead.pid, signal.SIGCONT)
            stop_all([dead], signal.SIGKILL)
            nodes.remove(dead)
            fresh = start_node(dead.layers, peers, model=model_dir, extra=EXTRA)
            fresh.wait_serving()
            nodes.append(fresh)
            time.sleep(1.0)  # let its record spread on the DHT
        p50, p99 = (percentile(stalls, q) if stalls else 0 for q in (0.5, 0.99))
        print(
            f"\n{a.fault}: {ok}/{a.trials} recovered with identical output;"
            f" stall p50 {p50:.2f} s, p99 {p99:.2f} s,"
            f" max {max(stalls) if stalls else 0:.2f} s; load {os.getloadavg()[0]:.1f}"
        )
    finally:
        client.close()
        for n in nodes:
            if n.proc.poll() is None:
                os.kill(n.pid, signal.SIGCONT)
        stop_all(nodes)
        bootstrap.shutdown()


if __name__ == "__main__":
    main()
