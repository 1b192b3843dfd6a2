"""A node started with `--role cache`: it serves no blocks and loads no weights; it lends its
memory to other nodes' sessions for their oldest KV blocks (swarm/node/lender.py), announced
under the model's lenders key (swarm.records.lenders_key), where routes never look.

Its record's `free_cache_tokens` is what it could still hold of a session's KV through every
layer of the model: its free lending memory over a token's bytes in all layers.
"""

from __future__ import annotations

import signal
from typing import Protocol

import torch
import trio

from swarm.dht import NodeKey
from swarm.model.blocks import KVCache, Span
from swarm.model.source import GGUFSource, SafetensorsSource
from swarm.node.announce import Announcer
from swarm.node.config import NodeConfig
from swarm.node.directory import PeerDirectory
from swarm.node.lend_leave import tell_borrowers, until_handed_on
from swarm.node.server import Node
from swarm.node.status import Status
from swarm.records import CACHE, OFFLINE
from swarm.tls import Identity

ModelSource = GGUFSource | SafetensorsSource


class Joined(Protocol):
    """What a started node has before it serves (swarm.node.lifecycle.Lifecycle is one)."""

    cfg: NodeConfig
    source: ModelSource
    fingerprint: str
    dht: object
    key: NodeKey
    me: str  # its peer id
    addr: str
    identity: Identity | None


async def serve_cache(life: Joined, listeners, say) -> None:
    """Lend until SIGINT or SIGTERM, then announce the node offline and hand what it holds on
    (swarm.node.lend_leave) within --grace; what is left then goes with its connections."""
    cfg, config = life.cfg, life.source.config
    span = Span(config, 0, 0, [], cfg.weights)  # no blocks: what the node's context expects
    directory = PeerDirectory.of_dht(
        life.dht, config.name, config.num_layers, plaintext=cfg.plaintext
    )
    node = Node(
        cfg, span, life.fingerprint, directory=directory, identity=life.identity, key=life.key
    )
    announcer = Announcer(
        life.dht,
        life.key,
        life.addr,
        config.name,
        config.num_layers,
        life.fingerprint,
        0,
        0,
        cfg.limits.announce_ttl_s,
        tls=life.identity.key_id if life.identity else "",
        arch=config.arch,
        role=CACHE,
    )
    dtype = torch.float32 if cfg.weights == "float32" else torch.bfloat16
    per_token = KVCache.bytes_per_token(config, config.num_layers, dtype)

    def report() -> Status:  # no sessions, no weights: what it lends
        lent = node.lends.lent_bytes
        free = max(0, node.lends.max_bytes - lent) // per_token
        return Status(
            0,
            free,
            link=node.uplink.stats(),
            weights="none",
            lent_mb=lent / 2**20,
            lend_free_mb=node.lends.free_for_one / 2**20,
        )

    async with trio.open_nursery() as nursery:
        await nursery.start(node.serve, listeners)
        secured = f"TLS key {life.identity.key_id}" if life.identity else "PLAINTEXT"
        say(
            f"serving blocks 0:0 on {life.addr} (peer {life.me}), {secured}: lending"
            f" {cfg.limits.max_lend_mb:g} MB for KV blocks (--role cache)"
        )
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as fresh:
                fresh.start_soon(announcer.keep_fresh, report)
                name = signal.Signals(await anext(signals)).name
                fresh.cancel_scope.cancel()
            deadline = trio.current_time() + cfg.limits.grace_s
            say(f"received {name}: going offline; handing on {node.lends.loans} loans")
            await announcer.publish(OFFLINE, report())
            await tell_borrowers(node.lends)
            await until_handed_on(node.lends, deadline, say)
        nursery.cancel_scope.cancel()
