"""python -m swarm.client "prompt" --initial-peers MULTIADDR ..."""

from __future__ import annotations

# ruff: noqa: E402 (the imports below load torch: OpenMP's policy must be set before)
from swarm.process import wait_passively

wait_passively()

import argparse
import logging
import sys
import time

from swarm.cli import initial_peers_option, setup_logging
from swarm.client.client import Client
from swarm.client.options import ClientOptions, Sampling
from swarm.errors import SwarmError
from swarm.options import add_fields, add_options, from_args, option, positive_int


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m swarm.client", description="Ask the swarm.")
    p.add_argument("prompt")
    add_options(p, initial_peers=initial_peers_option())
    add_fields(p.add_argument_group("client"), ClientOptions)
    reply = p.add_argument_group("reply")
    add_options(
        reply,
        max_new_tokens=option(128, "most tokens the reply may have", type=positive_int),
        stop=option(
            (),
            "end the reply where it would write this (repeat for more)",
            action="append",
            metavar="TEXT",
        ),
    )
    add_fields(reply, Sampling)
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    setup_logging(logging.INFO if a.verbose else logging.WARNING)
    client = Client(a.initial_peers, from_args(ClientOptions, a))
    prompt = a.prompt if a.raw else [{"role": "user", "content": a.prompt}]
    try:
        t0 = time.perf_counter()
        first = None
        sampling = vars(from_args(Sampling, a))
        reply = client.stream(prompt, a.max_new_tokens, a.stop, **sampling)
        for piece in reply:
            first = first or time.perf_counter()
            print(piece, end="", flush=True)
        print()
        total = time.perf_counter() - t0
        tokens = len(reply.tokens)
        drafts = reply.speculation
        said = f"; drafts {drafts.accepted}/{drafts.proposed} accepted" if drafts else ""
        if first and tokens > 1:
            print(
                f"[{tokens} tokens; first after {first - t0:.2f} s;"
                f" {(tokens - 1) / (time.perf_counter() - first):.1f} tokens/s after{said}]",
                file=sys.stderr,
            )
        else:
            print(f"[{tokens} tokens in {total:.2f} s{said}]", file=sys.stderr)
    except SwarmError as exc:
        print(f"\nerror: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
