"""A node's life: start (its DHT peer, listeners, the blocks it serves), serve a span, and with
an automatic span move to another when the swarm needs it there.

    run: start, first span ─> serve(span) ─> Stop ─> "node stopped"
                                 ^      │
                                 └──────┘ Move: serve the target on the same port

`serve` joins (announces, settles a simultaneous choice), loads, starts the data plane, checks
reachability, then keeps the node announced until it has a reason to leave: a signal (`Stop`)
or, with an automatic span, a better span (`Move`, from `watch_for_move`). Leaving drains,
for a move and a shutdown alike (`drain`): refuse new sessions, announce offline, and give the
open ones the grace period.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import trio

from swarm.address import join_host_port
from swarm.dht import NodeKey, read_nodes, start_dht, visible_maddrs
from swarm.model.blocks import Span
from swarm.model.source import GGUFSource, SafetensorsSource, open_model
from swarm.model.usable import usable_formats
from swarm.node.announce import Announcer
from swarm.node.cache_role import serve_cache
from swarm.node.config import NodeConfig
from swarm.node.directory import PeerDirectory
from swarm.node.handover.send import hand_over_all
from swarm.node.lend_leave import tell_borrowers, until_handed_on
from swarm.node.measure import Fit, blocks_that_fit, measure_throughput
from swarm.node.observer import StepObserver
from swarm.node.placement import (
    better_span,
    coverage,
    gaps,
    room_for_head,
    settled_span,
    span_beside_head,
)
from swarm.node.server import Node
from swarm.node.status import Status, log_status, may_borrow, status_of
from swarm.records import CACHE, JOINING, OFFLINE, ONLINE, NodeRecord, format_blocks
from swarm.relay import check_reachable, stay_relayed
from swarm.tls import Identity

SETTLE_S = 2.0  # how long a node without --layers lets simultaneous choices reach the DHT
OFFLINE_TTL_S = 10.0  # the offline record outlives a short --announce-ttl, so readers see it
RELAY_WAIT_S = 30.0  # how long serving waits for a first relay before it says where it is

Blocks = tuple[int, int]  # a half-open span start:end
ModelSource = GGUFSource | SafetensorsSource
T = TypeVar("T")


def say(text: str) -> None:
    print(text, flush=True)


@dataclass(frozen=True)
class Stop:
    """A signal asked the node to stop."""

    signal: str  # its name, e.g. SIGTERM
    target: None = None  # no span after this one

    def line(self, sessions: int) -> str:
        return f"received {self.signal}: going offline, refusing new sessions"


@dataclass(frozen=True)
class Move:
    """The swarm needs this node elsewhere: nobody else serves `gaps`, which `target` fills."""

    current: Blocks
    target: Blocks
    gaps: tuple[Blocks, ...]

    def line(self, sessions: int) -> str:
        (start, end), (to_start, to_end) = self.current, self.target
        return (
            f"moving from blocks {start}:{end} to {to_start}:{to_end}: nobody serves"
            f" {format_blocks(self.gaps)} and others still serve ours; draining {sessions}"
            " sessions first"
        )


async def run(cfg: NodeConfig, observer: StepObserver | None = None) -> None:
    """Start a node and serve until SIGINT or SIGTERM; an automatic span may move meanwhile."""
    t0 = time.perf_counter()
    source = open_model(cfg.model)
    if not cfg.automatic_span and cfg.role != CACHE:
        source.config.check_span(cfg.start, cfg.end)
        source.block_files(cfg.start, cfg.end)  # before joining: name any shard missing
    fingerprint = source.fingerprint()
    # The node's key, for its life: its DHT signs its records with it, its relay registrations
    # and hand-overs prove it; its own, so two nodes in one process are two nodes
    key = NodeKey.generate()
    dht = start_dht(cfg.initial_peers, host=cfg.dht_host, nice=cfg.dht_nice, key=key)
    try:
        if not cfg.initial_peers:
            say("started a new swarm; others join with:")
        for maddr in visible_maddrs(dht):
            say(f"  --initial-peers {maddr}")
        listeners = await trio.open_tcp_listeners(cfg.port, host=cfg.host)
        port = listeners[0].socket.getsockname()[1]
        addr = cfg.public_address or join_host_port(cfg.host, port)
        usable = await trio.to_thread.run_sync(usable_formats, say, cfg.input_terms)
        life = Lifecycle(cfg, source, fingerprint, dht, key, addr, usable, observer)
        if cfg.role == CACHE:  # no blocks: it lends memory
            await serve_cache(life, listeners, say)
            say("node stopped")
            return
        span_range: Blocks | None = await life.first_span()
        settle = cfg.automatic_span  # the first choice may race a node choosing at once
        while span_range is not None:
            span_range = await life.serve(span_range, listeners, t0, settle)
            settle = False
            if span_range is not None:  # moved: the next span listens on the same port
                listeners = await trio.open_tcp_listeners(port, host=cfg.host)
                t0 = time.perf_counter()
        say("node stopped")
    finally:
        dht.shutdown()


class Lifecycle:
    """A node on one span after another; its DHT peer, signing key, address and TLS key stay
    the same."""

    def __init__(
        self,
        cfg: NodeConfig,
        source: ModelSource,
        fingerprint: str,
        dht,
        key: NodeKey,
        addr: str,
        usable: tuple[str, ...],
        observer: StepObserver | None,
    ):
        self.cfg, self.source, self.fingerprint, self.dht = cfg, source, fingerprint, dht
        self.addr, self.usable, self.observer = addr, usable, observer
        self.key, self.me = key, key.peer
        # one key for the node's life: a moved node keeps its identity
        self.identity = None if cfg.plaintext else Identity.generate()
        self.span_ok = source.config.span_ok  # spans this node may take (first_span adds memory)

    async def records(self) -> list[NodeRecord]:
        """The model's node records on the DHT now."""
        config = self.source.config
        records, _expires, _bad = await trio.to_thread.run_sync(
            read_nodes, self.dht, config.name, config.num_layers, abandon_on_cancel=True
        )
        return records

    async def first_span(self) -> Blocks:
        """--layers, or where a node started without it goes: the thinnest window of the swarm,
        as wide as --num-blocks or as its memory allows."""
        cfg, num_layers = self.cfg, self.source.config.num_layers
        if not cfg.automatic_span:
            return cfg.start, cfg.end
        if cfg.num_blocks:
            fit = Fit(cfg.num_blocks, cfg.num_blocks)
        else:
            fit = await trio.to_thread.run_sync(blocks_that_fit, cfg, self.source, self.usable, say)
        family_ok = self.source.config.span_ok
        self.span_ok = room_for_head(num_layers, fit.ending, family_ok)  # moves keep to it
        records = await self.records()
        blocks_now = coverage(records, num_layers)
        size = min(fit.blocks, num_layers)
        start, end = span_beside_head(blocks_now, size, fit.ending, family_ok)
        said = f"{len(records)} other node{'s' if len(records) != 1 else ''} announced"
        thin = format_blocks(gaps(blocks_now))
        said += f"; blocks nobody serves: {thin}" if thin else "; every block is served"
        say(f"choosing blocks: {said}; taking {start}:{end} ({end - start} blocks)")
        return start, end

    async def serve(
        self, span_range: Blocks, listeners, t0: float, settle: bool = False
    ) -> Blocks | None:
        """Serve `span_range` until a signal (returns None) or a move (returns the new span)."""
        announcer, span_range = await self._join(span_range, settle)
        node = await self._load(span_range, t0)
        report = partial(status_of, node)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.serve, listeners)
            await self._reach(node, announcer, report, nursery)
            via = f", relayed by {announcer.relay}" if announcer.relay else ""
            secured = f"TLS key {self.identity.key_id}" if self.identity else "PLAINTEXT"
            say(
                f"serving blocks {span_range[0]}:{span_range[1]} on {announcer.addr}"
                f" (peer {self.me}), {secured}{via}"
            )
            nursery.start_soon(log_status, report)
            if may_borrow(node):  # its record counts the memory it could borrow
                nursery.start_soon(node.directory.keep_read, self.cfg.limits.announce_ttl_s / 3)
            # held through the drain: a second signal waits for it to end instead of cutting it
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                leaving = await self._until_leaving(signals, announcer, report, span_range)
                say(leaving.line(len(node.sessions)))
                hand_over = partial(self._hand_over, node)
                if self.cfg.limits.handover == "off":
                    hand_over = None
                await drain(node, announcer, report, self.cfg.limits.grace_s, hand_over)
                c = node.counters
                say(
                    f"left with {c.prompt_passes} prompt passes ({c.prompt_tokens} tokens) done;"
                    f" sessions handed over here {c.moved_in}, to replicas {c.moved_out}"
                )
            nursery.cancel_scope.cancel()
        return leaving.target

    async def _until_leaving(
        self, signals, announcer: Announcer, report: Callable[[], Status], current: Blocks
    ) -> Stop | Move:
        """Keep the node announced online until a signal stops it or, with an automatic span,
        the swarm needs it elsewhere."""
        reasons: list[Callable[[], Awaitable[Stop | Move]]] = [partial(next_signal, signals)]
        if self.cfg.automatic_span and self.cfg.rebalance_s > 0:
            num_layers, every = self.source.config.num_layers, self.cfg.rebalance_s
            watch = partial(
                watch_for_move, self.records, self.me, current, num_layers, every, self.span_ok
            )
            reasons.append(watch)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(announcer.keep_fresh, report)
            leaving = await first_of(*reasons)
            nursery.cancel_scope.cancel()  # an online record now would undo the offline one
        return leaving

    async def _hand_over(self, node: Node, deadline: float) -> None:
        """Move the open sessions to replicas the DHT announces, by `deadline`."""
        with trio.move_on_at(deadline):
            records = await self.records()
            moved = await hand_over_all(node.context, records, self.me, deadline, say)
            if moved:
                say(f"handed {moved} sessions over")

    def _announcer(self, start: int, end: int) -> Announcer:
        config = self.source.config
        return Announcer(
            self.dht,
            self.key,
            self.addr,
            config.name,
            config.num_layers,
            self.fingerprint,
            start,
            end,
            self.cfg.limits.announce_ttl_s,
            tls=self.identity.key_id if self.identity else "",
            arch=config.arch,
            role=self.cfg.role,
        )

    async def _join(self, span_range: Blocks, settle: bool) -> tuple[Announcer, Blocks]:
        """Announce `span_range` as joining; a first automatic choice then looks again."""
        announcer = self._announcer(*span_range)
        await announcer.publish(JOINING)
        if settle and (again := await self._settle(span_range)) != span_range:
            span_range = again
            announcer = self._announcer(*span_range)
            await announcer.publish(JOINING)
        return announcer, span_range

    async def _settle(self, span_range: Blocks) -> Blocks:
        """Nodes started at the same moment may choose the same blocks, each before the other's
        record arrived: after announcing, look again; where a node with a lower peer id chose
        overlapping blocks, it keeps them and this one chooses again."""
        await trio.sleep(SETTLE_S + random.random())
        records = await self.records()
        num_layers = self.source.config.num_layers
        again, rival = settled_span(records, self.me, span_range, num_layers, self.span_ok)
        if again != span_range:
            say(
                f"choosing again: {rival.peer[-8:]} chose {rival.start}:{rival.end} at the same"
                f" time; taking {again[0]}:{again[1]}"
            )
        return again

    async def _load(self, span_range: Blocks, t0: float) -> Node:
        """The node for `span_range`: its blocks loaded and its throughput measured."""
        cfg, source = self.cfg, self.source
        start, end = span_range

        def progress(done: int, total: int) -> None:
            say(f"loading blocks {start}:{end}: {done}/{total}")

        span = await trio.to_thread.run_sync(
            partial(
                Span.load, source, start, end, progress, cfg.weights, self.usable, cfg.input_terms
            )
        )
        directory = PeerDirectory.of_dht(
            self.dht, source.config.name, source.config.num_layers, plaintext=cfg.plaintext
        )
        node = Node(
            cfg,
            span,
            self.fingerprint,
            self.observer,
            directory=directory,
            identity=self.identity,
            key=self.key,
        )
        node.compute.decode_step_seconds = await trio.to_thread.run_sync(measure_throughput, span)
        formats = ", ".join(f"{n} {fmt}" for fmt, n in span.formats.items())
        say(
            f"loaded blocks {start}:{end} of {source.config.name} as {span.format}"
            f" ({formats} matrices; {span.nbytes / (end - start) / 2**20:.1f} MiB a"
            f" layer; fingerprint {self.fingerprint}) in {time.perf_counter() - t0:.1f} s;"
            f" ~{node.throughput:.0f} tokens/s"
        )
        return node

    async def _reach(
        self, node: Node, announcer: Announcer, report: Callable[[], Status], nursery
    ) -> None:
        """Find out whether others can dial this node; if not (or --relay always), serve
        through a relay (in `nursery`), announcing its address."""
        cfg = self.cfg
        if self.identity is None or cfg.relay == "never":
            return
        if cfg.relay == "auto":
            records = await self.records()
            key = self.identity.key_id
            reachable, why = await check_reachable(self.addr, key, self.me, records)
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

        async def relayed_by(record: NodeRecord | None) -> None:
            announcer.addr = record.addr if record else direct
            announcer.relay = record.peer if record else ""
            first.set()
            if record is not None:
                await announcer.publish(ONLINE, report())

        accept = node.accept_relayed
        nursery.start_soon(stay_relayed, self.key, self.records, relayed_by, accept, say)
        with trio.move_on_after(RELAY_WAIT_S):
            await first.wait()


