"""Sessions longer than a node's cache (issue #52, DistKV): decode TPOT with part of the KV cache
borrowed from a `--role cache` node, beside the same session unborrowed, over the link between
the borrower and its lender; and the longest session the swarm serves beside one node's cache.

For each model (--models: the default model; `8b`, an 8B-shaped random-weight model of
--synthetic-layers Q4_K blocks, scripts/synthetic_gguf.py, token ids without a tokenizer), each
lender link (--links, round trip ms: 0 loopback, else a shaped relay of --rate-mbps both ways in
front of the cache node, devtools/link_proxy.py; the client's link to the serving node stays
loopback: what is measured is the borrower-lender path) and each share borrowed (--borrowed, %),
a fresh swarm: one node serving every block (--threads 1) and, when borrowing, a cache node.
The node's --max-cache-tokens is set so that a borrowing session keeps (100 - share)% of its
positions here (swarm.node.borrow.local_tokens keeps half the node's cache); 0%: no cap.
TPOT: median seconds a decode step after a --context token prompt, --new steps.

Longest session: a node of --max-cache-tokens --longest-cache and a cache node (its default
--max-lend): sessions of 2, 4, 8... times that length, each a prompt of its length and 2 decode
steps, until one fails or --longest-max is passed; the ratio to what the node alone holds.

A long prompt's pass spread over two replicas of the span: scripts/bench_spread.py.

    .venv/bin/python scripts/bench_distkv.py [--models default,8b] [--links 0,1,20]
        [--borrowed 0,50,90] [--context 512] [--new 32] [--files DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import bench  # noqa: F401  (first: OpenMP's wait policy, a node's, before torch loads)
from bench.local import LocalSwarm, Shape
from bench.proc import cpu_name
from bench.table import print_table
from bench.timing import session_greedy

from swarm.client.client import Client
from swarm.errors import SwarmError
from swarm.model.source import default_model_path, open_model

BLOCK = 16  # swarm.node.borrow.BLOCK: positions kept here are whole blocks


def token_ids(n: int, vocab: int) -> list[int]:
    """A prompt of `n` spread token ids within the vocabulary (no tokenizer needed)."""
    return [(i * 7919) % (vocab - 200) + 100 for i in range(n)]


def node_cache_for(session: int, borrowed: int) -> int:
    """--max-cache-tokens for which a session of `session` tokens keeps about (100 - borrowed)%
    of its positions here (half the node's cache, whole blocks)."""
    keep = max(2 * BLOCK, round(session * (100 - borrowed) / 100 / BLOCK) * BLOCK)
    return min(2 * keep, session - 1)


def tpot(model: Path, layers: int, prompt: list[int], new: int, borrowed: int, shape) -> float:
    """Median seconds a decode step of one session after `prompt`, on a fresh local swarm."""
    session = len(prompt) + new + 1
    extra = ["--threads", "1", "--model", str(model)]
    if borrowed:
        extra += ["--max-cache-tokens", str(node_cache_for(session, borrowed))]
    with LocalSwarm() as swarm:
        swarm.node((0, layers), extra=extra)
        if borrowed:
            swarm.node(None, extra=["--role", "cache", "--model", str(model)], shape=shape)
        client = Client(swarm.peers, model=str(model))
        try:
            session_greedy(client, prompt[:32], 4)  # warm: connections, the lane's first pass
            times = session_greedy(client, prompt, new)
        finally:
            client.close()
    return statistics.median(times.gaps(lo=times.decode_start))


def longest(model: Path, config, cache: int, most: int) -> tuple[int, float]:
    """(the longest session of cache x 2^i tokens served, its seconds) by a node of `cache`
    tokens and a cache node, up to `most` tokens and the model's context."""
    layers = config.num_layers
    most = min(most, config.max_position - 3)
    best, seconds = 0, 0.0
    with LocalSwarm() as swarm:
        swarm.node(
            (0, layers),
            extra=["--threads", "1", "--model", str(model), "--max-cache-tokens", str(cache)],
        )
        swarm.node(None, extra=["--role", "cache", "--model", str(model)])
        client = Client(swarm.peers, model=str(model))
        try:
            n = 2 * cache
            while n <= most:
                prompt = token_ids(n, config.vocab)
                started = time.perf_counter()
                try:
                    session_greedy(client, prompt, 2)
                except SwarmError as exc:
                    print(f"  a session of {n} tokens: {exc}")
                    break
                best, seconds = n, time.perf_counter() - started
                print(f"  a session of {n} tokens served in {seconds:.1f} s")
                n *= 2
        finally:
            client.close()
    return best, seconds


def models(a, folder: Path) -> list[tuple[str, Path]]:
    out = []
    for name in a.models:
        if name == "default":
            out.append(("default", default_model_path()))
        elif name == "8b":
            from synthetic_gguf import l8b_file

            out.append(("8b", l8b_file(folder, a.synthetic_layers)))
        else:
            raise SystemExit(f"unknown model {name!r}: default or 8b")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    csv = lambda kind: lambda s: [kind(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--models", type=csv(str), default=["default", "8b"])
    p.add_argument("--synthetic-layers", type=int, default=2, help="blocks of the 8B model")
    p.add_argument("--links", type=csv(float), default=[0, 1, 20], help="lender round trip, ms")
    p.add_argument("--rate-mbps", type=float, default=1000.0)
    p.add_argument("--borrowed", type=csv(int), default=[0, 50, 90], help="%% of the cache lent")
    p.add_argument("--context", type=int, default=512, help="prompt tokens")
    p.add_argument("--new", type=int, default=32, help="decode steps timed")
    p.add_argument("--longest-cache", type=int, default=256, help="0: skip the longest session")
    p.add_argument("--longest-max", type=int, default=8192)
    p.add_argument("--files", help="keep the 8B-shaped file here (default: a temp dir)")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in models(a, Path(a.files or tmp)):
            config = open_model(str(path)).config
            prompt = token_ids(a.context, config.vocab)
            for rtt in a.links:
                shape = Shape(a.rate_mbps, rtt) if rtt else None
                plain = None
                for share in a.borrowed:
                    s = tpot(path, config.num_layers, prompt, a.new, share, shape)
                    plain = s if share == 0 else plain
                    ratio = f"{s / plain:.2f}x" if plain else "-"
                    goal = ""
                    if share == 50 and rtt == 1 and plain:
                        goal = f"<=1.3x {'met' if s / plain <= 1.3 else 'MISSED'}"
                    link = "loopback" if not rtt else f"{rtt:g} ms, {a.rate_mbps:g} Mbit/s"
                    rows.append([name, link, f"{share}%", f"{s * 1e3:.1f}", ratio, goal])
                    print(f"  {name} {link} {share}% borrowed: {s * 1e3:.1f} ms")
            if a.longest_cache:
                n, secs = longest(path, config, a.longest_cache, a.longest_max)
                rows.append(
                    [
                        name,
                        "longest session",
                        f"{n} tokens",
                        f"{secs:.1f} s",
                        f"{n / a.longest_cache:.1f}x one node's {a.longest_cache}",
                        f">=4x {'met' if n >= 4 * a.longest_cache else 'MISSED'}",
                    ]
                )
    print(f"\n{date.today()}, {cpu_name()}, {a.context}-token context, {a.new} steps, --threads 1")
    print_table(["model", "lender link", "borrowed", "TPOT ms", "x unborrowed", "goal"], rows)
    print("a long prompt spread over two replicas: scripts/bench_spread.py")


if __name__ == "__main__":
    main()
