"""python -m swarm.node --layers START:END [--initial-peers MULTIADDR ...]"""

from __future__ import annotations

import functools
import logging
import signal
import sys
import time
from functools import partial

import torch
import trio

from swarm.address import join_host_port
from swarm.dht import start_dht, visible_maddrs
from swarm.errors import SwarmError
from swarm.model.blocks import Span
from swarm.model.linear import usable_formats
from swarm.model.source import open_model
from swarm.node.announce import Announcer
from swarm.node.config import NodeConfig, parse_args
from swarm.node.observer import StepObserver
from swarm.node.server import Node
from swarm.node.status import Status, log_status

log = logging.getLogger("swarm.node")


def say(text: str) -> None:
    print(text, flush=True)


def measure_throughput(span: Span) -> float:
    """Seconds per one-token decode step through the whole span, after a warm-up."""
    cache = span.allocate_cache(span.end - span.start, 16)
    h = torch.zeros(1, 1, span.config.hidden)
    times = []
    for pos in range(4):
        t = time.perf_counter()
        span.forward(h, cache, pos, span.start, span.end)
        times.append(time.perf_counter() - t)
    return min(times[1:])


async def run(cfg: NodeConfig, observer: StepObserver | None = None) -> None:
    t0 = time.perf_counter()
    source = open_model(cfg.model)
    source.config.check_span(cfg.start, cfg.end)
    fingerprint = source.fingerprint()
    dht = start_dht(cfg.initial_peers, host=cfg.dht_host, nice=cfg.dht_nice)
    try:
        if not cfg.initial_peers:
            say("started a new swarm; others join with:")
        for maddr in visible_maddrs(dht):
            say(f"  --initial-peers {maddr}")
        listeners = await trio.open_tcp_listeners(cfg.port, host=cfg.host)
        port = listeners[0].socket.getsockname()[1]
        addr = cfg.public_address or join_host_port(cfg.host, port)
        announcer = Announcer(
            dht,
            str(dht.peer_id),
            addr,
            source.config.name,
            source.config.num_layers,
            fingerprint,
            cfg.start,
            cfg.end,
            cfg.limits.announce_ttl_s,
        )
        await announcer.publish("joining")

        def progress(done: int, total: int) -> None:
            say(f"loading blocks {cfg.start}:{cfg.end}: {done}/{total}")

        usable = await trio.to_thread.run_sync(usable_formats, say)
        span = await trio.to_thread.run_sync(
            partial(Span.load, source, cfg.start, cfg.end, progress, cfg.weights, usable)
        )
        node = Node(cfg, span, fingerprint, observer)
        node.compute.decode_step_seconds = await trio.to_thread.run_sync(measure_throughput, span)
        formats = ", ".join(f"{n} {fmt}" for fmt, n in span.formats.items())
        say(
            f"loaded blocks {cfg.start}:{cfg.end} of {source.config.name} as {span.format}"
            f" ({formats} matrices; {span.nbytes / (cfg.end - cfg.start) / 2**20:.1f} MiB a"
            f" layer; fingerprint {fingerprint}) in {time.perf_counter() - t0:.1f} s;"
            f" ~{node.throughput:.0f} tokens/s"
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(node.serve, listeners)
            say(f"serving blocks {cfg.start}:{cfg.end} on {addr} (peer {dht.peer_id})")
            nursery.start_soon(announcer.keep_fresh, node)
            nursery.start_soon(log_status, functools.partial(status, node))
            await shutdown_on_signal(node, announcer, cfg.limits.grace_s)
            nursery.cancel_scope.cancel()
        say("node stopped")
    finally:
        dht.shutdown()


def status(node: Node) -> Status:
    t = node.throttle
    return Status(
        len(node.sessions),
        node.sessions.free_cache_tokens,
        node.tokens_done,
        node.uplink.stats(),
        t.refused,
        t.evicted,
        len(t.hosts),
    )


async def shutdown_on_signal(node: Node, announcer: Announcer, grace: float) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            say(f"received {signal.Signals(signum).name}: going offline, refusing new sessions")
            node.stop_accepting()
            await announcer.publish("offline", node, ttl=max(announcer.ttl, 10))
            with trio.move_on_after(grace):
                async for _ in _ticks(0.2):
                    if len(node.sessions) == 0:
                        break
            if len(node.sessions):
                say(f"grace period over; closing {len(node.sessions)} sessions")
            return


async def _ticks(interval: float):
    while True:
        yield
        await trio.sleep(interval)


def main(argv: list[str] | None = None, observer: StepObserver | None = None) -> int:
    """Run a node until SIGINT or SIGTERM; `observer`: a benchmark's hook (see observer.py)."""
    cfg = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    torch.set_num_threads(cfg.threads)
    try:
        trio.run(run, cfg, observer)
    except (SwarmError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
