"""Decode speed and time to first token through a local swarm vs the unsplit model, same run.

Prints one table. Example: .venv/bin/python scripts/bench_swarm.py --nodes 2 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import bench  # noqa: F401 (this checkout first on the path)
import torch

from devtools.launch import even_spans, start_swarm, stop_all
from swarm.client.client import Client
from swarm.model.blocks import KVCache, Span
from swarm.model.head import Head
from swarm.model.source import open_model


def unsplit_run(src, head, span, prompt_ids, new_tokens):
    cache = KVCache.allocate(src.config, span.end - span.start, len(prompt_ids) + new_tokens + 1)
    t0 = time.perf_counter()
    h = span.forward(head.embed_tokens(prompt_ids), cache, 0, span.start, span.end)
    token = int(head.logits(h[:, -1]).argmax())
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in range(new_tokens):
        h = span.forward(head.embed_tokens([token]), cache, cache.length, span.start, span.end)
        token = int(head.logits(h[:, -1]).argmax())
    return ttft, new_tokens / (time.perf_counter() - t1)


def swarm_run(client, prompt_ids, new_tokens):
    with client.session(len(prompt_ids) + new_tokens + 1) as s:
        t0 = time.perf_counter()
        logits = s.feed(prompt_ids)
        token = int(logits.argmax())
        ttft = time.perf_counter() - t0
        t1 = time.perf_counter()
        for _ in range(new_tokens):
            token = int(s.feed([token]).argmax())
        return ttft, new_tokens / (time.perf_counter() - t1)


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
    print(f"{'':10}{'TTFT s':>10}{'decode tok/s':>14}")
    med = {}
    for name, runs in rows.items():
        ttft = statistics.median(r[0] for r in runs)
        tps = statistics.median(r[1] for r in runs)
        med[name] = (ttft, tps)
        print(f"{name:10}{ttft:10.3f}{tps:14.1f}")
    print(
        f"{'ratio':10}{med['swarm'][0] / med['unsplit'][0]:10.2f}"
        f"{med['swarm'][1] / med['unsplit'][1]:14.2f}   (swarm / unsplit)"
    )


if __name__ == "__main__":
    main()
