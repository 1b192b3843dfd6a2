"""python -m swarm.api --initial-peers MULTIADDR... [--host 127.0.0.1] [--port 8000]"""

from __future__ import annotations

# ruff: noqa: E402 (the imports below load torch: OpenMP's policy must be set before)
from swarm.process import wait_passively

wait_passively()

import argparse
import os
import signal
import sys
from dataclasses import dataclass

import trio

from swarm.api.app import create_app
from swarm.api.fair import FairSlots
from swarm.api.generation import Backend
from swarm.cli import (
    add_http_flags,
    connection_limits,
    hypercorn_config,
    initial_peers_option,
    setup_logging,
)
from swarm.client.client import Client
from swarm.client.options import ClientOptions
from swarm.http_server import serve
from swarm.options import (
    add_fields,
    add_options,
    from_args,
    non_negative_float,
    option,
    positive_int,
)

KEY_ENV = "SWARM_API_KEY"


@dataclass(frozen=True)
class ApiOptions:
    """How the API server shares its one Client among requests."""

    api_key: str | None = option(
        None, f"require 'Authorization: Bearer KEY' on /v1 (default: ${KEY_ENV}; unset: open)"
    )
    # requests, not sessions: a node's --max-sessions counts every client's sessions
    max_requests: int = option(
        16,
        "requests generating at once; more wait their turn (a node gives one address 16 sessions)",
        type=positive_int,
    )
    max_caller_requests: int = option(
        8,
        "of those, the most one caller (source address) holds; a freed slot goes to the"
        " waiting caller holding fewest",
        type=positive_int,
    )
    idle_timeout_s: float = option(
        15.0,
        "close a connection that has no request under way for this long: kept alive"
        " between requests, or still sending its headers (so slow clients cannot pile up)",
        flag="--idle-timeout",
        type=non_negative_float,
    )
    default_max_tokens: int = option(
        512,
        "reply length when a chat request names none (clipped to the context left)",
        type=positive_int,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m swarm.api",
        description="Serve an OpenAI-compatible API and a chat page: joins the DHT as a client.",
    )
    add_options(p, initial_peers=initial_peers_option())
    add_fields(p.add_argument_group("client"), ClientOptions)
    add_http_flags(p, host="127.0.0.1", port=8000)
    add_fields(p, ApiOptions)
    return p


async def run(args: argparse.Namespace, client: Client) -> None:
    api = from_args(ApiOptions, args)
    try:
        slots = FairSlots(api.max_requests, min(api.max_caller_requests, api.max_requests))
        backend = Backend(client, slots, api.default_max_tokens)
        api_key = api.api_key if api.api_key is not None else os.environ.get(KEY_ENV)
        app = create_app(backend, api_key=api_key or None)
        async with trio.open_nursery() as nursery:
            # a reply may take minutes between request and last byte; only a connection
            # without a request under way (idle, or its headers still trickling in) times out
            config = hypercorn_config(
                args.host, args.port, args.access_log, keep_alive_s=api.idle_timeout_s
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
    client = Client(args.initial_peers, from_args(ClientOptions, args))
    trio.run(run, args, client)
    return 0


if __name__ == "__main__":
    sys.exit(main())
