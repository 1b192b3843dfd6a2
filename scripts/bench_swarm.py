"""Decode speed and time to first token through a local swarm vs the unsplit model, same run.

Prints one table. Example: .venv/bin/python scripts/bench_swarm.py --nodes 2 --threads 1
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench.table import print_table
from bench.timing import greedy, session_greedy

from devtools.launch import even_spans, start_swarm, stop_all
from swarm.client.client import Client
from swarm.model.blocks import KVCache, Span
from swarm.model.head import Head
from swarm.model.source import open_model


def unsplit_run(src, head, span, prompt_ids, new_tokens):
    cache = KVCache.allocate(src.config, span.start, span.end, len(prompt_ids) + new_tokens + 1)

    def feed(tokens):
        h = span.forward(head.embed_tokens(tokens), cache, cache.length, span.start, span.end)
        return head.logits(h[:, -1])

    t = greedy(feed, prompt_ids, new_tokens)
    return t.ttft, t.tokens_per_s


def swarm_run(client, prompt_ids, new_tokens):
    t = session_greedy(client, prompt_ids, new_tokens)
    return t.ttft, t.tokens_per_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per node")
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    src = open_model(None)
    head = Head.load(src, "float32")
    span = Span.load(src, 0, src.config.num_layers, weights="float32")
    prompt = [(i * 7919) % 40000 + 100 for i in range(a.prompt_tokens)]
    nodes = start_swarm(
        even_spans(src.config.num_layers, a.nodes), extra=["--threads", str(a.threads)]
    )
    try:
        client = Client(nodes[0].maddrs[:1])
        rows = {"unsplit": [], "swarm": []}
        for _ in range(a.repeats):  # alternate so machine noise hits both alike
            torch.set_num_threads(a.threads * a.nodes)
            rows["unsplit"].append(unsplit_run(src, head, span, prompt, a.new_tokens))
            rows["swarm"].append(swarm_run(client, prompt, a.new_tokens))
        client.close()
    finally:
        stop_all(nodes)
    print(
        f"\n{a.nodes} nodes x {a.threads} threads; prompt {a.prompt_tokens} tokens;"
        f" {a.new_tokens} new tokens; median of {a.repeats}"
    )
    med = {n: [statistics.median(r[i] for r in runs) for i in (0, 1)] for n, runs in rows.items()}
    ratio = [f"{s / u:.2f}" for s, u in zip(med["swarm"], med["unsplit"])]
    print_table(
        ["", "TTFT s", "decode tok/s"],
        [*([n, f"{t:.3f}", f"{r:.1f}"] for n, (t, r) in med.items()), ["ratio", *ratio]],
    )
    print("(ratio: swarm / unsplit)")


if __name__ == "__main__":
    main()
