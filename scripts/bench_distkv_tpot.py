"""Decode TPOT of a session with about half its KV cache borrowed from a `--role cache` node,
beside the same session unborrowed (issue #52's first figure; the full bench_distkv.py is to
come): one node serving every block of the default model, loopback, the client in this process.
Rounds alternate (a fresh swarm each), medians, the ratio.

    .venv/bin/python scripts/bench_distkv_tpot.py [--context 1024] [--new 64] [--repeats 2]

Borrowed: the node's --max-cache-tokens is one less than the session, so it keeps half its
cache (swarm.node.borrow.local_tokens) and lends the rest; each decode step then asks the lender
once per layer (30 round trips a token for the default model).
"""

from __future__ import annotations

import argparse
import statistics

import bench  # noqa: F401  (first: OpenMP's wait policy, a node's, before torch loads)
from bench.local import LocalSwarm
from bench.proc import cpu_name
from bench.timing import session_greedy

from swarm.client.client import Client
from swarm.model.source import default_model_path, open_model


def tpot(model: str, layers: int, prompt: list[int], new: int, borrow: bool) -> float:
    """Median seconds a decode step of one session after `prompt`, on a fresh local swarm."""
    session = len(prompt) + new + 1
    extra = ["--threads", "1"]
    if borrow:
        extra += ["--max-cache-tokens", str(session - 1)]
    with LocalSwarm() as swarm:
        swarm.node((0, layers), extra=[*extra, "--model", model])
        if borrow:
            swarm.node(None, extra=["--role", "cache", "--model", model])
        client = Client(swarm.peers, model=model)
        try:
            session_greedy(client, prompt[:32], 4)  # warm: connections, the lane's first pass
            times = session_greedy(client, prompt, new)
        finally:
            client.close()
    gaps = times.gaps(lo=times.decode_start)
    return statistics.median(gaps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=1024, help="prompt tokens")
    p.add_argument("--new", type=int, default=64, help="decode steps timed")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    model = str(default_model_path())
    config = open_model(model).config
    prompt = [(i * 7919) % 40000 + 100 for i in range(args.context)]
    rows: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):
        for borrow in (False, True):
            rows[borrow].append(tpot(model, config.num_layers, prompt, args.new, borrow))
            print(f"  {'borrowed' if borrow else 'unborrowed'}: {rows[borrow][-1] * 1e3:.1f} ms")
    plain, lent = statistics.median(rows[False]), statistics.median(rows[True])
    print(
        f"{config.name}, {config.num_layers} layers, {args.context} tokens of context, {cpu_name()}"
    )
    print(f"decode TPOT unborrowed {plain * 1e3:.1f} ms, ~50% borrowed {lent * 1e3:.1f} ms:")
    print(f"ratio {lent / plain:.2f}x (loopback, --threads 1)")


if __name__ == "__main__":
    main()
