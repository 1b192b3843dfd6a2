"""python -m swarm.node [--layers START:END | --num-blocks N] [--initial-peers MULTIADDR ...]"""

from __future__ import annotations

import functools
import logging
import random
import signal
import sys
import time
from functools import partial

import torch
import trio

from swarm.address import join_host_port
from swarm.cli import setup_logging
from swarm.dht import read_nodes, start_dht, visible_maddrs
from swarm.errors import SwarmError
from swarm.model.blocks import KVCache, Span
from swarm.model.linear import usable_formats
from swarm.model.source import open_model
from swarm.node.announce import Announcer
from swarm.node.config import NodeConfig, parse_args
from swarm.node.directory import PeerDirectory
from swarm.node.observer import StepObserver
from swarm.node.placement import (
    better_span,
    blocks_for_memory,
    choose_span,
    coverage,
    gaps,
    settled_span,
)
from swarm.node.server import Node
from swarm.node.status import log_status, status_of
from swarm.records import format_blocks
from swarm.relay import check_reachable, stay_relayed
from swarm.tls import Identity

log = logging.getLogger("swarm.node")
SETTLE_S = 2.0  # how long a node without --layers lets simultaneous choices reach the DHT


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
    if not cfg.automatic_span:
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
        usable = await trio.to_thread.run_sync(usable_formats, say)
        if cfg.automatic_span:
            span_range = await choose_first_span(cfg, source, dht, usable)
        else:
            span_range = (cfg.start, cfg.end)
        serving = Serving(cfg, source, fingerprint, dht, addr, usable, observer)
        settle = cfg.automatic_span  # the first choice may race a node choosing at once
        while span_range is not None:
            span_range = await serving.serve(span_range, listeners, t0, settle)
            settle = False
            if span_range is not None:  # moved: the next span listens on the same port
                listeners = await trio.open_tcp_listeners(port, host=cfg.host)
                t0 = time.perf_counter()
        say("node stopped")
    finally:
        dht.shutdown()


async def choose_first_span(cfg: NodeConfig, source, dht, usable) -> tuple[int, int]:
    """Where a node started without --layers goes: the thinnest window of the swarm, as wide as
    --num-blocks or as its memory allows."""
    num_layers = source.config.num_layers
    blocks = cfg.num_blocks or await trio.to_thread.run_sync(blocks_that_fit, cfg, source, usable)
    records = await read_records(dht, source.config)
    span = choose_span(coverage(records, num_layers), min(blocks, num_layers))
    said = f"{len(records)} other node{'s' if len(records) != 1 else ''} announced"
    thin = gaps(coverage(records, num_layers))
    said += f"; blocks nobody serves: {format_blocks(thin)}" if thin else "; every block is served"
    say(f"choosing blocks: {said}; taking {span[0]}:{span[1]} ({span[1] - span[0]} blocks)")
    return span


def blocks_that_fit(cfg: NodeConfig, source, usable) -> int:
    """Blocks whose weights and KV cache fit --max-memory, or 3/4 of the memory free now."""
    probe = Span.load(source, 0, 1, weights=cfg.weights, usable=usable)
    block_bytes = probe.nbytes
    cache = KVCache.bytes_per_token(source.config, 1, probe.cache_dtype)
    cache_bytes = cfg.limits.max_cache_tokens * cache
    if cfg.max_memory_mb is not None:
        budget = int(cfg.max_memory_mb * 2**20)
    else:
        budget = int(available_memory() * 0.75)
    n = blocks_for_memory(block_bytes, cache_bytes, budget)
    say(
        f"a block takes {block_bytes / 2**20:.1f} MiB of weights and {cache_bytes / 2**20:.1f}"
        f" MiB of cache; {budget / 2**20:.0f} MiB allow {n}"
    )
    return n


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2**30  # unknown: a modest share


async def read_records(dht, config) -> list:
    records, _exp, _bad = await trio.to_thread.run_sync(
        read_nodes, dht, config.name, config.num_layers, abandon_on_cancel=True
    )
    return records