async def watch_for_move(
    read: Callable[[], Awaitable[list[NodeRecord]]],
    me: str,
    current: Blocks,
    num_layers: int,
    interval: float,
    span_ok=None,
) -> Move:
    """Every `interval` seconds read the records; return once placement says this node (`me`,
    serving `current`) should move (`better_span`)."""
    while True:
        await trio.sleep(interval)
        records = await read()
        target = better_span(records, me, current, num_layers, span_ok)
        if target is not None:
            others = coverage(records, num_layers, frozenset({me}))
            return Move(current, target, tuple(gaps(others)))


async def next_signal(signals: AsyncIterator[int]) -> Stop:
    """The next of `signals` (trio's signal receiver), as a reason to stop."""
    return Stop(signal.Signals(await anext(signals)).name)


async def drain(
    node: Node,
    announcer: Announcer,
    report: Callable[[], Status],
    grace: float,
    hand_over: Callable[[float], Awaitable[None]] | None = None,
) -> None:
    """Leave a span gently, for a move and a shutdown alike: refuse new sessions, announce the
    node offline, hand the open sessions over to replicas (`hand_over`, given the deadline)
    and the KV blocks it lends on (swarm.node.lend_leave), and give those left up to `grace`
    seconds in all to end."""
    deadline = trio.current_time() + grace
    node.stop_accepting()
    await announcer.publish(OFFLINE, report(), ttl=max(announcer.ttl, OFFLINE_TTL_S))
    await tell_borrowers(node.lends)
    if hand_over is not None:
        await hand_over(deadline)
    with trio.move_on_at(deadline):
        await node.sessions.until_empty()
    if len(node.sessions):
        say(f"grace period over; closing {len(node.sessions)} sessions")
    await until_handed_on(node.lends, deadline, say)


async def first_of(*tasks: Callable[[], Awaitable[T]]) -> T:
    """What the first of `tasks` to return returns; the others are cancelled."""
    send, receive = trio.open_memory_channel(len(tasks))  # room for all: nobody waits to send
    async with trio.open_nursery() as nursery:
        for task in tasks:
            nursery.start_soon(_send_result, task, send)
        result = await receive.receive()
        nursery.cancel_scope.cancel()
    return result


async def _send_result(task: Callable[[], Awaitable[T]], send: trio.MemorySendChannel) -> None:
    send.send_nowait(await task())
