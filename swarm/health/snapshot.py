"""What the health page shows, computed from records and pings without touching the network.

`build_model_view` is pure: the collector feeds it what it last read and measured, tests feed
it records they made up, and both get the same coverage, gaps and route verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarm.records import (
    ONLINE,
    Block,
    ModelRecord,
    NodeRecord,
    Reported,
    coverage,
    coverage_gaps,
)
from swarm.transport import Reach

EXPIRED = "expired"  # shown for a node whose records left the DHT; never announced by a node
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Known:
    """A node as last read from the DHT, and when (DHT time) its records expire."""

    record: NodeRecord
    expires: float


@dataclass(frozen=True)
class NodeView:
    record: NodeRecord
    state: str  # the record's state, or EXPIRED
    reach: Reach | None  # None: not pinged (expired, or never probed)
    fingerprint_ok: bool
    usable: bool  # counted in coverage: online, current, same weights, not unreachable
    updated_ago_s: float
    expires_in_s: float
    reported: Reported | None = None  # clients' checks that found it computing wrongly

    @property
    def short_peer(self) -> str:
        return short_peer(self.record.peer)

    def to_json(self) -> dict[str, Any]:
        r = self.record
        return {
            "peer": r.peer,
            "peer_short": self.short_peer,
            "addr": r.addr,
            "start": r.start,
            "end": r.end,
            "state": self.state,
            "version": r.version,
            "weights": r.weights,
            "fingerprint": r.fingerprint,
            "fingerprint_ok": self.fingerprint_ok,
            "usable": self.usable,
            "throughput": r.throughput,
            "free_cache_tokens": r.free_cache_tokens,
            "sessions": r.sessions,
            "decode_batch": r.decode_batch,
            "throttled": r.throttled,
            "prompt_passes": r.prompt_passes,
            "moved_in": r.moved_in,
            "moved_out": r.moved_out,
            "transfers": r.transfers,
            "lent_mb": r.lent_mb,  # KV blocks it holds for other nodes' sessions
            "borrowing": r.borrowing,  # its sessions whose oldest KV blocks are at a lender
            "borrow_tokens": r.borrow_tokens,  # the longest session it could take borrowing
            "cache_tokens": r.cache_tokens,  # past this a session borrows (0: unsaid)
            "session_tokens": r.session_tokens,  # the longest session it takes (0: unsaid)
            "role": r.role,  # both, prefill (hands its sessions on to decode nodes), decode
            "link": dict(r.link),
            "tls": r.tls,  # the key id it proves; "" when it runs --plaintext
            "relay": r.relay,  # the peer relaying for it ("": others dial it directly)
            "reach": r.reach,  # its dial-back check: direct, relayed, unknown ("": none)
            "reachable": None if self.reach is None else self.reach.reachable,
            "rtt_ms": None if self.reach is None else _ms(self.reach.rtt_s),
            "ping_error": None if self.reach is None else self.reach.error,
            "updated": r.updated,
            "updated_ago_s": round(self.updated_ago_s, 1),
            "expires_in_s": round(self.expires_in_s, 1),
            "reported": None if self.reported is None else _reported(self.reported),
        }


@dataclass(frozen=True)
class ModelView:
    model: ModelRecord
    blocks: tuple[Block, ...]  # each block as the usable nodes cover it
    nodes: tuple[NodeView, ...]

    @property
    def coverage(self) -> tuple[int, ...]:
        """Usable nodes serving each block."""
        return tuple(b.nodes for b in self.blocks)

    @property
    def gaps(self) -> list[tuple[int, int]]:
        """Half-open block ranges no usable node serves."""
        return coverage_gaps(self.coverage)

    @property
    def full_route(self) -> bool:
        # a hop may use part of a node's span (client.routing), so covering every block suffices
        return bool(self.blocks) and all(b.nodes for b in self.blocks)

    @property
    def throughput(self) -> float:
        """Tokens/s the swarm can push through the whole model: its weakest block's capacity.

        Each block's capacity is the summed throughput of the usable nodes serving it; a token
        crosses every block once, so the least of those bounds the swarm. Zero with a gap.
        """
        return min(b.throughput for b in self.blocks) if self.full_route else 0.0

    def count(self, state: str) -> int:
        return sum(1 for n in self.nodes if n.state == state)

    @property
    def unreachable(self) -> int:
        return sum(1 for n in self.nodes if n.reach is not None and not n.reach.reachable)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model.model,
            "num_layers": self.model.num_layers,
            "fingerprint": self.model.fingerprint,
            "arch": self.model.arch,
            "coverage": list(self.coverage),
            "gaps": [list(g) for g in self.gaps],
            "full_route": self.full_route,
            "throughput": round(self.throughput, 3),
            "nodes_online": sum(1 for n in self.nodes if n.usable),
            "nodes": [n.to_json() for n in self.nodes],
        }


@dataclass(frozen=True)
class DhtStatus:
    state: str  # "starting" (no read yet), "ok", or "failing" (last read failed)
    last_ok: float | None = None  # wall-clock time of the last good read
    read_seconds: float | None = None  # how long the last good read took
    error: str | None = None  # why the last attempt failed


@dataclass(frozen=True)
class Snapshot:
    """Everything one refresh found; immutable, so a request can hold it while the next is built."""

    taken_at: float  # wall-clock time
    dht: DhtStatus
    skipped_records: int = 0  # malformed or foreign entries in the last good read
    models: tuple[ModelView, ...] = ()
    refresh_interval: float = 0.0
    version: str = ""
    serial: int = 0  # increases with every snapshot; lets a renderer cache its output

    def to_json(self) -> dict[str, Any]:
        d = self.dht
        return {
            "schema": SCHEMA_VERSION,
            "version": self.version,
            "generated_at": self.taken_at,
            "refresh_interval_s": self.refresh_interval,
            "dht": {
                "state": d.state,
                "last_ok": d.last_ok,
                "last_ok_age_s": None if d.last_ok is None else round(self.taken_at - d.last_ok, 1),
                "read_seconds": _round(d.read_seconds, 4),
                "error": d.error,
            },
            "skipped_records": self.skipped_records,
            "models": [m.to_json() for m in self.models],
        }


def short_peer(peer: str) -> str:
    # hivemind peer ids share the "12D3KooW" prefix; the tail tells them apart
    return peer if len(peer) <= 10 else "…" + peer[-8:]


def build_model_view(
    model: ModelRecord,
    known: list[Known],
    reach: dict[str, Reach],
    now: float,
    reports: dict[str, Reported] | None = None,
) -> ModelView:
    """Coverage and node rows for one model; `reach` maps a node's link (`Hop.link`) to its
    last ping, `reports` a node to what clients' checks reported of it."""
    reports = reports or {}
    views = []
    for k in known:
        r = k.record
        expired = k.expires <= now
        ping = None if expired else reach.get(r.dial_key)
        fingerprint_ok = r.fingerprint == model.fingerprint and r.num_layers == model.num_layers
        usable = (
            not expired
            and r.state == ONLINE
            and fingerprint_ok
            and (ping is None or ping.reachable)
            and r.end <= model.num_layers
        )
        views.append(
            NodeView(
                record=r,
                state=EXPIRED if expired else r.state,
                reach=ping,
                fingerprint_ok=fingerprint_ok,
                usable=usable,
                updated_ago_s=max(0.0, now - r.updated),
                expires_in_s=k.expires - now,
                reported=reports.get(r.peer),
            )
        )
    views.sort(key=lambda v: (v.state == EXPIRED, v.record.start, v.record.end, v.record.peer))
    blocks = coverage((v.record for v in views if v.usable), model.num_layers)
    return ModelView(model=model, blocks=blocks, nodes=tuple(views))


def _reported(r: Reported) -> dict[str, Any]:
    # reporters are keys anyone can make: a count of them is a signal, not a verdict
    return {
        "reporters": len(r.reporters),
        "blocks": [list(b) for b in r.blocks],
        "last": r.last,
    }


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)
