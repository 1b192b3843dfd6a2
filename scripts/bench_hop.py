"""Where a decode step's time goes, hop by hop (issue 49): a token's way through a local swarm on
loopback, beside the same layers unsplit in one process.

The nodes (--nodes, even spans of the model, --threads each) write step logs (devtools/
step_log.py: each decode step's arrival, compute, and when its output was queued for the link);
the client stamps when each step left and its result came back. The node's clocks and the
client's are the same monotonic clock (one machine), so a token's timeline reads across them:
  in       from the previous stage queueing the activations (the client: sending them) to their
           arrival here: the sender's link scheduler and frame, the socket, this node's read
           and parse
  wait     arrival to compute: the session's queue and the compute lane's hand-over
  compute  the span's pass (the lane's wall time), and of it the seconds on a CPU and waiting
           for one (the kernel's schedstat; on a busy machine, compare CPU seconds); the rest
           of it the compute thread was blocked (the GIL)
  back     the last hop queueing the result to the client having it
  client   the result in hand to the next step sent: with --client-head the LM head and the
           pick; by default the last node picks (a reply's way) and the client only sends the id
Non-compute per hop = in + wait (the issue's goal: p50 <= 0.5 ms). Unsplit: Span.forward over
every layer and the head, greedy, in this process at the same threads.

    .venv/bin/python scripts/bench_hop.py [--nodes 2] [--threads 1] [--new-tokens 100]
        [--client-head] [--model FILE]
    --model: a GGUF file, e.g. 16 8B-shaped layers (default: the default model)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from bench import ROOT
from bench.local import LocalSwarm
from bench.proc import cpu_name, cpu_seconds
from bench.table import print_table
from bench.timing import next_token

from devtools.launch import even_spans
from swarm.client.client import Client
from swarm.model.blocks import Span
from swarm.model.head import Head
from swarm.model.sampling import Sampler
from swarm.model.source import open_model

STEP_LOG_NODE = (str(ROOT / "devtools" / "step_log.py"),)


def prompt_ids(n: int, vocab: int = 49152) -> list[int]:
    return [(i * 7919) % min(40000, vocab - 100) + 100 for i in range(n)]


def unsplit_tpot(ids: list[int], new: int, threads: int, model: str | None) -> tuple[float, float]:
    """Seconds a token, wall and on this thread's CPU."""
    torch.set_num_threads(threads)
    source = open_model(model)
    span = Span.load(source, 0, source.config.num_layers)
    head = Head.load(source)
    cache = span.allocate_cache(span.start, span.end, len(ids) + new + 1)
    h = span.forward(head.embed_tokens(ids), cache, 0, span.start, span.end)
    token = int(head.logits(h[:, -1]).argmax())
    started, cpu = time.perf_counter(), time.thread_time()
    for _ in range(new):
        h = span.forward(head.embed_tokens([token]), cache, cache.length, span.start, span.end)
        token = int(head.logits(h[:, -1]).argmax())
    return (time.perf_counter() - started) / new, (time.thread_time() - cpu) / new


def read_steps(path: str) -> list[tuple[float, float, float, float, float]]:
    """(arrived, queued for the link, compute seconds, of them on a CPU and waiting for one)
    of each decode step in a step log."""
    out = []
    with open(path) as f:
        for line in f:
            fields = line.split()
            if fields[0] not in ("a", "p"):
                arrived, until_queued, compute, cpu, runqueue = map(float, fields[:5])
                out.append((arrived, arrived + until_queued, compute, cpu, runqueue))
    return out


