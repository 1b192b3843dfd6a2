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
from swarm.health.app import create_app
from swarm.health.state import Collector, CollectorConfig
from swarm.http_server import serve
from swarm.options import add_options, option


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m swarm.health",
        description="Serve the public swarm health page: joins the DHT as a client, pings nodes.",
    )
    add_options(p, initial_peers=initial_peers_option())
    add_http_flags(p, host="0.0.0.0", port=8080)
    c = CollectorConfig  # the class holds each field's default: the flags' defaults
    add_options(
        p,
        dht_host=option(c.dht_host, "address the DHT peer listens on"),
        interval=option(c.interval, "seconds between DHT reads and pings", metavar="SECONDS"),
        refresh=option(10, "seconds after which the page reloads itself", metavar="SECONDS"),
        dht_timeout=option(
            c.dht_timeout, "give up on one DHT read after this many seconds", metavar="SECONDS"
        ),
        ping_timeout=option(
            c.ping_timeout,
            "mark a node unreachable if it does not answer within this many seconds",
            metavar="SECONDS",
        ),
        forget_after=option(
            c.forget_after, "seconds an expired node stays listed", metavar="SECONDS"
        ),
    )
    return p


async def run(args: argparse.Namespace) -> None:
    collector = Collector(
        CollectorConfig(
            initial_peers=tuple(args.initial_peers),
            dht_host=args.dht_host,
            interval=args.interval,
            dht_timeout=args.dht_timeout,
            ping_timeout=args.ping_timeout,
            forget_after=args.forget_after,
        )
    )
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
