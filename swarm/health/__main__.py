"""python -m swarm.health --initial-peers MULTIADDR... [--host 0.0.0.0] [--port 8080]"""

from __future__ import annotations

import argparse
import signal
import sys

import trio

from swarm.cli import (
    add_http_flags,
    connection_limits,
    hypercorn_config,
    initial_peers_option,
    setup_logging,
)
from swarm.health.app import PAGE_REFRESH_S, create_app
from swarm.health.state import Collector, CollectorConfig
from swarm.http_server import serve
from swarm.options import add_fields, add_options, from_args, option, positive_int


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m swarm.health",
        description="Serve the public swarm health page: joins the DHT as a client, pings nodes.",
    )
    add_options(p, initial_peers=initial_peers_option())
    add_http_flags(p, host="0.0.0.0", port=8080)
    add_fields(p, CollectorConfig)
    add_options(
        p,
        refresh=option(
            PAGE_REFRESH_S,
            "seconds after which the page reloads itself",
            type=positive_int,
            metavar="SECONDS",
        ),
    )
    return p


async def run(args: argparse.Namespace) -> None:
    collector = Collector(from_args(CollectorConfig, args, initial_peers=tuple(args.initial_peers)))
    app = create_app(
        lambda: collector.snapshot,
        refresh_seconds=args.refresh,
        stale_after=collector.config.stale_after,
    )
    async with trio.open_nursery() as nursery:
        config = hypercorn_config(args.host, args.port, args.access_log)
        binds = await nursery.start(serve, app, config, connection_limits(args))
        for url in binds:
            print(f"health page on {url}/", flush=True)
        await nursery.start(collector.run)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                break
        nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    trio.run(run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
