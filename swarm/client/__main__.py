"""python -m swarm.client "prompt" --initial-peers MULTIADDR ..."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from swarm.cli import add_swarm_flags, setup_logging
from swarm.client.client import Client
from swarm.errors import SwarmError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m swarm.client", description="Ask the swarm.")
    p.add_argument("prompt")
    add_swarm_flags(p)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    setup_logging(logging.INFO if a.verbose else logging.WARNING)
    client = Client(a.initial_peers, model=a.model, wire_dtype=a.wire_dtype)
    prompt = a.prompt if a.raw else [{"role": "user", "content": a.prompt}]
    try:
        t0 = time.perf_counter()
        first = None
        reply = client.stream(
            prompt,
            max_new_tokens=a.max_new_tokens,
            temperature=a.temperature,
            top_p=a.top_p,
            top_k=a.top_k,
            seed=a.seed,
        )
        for piece in reply:
            first = first or time.perf_counter()
            print(piece, end="", flush=True)
        print()
        total = time.perf_counter() - t0
        tokens = len(reply.tokens)
        if first and tokens > 1:
            print(
                f"[{tokens} tokens; first after {first - t0:.2f} s;"
                f" {(tokens - 1) / (time.perf_counter() - first):.1f} tokens/s after]",
                file=sys.stderr,
            )
        else:
            print(f"[{tokens} tokens in {total:.2f} s]", file=sys.stderr)
    except SwarmError as exc:
        print(f"\nerror: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