def swarm_timeline(a, folder: str) -> tuple[float, list[dict[str, float]]]:
    """TPOT and each token's timeline through a fresh swarm."""
    logs = [os.path.join(folder, f"node{i}.log") for i in range(a.nodes)]
    layers = open_model(a.model).config.num_layers
    with LocalSwarm() as swarm:
        pids = []
        for span, log in zip(even_spans(layers, a.nodes), logs):
            extra = ["--step-log", log, "--threads", str(a.threads)]
            if a.model:
                extra += ["--model", a.model]
            pids.append(swarm.node(span, extra=extra, program=STEP_LOG_NODE).proc.pid)
        client = Client(swarm.peers, model=a.model)
        stamps: list[tuple[float, float]] = []
        run = client.loop.run

        def stamped(fn, *args):
            sent = time.monotonic()
            out = run(fn, *args)
            if getattr(fn, "__name__", "") == "step":
                stamps.append((sent, time.monotonic()))
            return out

        try:
            ids = prompt_ids(20, open_model(a.model).config.vocab)
            with client.session(len(ids) + a.new_tokens + 1, "off") as s:
                if not a.client_head:
                    s.sampler = Sampler()  # greedy, a reply's way: the last node picks
                token = next_token(s, ids)
                client.loop.run = stamped
                started, cpu = time.perf_counter(), [cpu_seconds(p) for p in pids]
                client_cpu = time.process_time()
                for _ in range(a.new_tokens):
                    token = next_token(s, [token])
                tpot = (time.perf_counter() - started) / a.new_tokens
                client_cpu = (time.process_time() - client_cpu) / a.new_tokens
                cpu = [(cpu_seconds(p) - c) / a.new_tokens for p, c in zip(pids, cpu)]
        finally:
            client.loop.run = run
            client.close()
    hops = [read_steps(log)[-len(stamps) :] for log in logs]
    # a process's CPU beside its compute thread's: frames, TLS, scheduling, the trio loop
    outside = [c - statistics.mean(step[3] for step in steps) for c, steps in zip(cpu, hops)]
    cpus = {"client CPU a token": client_cpu}
    cpus.update({f"node {h} CPU outside compute": x for h, x in enumerate(outside)})
    rows = []
    for i, (sent, back) in enumerate(stamps):
        row, before = {}, sent
        for h, steps in enumerate(hops):
            arrived, queued, compute, cpu, runqueue = steps[i]
            row[f"in {h}"] = arrived - before
            row[f"wait {h}"] = queued - arrived - compute
            row[f"compute {h}"] = compute
            row[f"  of it CPU {h}"] = cpu
            row[f"  waiting for one {h}"] = runqueue
            before = queued
        row["back"] = back - before
        if i + 1 < len(stamps):
            row["client"] = stamps[i + 1][0] - back
        rows.append(row)
    return tpot, rows, cpus


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--new-tokens", type=int, default=100)
    p.add_argument("--model", help="a GGUF file; default: the default model")
    p.add_argument(
        "--client-head",
        action="store_true",
        help="the client computes the head and picks (feed()), not the route's last node",
    )
    a = p.parse_args()
    vocab = open_model(a.model).config.vocab
    unsplit, unsplit_cpu = unsplit_tpot(prompt_ids(20, vocab), a.new_tokens, a.threads, a.model)
    with tempfile.TemporaryDirectory() as folder:
        tpot, rows, cpus = swarm_timeline(a, folder)
    print(f"{cpu_name()}; {a.nodes} nodes x {a.threads} thread(s), {a.new_tokens} tokens")
    print(
        f"unsplit {unsplit * 1e3:.2f} ms a token, swarm {tpot * 1e3:.2f} ms:"
        f" swarm / unsplit speed {unsplit / tpot:.2f}x; unsplit CPU {unsplit_cpu * 1e3:.2f} ms"
        " a token (head included)"
    )
    table = []
    for key in rows[0]:
        values = [r[key] * 1e3 for r in rows if key in r]
        table.append([key, f"{statistics.median(values):.3f}", f"{statistics.mean(values):.3f}"])
    per_hop = [
        statistics.median(r[f"in {h}"] + r[f"wait {h}"] for r in rows) * 1e3 for h in range(a.nodes)
    ]
    print_table(["ms a token", "p50", "mean"], table)
    print("non-compute a hop (in + wait), p50 ms:", ", ".join(f"{x:.3f}" for x in per_hop))
    print("; ".join(f"{k} {v * 1e3:.2f} ms" for k, v in cpus.items()))


if __name__ == "__main__":
    main()