class Serving:
    """A node's life on one span after another: load, announce, serve; with an automatic span,
    watch the swarm and move (after draining) when that fills a gap nobody else would."""

    def __init__(self, cfg, source, fingerprint, dht, addr, usable, observer):
        self.cfg, self.source, self.fingerprint, self.dht = cfg, source, fingerprint, dht
        self.addr, self.usable, self.observer = addr, usable, observer
        # one key for the node's life: a moved node keeps its identity
        self.identity = None if cfg.plaintext else Identity.generate()

    def _announcer(self, start: int, end: int) -> Announcer:
        config = self.source.config
        return Announcer(
            self.dht,
            str(self.dht.peer_id),
            self.addr,
            config.name,
            config.num_layers,
            self.fingerprint,
            start,
            end,
            self.cfg.limits.announce_ttl_s,
            tls=self.identity.key_id if self.identity else "",
        )

    async def _settle(self, span_range: tuple[int, int]) -> tuple[int, int]:
        """Nodes started at the same moment may choose the same blocks, each before the other's
        record arrived: after announcing, look again; where a node with a lower peer id chose
        overlapping blocks, it keeps them and this one chooses again."""
        await trio.sleep(SETTLE_S + random.random())
        config = self.source.config
        records = await read_records(self.dht, config)
        again, rival = settled_span(records, str(self.dht.peer_id), span_range, config.num_layers)
        if again != span_range:
            say(
                f"choosing again: {rival.peer[-8:]} chose {rival.start}:{rival.end} at the same"
                f" time; taking {again[0]}:{again[1]}"
            )
        return again

    async def serve(self, span_range: tuple[int, int], listeners, t0: float, settle: bool = False):
        """Serve `span_range` until a signal (returns None) or a move (returns the new span)."""
        cfg, source = self.cfg, self.source
        announcer = self._announcer(*span_range)
        await announcer.publish("joining")
        if settle and (again := await self._settle(span_range)) != span_range:
            span_range = again
            announcer = self._announcer(*span_range)
            await announcer.publish("joining")
        start, end = span_range

        def progress(done: int, total: int) -> None:
            say(f"loading blocks {start}:{end}: {done}/{total}")

        span = await trio.to_thread.run_sync(
            partial(Span.load, source, start, end, progress, cfg.weights, self.usable)
        )
        directory = PeerDirectory.of_dht(
            self.dht, source.config.name, source.config.num_layers, plaintext=cfg.plaintext
        )
        node = Node(
            cfg, span, self.fingerprint, self.observer, directory=directory, identity=self.identity
        )
        node.compute.decode_step_seconds = await trio.to_thread.run_sync(measure_throughput, span)
        formats = ", ".join(f"{n} {fmt}" for fmt, n in span.formats.items())
        say(
            f"loaded blocks {start}:{end} of {source.config.name} as {span.format}"
            f" ({formats} matrices; {span.nbytes / (end - start) / 2**20:.1f} MiB a"
            f" layer; fingerprint {self.fingerprint}) in {time.perf_counter() - t0:.1f} s;"
            f" ~{node.throughput:.0f} tokens/s"
        )
        moved: list[tuple[int, int]] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(node.serve, listeners)
            await self._reach(node, announcer, nursery)
            via = f", relayed by {announcer.relay}" if announcer.relay else ""
            secured = f"TLS key {self.identity.key_id}" if self.identity else "PLAINTEXT"
            say(
                f"serving blocks {start}:{end} on {announcer.addr} (peer {self.dht.peer_id}),"
                f" {secured}{via}"
            )
            nursery.start_soon(announcer.keep_fresh, functools.partial(status_of, node))
            nursery.start_soon(log_status, functools.partial(status_of, node))
            if cfg.automatic_span and cfg.rebalance_s > 0:
                nursery.start_soon(self._watch, node, announcer, span_range, moved, nursery)
            await shutdown_on_signal(node, announcer, cfg.limits.grace_s)
            nursery.cancel_scope.cancel()
        return moved[0] if moved else None

    async def _reach(self, node: Node, announcer: Announcer, nursery) -> None:
        """Find out whether others can dial this node; if not (or --relay always), serve
        through a relay, announcing its address."""
        cfg = self.cfg
        if self.identity is None or cfg.relay == "never":
            return
        me = str(self.dht.peer_id)
        config = self.source.config
        if cfg.relay == "auto":
            records = await read_records(self.dht, config)
            reachable, why = await check_reachable(self.addr, self.identity.key_id, me, records)
            if reachable is None:
                announcer.reach = "unknown"
                say(f"reachability: unknown ({why}); serving directly at {self.addr}")
                return
            if reachable:
                announcer.reach = "direct"
                say(f"reachability: direct ({why})")
                return
            say(f"reachability: others cannot dial {self.addr} ({why}); looking for a relay")
        else:
            say("reachability: not checked (--relay always); looking for a relay")
        node.relay_hub.capacity = 0  # nobody can reach a relay behind a relay
        announcer.reach = "relayed"
        direct = self.addr
        first = trio.Event()

        async def relayed_by(record) -> None:
            announcer.addr = record.addr if record else direct
            announcer.relay = record.peer if record else ""
            first.set()
            if record is not None:
                await announcer.publish("online", status_of(node))

        async def candidates():
            return await read_records(self.dht, config)

        nursery.start_soon(stay_relayed, me, candidates, relayed_by, node.accept_relayed, say)
        with trio.move_on_after(30):
            await first.wait()

    async def _watch(self, node, announcer, current, moved, nursery) -> None:
        config = self.source.config
        me = str(self.dht.peer_id)
        while True:
            await trio.sleep(self.cfg.rebalance_s)
            records = await read_records(self.dht, config)
            target = better_span(records, me, current, config.num_layers)
            if target is None:
                continue
            thin = format_blocks(gaps(coverage(records, config.num_layers, frozenset({me}))))
            say(
                f"moving from blocks {current[0]}:{current[1]} to {target[0]}:{target[1]}:"
                f" nobody serves {thin} and others still serve ours; draining"
                f" {len(node.sessions)} sessions first"
            )
            node.stop_accepting()
            await announcer.publish("offline", status_of(node), ttl=max(announcer.ttl, 10))
            with trio.move_on_after(self.cfg.limits.grace_s):
                while len(node.sessions):
                    await trio.sleep(0.2)
            moved.append(target)
            nursery.cancel_scope.cancel()
            return


async def shutdown_on_signal(node: Node, announcer: Announcer, grace: float) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            say(f"received {signal.Signals(signum).name}: going offline, refusing new sessions")
            node.stop_accepting()
            await announcer.publish("offline", status_of(node), ttl=max(announcer.ttl, 10))
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
    setup_logging()
    torch.set_num_threads(cfg.threads)
    try:
        trio.run(run, cfg, observer)
    except (SwarmError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
