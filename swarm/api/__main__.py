"""python -m swarm.api --initial-peers MULTIADDR... [--host 127.0.0.1] [--port 8000]"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import trio

from swarm.api.app import create_app
from swarm.api.fair import FairSlots
from swarm.api.generation import Backend
from swarm.cli import (
    add_http_flags,
    add_swarm_flags,
    connection_limits,
    hypercorn_config,
    setup_logging,
)
from swarm.client.client import Client
from swarm.http_server import serve
from swarm.options import non_negative_float, positive_int

KEY_ENV = "SWARM_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m swarm.api",
        description="Serve an OpenAI-compatible API and a chat page: joins the DHT as a client.",
    )
    add_swarm_flags(p)
    add_http_flags(p, host="127.0.0.1", port=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get(KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${KEY_ENV}; unset: open)",
    )
    p.add_argument(
        "--max-sessions",
        type=positive_int,
        default=16,
        help="requests generating at once; more wait their turn (a node gives one address 16)",
    )
    p.add_argument(
        "--max-caller-sessions",
        type=positive_int,
        default=8,
        help="of those, the most one caller (source address) holds; a freed slot goes to the"
        " waiting caller holding fewest",
    )
    p.add_argument(
        "--idle-timeout",
        type=non_negative_float,
        default=15.0,
        metavar="SECONDS",
        help="close a connection that has no request under way for this long: kept alive"
        " between requests, or still sending its headers (so slow clients cannot pile up)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=512,
        help="reply length when a chat request names none (clipped to the context left)",
    )
    return p


async def run(args: argparse.Namespace, client: Client) -> None:
    try:
        slots = FairSlots(args.max_sessions, min(args.max_caller_sessions, args.max_sessions))
        backend = Backend(client, slots, args.default_max_tokens)
        app = create_app(backend, api_key=args.api_key or None)
        async with trio.open_nursery() as nursery:
            # a reply may take minutes between request and last byte; only a connection
            # without a request under way (idle, or its headers still trickling in) times out
            config = hypercorn_config(
                args.host, args.port, args.access_log, keep_alive_s=args.idle_timeout
            )
            binds = await nursery.start(serve, app, config, connection_limits(args))
            for url in binds:
                print(f"api on {url}/v1 serving {backend.name}; chat page on {url}/", flush=True)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    break
            nursery.cancel_scope.cancel()
    finally:
        client.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    # before trio starts its threads: the client forks its DHT process, and a fork from a
    # process with threads running can leave the child holding another thread's locks
    client = Client(args.initial_peers, model=args.model, wire_dtype=args.wire_dtype)
    trio.run(run, args, client)
    return 0


if __name__ == "__main__":
    sys.exit(main())
