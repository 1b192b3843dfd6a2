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
The default model holds 8192 positions: a longer --tokens is cut to fit. `--synthetic-layers N`
runs N synthetic blocks instead (scripts/synthetic_gguf.py, written with room for the prompt,
kept in --files), so a 16k prompt fits: Llama-3-8B-shaped Q4_K ones, or with --shape 135m the
default model's shape in Q4_1. The replica's rows of a layer wait for the owner's keys of that
layer, so the two overlap layer by layer: a span of L blocks gains at most 2 - 1/L.

    .venv/bin/python scripts/bench_spread.py [--tokens 16384] [--variants one,one-pass,spread]
        [--synthetic-layers 2 --files DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from datetime import date
from pathlib import Path

import bench  # noqa: F401  (first: OpenMP's wait policy, a node's, before torch loads)
from bench.local import LocalSwarm
from bench.proc import cpu_name
from bench.table import print_table
from bench.timing import session_greedy

from swarm.client.client import Client
from swarm.model.source import default_model_path, open_model

VARIANTS = ("one", "one-pass", "spread")


# --shape: Llama-3-8B's blocks in Q4_K, or the default model's (SmolLM2-135M's) in Q4_1
SHAPES = {
    "8b": ({}, "Q4_K"),
    "135m": (dict(hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64), "Q4_1"),
}


def long_file(folder: str, shape: str, layers: int, context: int):
    """folder/SHAPE-LAYERS-CONTEXT.QTYPE.gguf: blocks of `shape` holding `context` positions."""
    from synthetic_gguf import Shapes, write_synthetic_gguf

    dims, qtype = SHAPES[shape]
    path = Path(folder) / f"{shape}-{layers}-{context}.{qtype}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synthetic_gguf(path, Shapes(**dims, layers=layers, context=context), qtype)
    return path


def token_ids(n: int, vocab: int) -> list[int]:
    """A prompt of `n` spread token ids within the vocabulary (no tokenizer needed)."""
    return [(i * 7919) % (vocab - 200) + 100 for i in range(n)]


def ttft(variant: str, model: str, layers: int, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, that token) of `prompt` on a fresh swarm of `variant`."""
    room = str(len(prompt) + 512)  # a session keeps whole blocks of the cache
    extra = ["--threads", "1", "--max-session-tokens", room, "--max-cache-tokens", room]
    extra += ["--model", model]
    extra += ["--max-host-cache-tokens", room, "--max-forwarded-cache-tokens", room]
    if variant == "one-pass":
        extra += ["--prefill-pass-tokens", room]
    with LocalSwarm() as swarm:
        swarm.node((0, layers), extra=extra)
        if variant == "spread":
            swarm.node((0, layers), extra=[*extra, "--spread-prompt-tokens", "4096"])
        client = Client(swarm.peers, model=model)
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
    p.add_argument("--synthetic-layers", type=int, default=0, help="synthetic blocks; 0: none")
    p.add_argument("--shape", choices=SHAPES, default="8b", help="the synthetic blocks' shape")
    p.add_argument("--files", default=None, help="keep the 8B-shaped file here")
    a = p.parse_args()
    model = str(default_model_path())
    if a.synthetic_layers:
        folder = a.files or tempfile.mkdtemp()
        model = str(long_file(folder, a.shape, a.synthetic_layers, a.tokens + 64))
    config = open_model(model).config
    tokens = min(a.tokens, config.max_position - 2)  # the prompt and its first token
    if tokens < a.tokens:
        print(f"{config.name} holds {config.max_position} positions: a {tokens}-token prompt")
    prompt = token_ids(tokens, config.vocab)
    load = os.getloadavg()
    times = {}
    for variant in a.variants:
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}: one of {VARIANTS}")
        times[variant] = ttft(variant, model, config.num_layers, prompt)
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
    print(f"{config.name}, {tokens}-token prompt, loopback, --threads 1 a node")
    print_table(["variant", "TTFT s", "x one node", "first token", "goal"], rows)


if __name__ == "__main__":
    main()
