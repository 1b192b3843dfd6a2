"""python -m swarm.health --initial-peers MULTIADDR... [--host 0.0.0.0] [--port 8080]"""

from __future__ import annotations

import argparse
import signal
import sys

import trio
from hypercorn.trio import serve

from swarm.cli import add_http_flags, hypercorn_config, initial_peers_option, setup_logging
from swarm.health.app import create_app
from swarm.health.state import Collector, CollectorConfig
from swarm.options import add_options


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m swarm.health",
        description="Serve the public swarm health page: joins the DHT as a client, pings nodes.",
    )
    add_options(p, initial_peers=initial_peers_option())
    add_http_flags(p, host="0.0.0.0", port=8080)
    p.add_argument("--dht-host", default="127.0.0.1", help="address the DHT peer listens on")
    p.add_argument(
        "--interval", type=float, default=5.0, help="seconds between DHT reads and pings"
    )
    p.add_argument(
        "--refresh", type=int, default=10, help="seconds after which the page reloads itself"
    )
    p.add_argument(
        "--dht-timeout",
        type=float,
        default=15.0,
        help="give up on one DHT read after this many seconds",
    )
    p.add_argument(
        "--ping-timeout",
        type=float,
        default=3.0,
        help="mark a node unreachable if it does not answer within this many seconds",
    )
    p.add_argument(
        "--forget-after", type=float, default=600.0, help="seconds an expired node stays listed"
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
        binds = await nursery.start(
            serve, app, hypercorn_config(args.host, args.port, args.access_log)
        )
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
