"""A long prompt's pass on one node against the same pass spread over two replicas of its span
(issue #52, swarm/node/spread.py): time to first token of a --tokens prompt, the default model.

Variants, each a fresh local swarm on loopback, every node --threads 1 and room for the prompt
(--max-session-tokens, --max-cache-tokens):
  one        one node serving every block, prompt passes as by default (--prefill-pass-tokens)
  one-pass   one node, the prompt in one pass (the shape of pass a spread's owner takes)
  spread     two nodes serving every block: the session's node computes the pass's first rows,
             the other the rest (--spread-prompt-tokens 4096)
TTFT: seconds from sending the prompt to its first token (the client's embedding and head
included, a few ms); the ratio is one node's TTFT over the variant's. Goal: spread >= 1.6x.
The default model holds 8192 positions: a longer --tokens is cut to fit.

    .venv/bin/python scripts/bench_spread.py [--tokens 16384] [--variants one,one-pass,spread]
"""

from __future__ import annotations

import argparse
import os
from datetime import date

import bench  # noqa: F401  (first: OpenMP's wait policy, a node's, before torch loads)
from bench.local import LocalSwarm
from bench.proc import cpu_name
from bench.table import print_table
from bench.timing import session_greedy

from swarm.client.client import Client
from swarm.model.source import default_model_path, open_model

VARIANTS = ("one", "one-pass", "spread")


def token_ids(n: int, vocab: int) -> list[int]:
    """A prompt of `n` spread token ids within the vocabulary (no tokenizer needed)."""
    return [(i * 7919) % (vocab - 200) + 100 for i in range(n)]


def ttft(variant: str, layers: int, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, that token) of `prompt` on a fresh swarm of `variant`."""
    room = str(len(prompt) + 64)
    extra = ["--threads", "1", "--max-session-tokens", room, "--max-cache-tokens", room]
    extra += ["--max-host-cache-tokens", room]
    if variant == "one-pass":
        extra += ["--prefill-pass-tokens", room]
    with LocalSwarm() as swarm:
        swarm.node((0, layers), extra=extra)
        if variant == "spread":
            swarm.node((0, layers), extra=[*extra, "--spread-prompt-tokens", "4096"])
        client = Client(swarm.peers, model=str(default_model_path()))
        try:
            session_greedy(client, prompt[:32], 1)  # warm: connections, the lane's first pass
            times = session_greedy(client, prompt, 0)
        finally:
            client.close()
    return times.ttft, times.tokens[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="prompt tokens")
    p.add_argument("--variants", type=lambda s: s.split(","), default=list(VARIANTS))
    a = p.parse_args()
    config = open_model(str(default_model_path())).config
    tokens = min(a.tokens, config.max_position - 2)  # the prompt and its first token
    if tokens < a.tokens:
        print(f"{config.name} holds {config.max_position} positions: a {tokens}-token prompt")
    prompt = token_ids(tokens, config.vocab)
    load = os.getloadavg()
    times = {}
    for variant in a.variants:
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}: one of {VARIANTS}")
        times[variant] = ttft(variant, config.num_layers, prompt)
        print(f"  {variant}: TTFT {times[variant][0]:.1f} s, first token {times[variant][1]}")
    base = times.get("one", (None,))[0]
    rows = []
    for variant, (seconds, token) in times.items():
        ratio = f"{base / seconds:.2f}x" if base else "-"
        goal = ""
        if variant == "spread" and base:
            goal = f">=1.6x {'met' if base / seconds >= 1.6 else 'MISSED'}"
        rows.append([variant, f"{seconds:.1f}", ratio, str(token), goal])
    print(f"\n{date.today()}, {cpu_name()}, {os.cpu_count()} CPUs, load before {load[0]:.2f}")
    print(f"default model, {tokens}-token prompt, loopback, --threads 1 a node")
    print_table(["variant", "TTFT s", "x one node", "first token", "goal"], rows)


if __name__ == "__main__":
    main()
