"""DHT records: what a node announces about itself, one record per served block.

Each record sits under key `<model>.block.<i>` with the owner's public key as subkey, so
hivemind's RSASignatureValidator lets only that owner change it. `swarm.models` lists models;
`<model>.reports` holds what clients' checks found (`ReportRecord`), one value per reporter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from swarm.address import parse_host_port
from swarm.protocol import Hop, link_name

JOINING, ONLINE, OFFLINE = "joining", "online", "offline"
STATES = (JOINING, ONLINE, OFFLINE)
# what a node announces itself for: prompts and decoding (BOTH); PREFILL: long prompts, whose
# sessions it hands on to a decode node once computed; DECODE: not those prompts; CACHE: serves
# no blocks, lends its memory to other nodes' sessions for their KV blocks (swarm.node.lender)
BOTH, PREFILL, DECODE, CACHE = "both", "prefill", "decode", "cache"
ROLES = (BOTH, PREFILL, DECODE, CACHE)
MODELS_KEY = "swarm.models"
# bounds on what a reader accepts from the DHT, which anyone can write to
MAX_LAYERS = 4096
MAX_NAME = 200
MAX_MODELS = 32
MAX_WEIGHTS_NAME = 32
MAX_ARCH = 40  # characters of an arch description kept
MAX_TTL_S = 300.0  # ten default TTLs: every DHT peer of a swarm refuses a record living longer
MAX_REPORTED = 16  # nodes one reporter's record may name
MAX_TOKENS = 1 << 30  # a record's token counts (cache, sessions) above this are lies
MAX_LEND_MB = float(1 << 30)  # a petabyte: a record's lendable memory above this is a lie
DEFAULT_WEIGHTS = "float32"  # what a record from before the field existed was serving


HANDOVER_FIGURES = ("prompt_passes", "moved_in", "moved_out", "transfers")
BORROW_TOKENS = ("cache_tokens", "borrow_tokens", "session_tokens")  # 0..MAX_TOKENS, 0: unsaid


def block_key(model: str, block: int) -> str:
    return f"{model}.block.{block}"


def lenders_key(model: str) -> str:
    """Where `--role cache` nodes, serving no blocks, announce themselves."""
    return f"{model}.lenders"


def reports_key(model: str) -> str:
    return f"{model}.reports"


@dataclass(frozen=True)
class NodeRecord:
    peer: str  # hivemind peer id, printable
    addr: str  # data-plane "host:port" clients and upstream nodes connect to
    model: str
    start: int
    end: int
    state: str
    fingerprint: str
    version: str
    num_layers: int
    free_cache_tokens: int = 0
    throughput: float = 0.0  # tokens/s this node sustains through its whole span
    link: dict[str, float] = field(default_factory=dict)  # scheduler / estimator figures
    updated: float = 0.0  # DHT time of this announcement
    weights: str = DEFAULT_WEIGHTS  # how the node keeps its weights: "float32", "int4", ...
    sessions: int = 0  # sessions open at the node
    decode_batch: float = 1.0  # decode steps per decode pass, on average (sessions batched)
    throttled: int = 0  # opens and connections refused, sessions evicted, in the last minute
    decode_passes: int = 0  # decode passes since the node started
    tls: str = ""  # key id (swarm.tls) the node proves in its TLS handshake; "": plaintext
    relay: str = ""  # peer id of the node relaying this one, which nobody can dial; then
    # `addr` is the relay's and a dialler asks it for this peer first (swarm.relay)
    reach: str = ""  # what its dial-back check found: "direct", "relayed", "unknown", "" (none)
    arch: str = ""  # the model's family, and "experts/used" for a mixture ("qwen3_moe 128/8")
    prompt_passes: int = 0  # prompt passes since the node started (replays cost some)
    moved_in: int = 0  # sessions leaving nodes handed over to it (swarm.node.handover)
    moved_out: int = 0  # sessions it handed over to replicas
    transfers: int = 0  # caches being handed over, either way, when it wrote the record
    role: str = BOTH  # PREFILL: clients send it long prompts, it hands their caches on
    lent_mb: float = 0.0  # KV blocks it holds for other nodes' sessions (swarm.node.lender)
    borrowing: int = 0  # its sessions whose oldest KV blocks are at a lender
    # what it could lend one more borrowing node now (0: lends none, or leaves)
    lend_free_mb: float = 0.0
    # what one session may keep there (its --max-cache-tokens, or an address's share of it if
    # less: swarm.node.borrow.session_room): a longer session keeps part of its cache there and
    # borrows the rest, up to `borrow_tokens` (0: none now), the longest such session it could
    # take now (swarm.node.status.borrowable)
    cache_tokens: int = 0
    borrow_tokens: int = 0
    session_tokens: int = 0  # its --max-session-tokens: it refuses a longer session (0: unsaid)

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def host_port(self) -> tuple[str, int]:
        return parse_host_port(self.addr)

    @property
    def dial_key(self) -> str:
        """What names the connection to it (`Hop.link`): nodes behind one relay share its addr."""
        return link_name(self.addr, self.peer, self.relay)

    def hop(self, start: int | None = None, end: int | None = None) -> Hop:
        """How to reach this node for blocks start:end (default: its whole span)."""
        host, port = self.host_port
        start = self.start if start is None else start
        end = self.end if end is None else end
        return Hop(host, port, start, end, self.peer, self.tls, self.relay)

    @classmethod
    def from_wire(cls, raw: Any) -> NodeRecord:
        """Validate a record read from the DHT; raise ValueError on anything malformed."""
        if not isinstance(raw, dict):
            raise ValueError(f"record is {type(raw).__name__}, not a map")
        try:
            rec = cls(
                peer=_typed(raw, "peer", str),
                addr=_typed(raw, "addr", str),
                model=_typed(raw, "model", str),
                start=_typed(raw, "start", int),
                end=_typed(raw, "end", int),
                state=_typed(raw, "state", str),
                fingerprint=_typed(raw, "fingerprint", str),
                version=_typed(raw, "version", str),
                num_layers=_typed(raw, "num_layers", int),
                free_cache_tokens=_typed(raw, "free_cache_tokens", int),
                throughput=float(_typed(raw, "throughput", (int, float))),
                link={
                    str(k): float(v)
                    for k, v in _typed(raw, "link", dict).items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool)
                },
                updated=float(_typed(raw, "updated", (int, float))),
                weights=_typed(raw, "weights", str) if "weights" in raw else DEFAULT_WEIGHTS,
                sessions=_typed(raw, "sessions", int) if "sessions" in raw else 0,
                decode_batch=float(_typed(raw, "decode_batch", (int, float)))
                if "decode_batch" in raw
                else 1.0,
                throttled=_typed(raw, "throttled", int) if "throttled" in raw else 0,
                decode_passes=_typed(raw, "decode_passes", int) if "decode_passes" in raw else 0,
                tls=_typed(raw, "tls", str) if "tls" in raw else "",
                relay=_typed(raw, "relay", str) if "relay" in raw else "",
                reach=_typed(raw, "reach", str)[:16] if "reach" in raw else "",
                arch=_typed(raw, "arch", str)[:MAX_ARCH] if "arch" in raw else "",
                role=_typed(raw, "role", str) if "role" in raw else BOTH,
                lent_mb=float(_typed(raw, "lent_mb", (int, float))) if "lent_mb" in raw else 0.0,
                borrowing=_typed(raw, "borrowing", int) if "borrowing" in raw else 0,
                lend_free_mb=float(_typed(raw, "lend_free_mb", (int, float)))
                if "lend_free_mb" in raw
                else 0.0,
                **{k: _typed(raw, k, int) for k in (*HANDOVER_FIGURES, *BORROW_TOKENS) if k in raw},
            )
        except KeyError as exc:
            raise ValueError(f"record lacks field {exc}") from None
        if rec.role not in ROLES:
            raise ValueError(f"record role {rec.role[:40]!r} is not one of {ROLES}")
        if rec.state not in STATES:
            raise ValueError(f"record state {rec.state!r} is not one of {STATES}")
        if rec.role == CACHE and rec.start == rec.end == 0:
            pass  # a lender: no blocks
        elif rec.role == CACHE or not 0 <= rec.start < rec.end <= rec.num_layers:
            raise ValueError(f"record span {rec.start}:{rec.end} is not inside 0:{rec.num_layers}")
        if not 0 < len(rec.weights) <= MAX_WEIGHTS_NAME:
            raise ValueError(f"record weights {rec.weights[:40]!r} is not a format name")
        if rec.tls and not re.fullmatch(r"[0-9a-f]{64}", rec.tls):
            raise ValueError(f"record tls {rec.tls[:40]!r} is not a key id")
        if len(rec.relay) > MAX_NAME:
            raise ValueError("record relay is not a peer id")
        _check_borrowing(rec)
        parse_host_port(rec.addr)  # its ValueError names the address
        return rec

    def borrows_for(self, max_length: int) -> bool:
        """It could take a session of `max_length` now only by borrowing KV blocks."""
        return self.cache_tokens < max_length <= self.borrow_tokens

    def holds(self, max_length: int) -> bool:
        """It could take a session of `max_length` now in its free cache, without borrowing
        (a record from before `cache_tokens` and `session_tokens`: as its free cache says)."""
        whole = min(self.cache_tokens or max_length, self.session_tokens or max_length)
        return max_length <= min(self.free_cache_tokens, whole)

    def allows(self, max_length: int) -> bool:
        """Its --max-session-tokens allows a session of `max_length` (unsaid: maybe)."""
        return not self.session_tokens or max_length <= self.session_tokens


def _check_borrowing(rec: NodeRecord) -> None:
    if not 0.0 <= rec.lend_free_mb <= MAX_LEND_MB:  # NaN fails too
        raise ValueError(f"record lend_free_mb {rec.lend_free_mb} is not in 0..{MAX_LEND_MB:g}")
    for name in BORROW_TOKENS:
        if not 0 <= getattr(rec, name) <= MAX_TOKENS:
            raise ValueError(f"record {name} {getattr(rec, name)} is not in 0..{MAX_TOKENS}")
    if rec.borrow_tokens and rec.borrow_tokens <= rec.cache_tokens:
        raise ValueError(
            f"record borrow_tokens {rec.borrow_tokens} is not past its cache_tokens"
            f" {rec.cache_tokens}: a node borrows only for sessions longer than its cache"
        )


def _typed(raw: dict, key: str, kind: type | tuple[type, ...]) -> Any:
    value = raw[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"record field {key!r} has type {type(value).__name__}")
    return value


@dataclass(frozen=True)
class ModelRecord:
    model: str
    num_layers: int
    fingerprint: str
    arch: str = ""  # as NodeRecord.arch

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, raw: Any) -> ModelRecord:
        if not isinstance(raw, dict):
            raise ValueError("model record is not a map")
        try:
            rec = cls(
                model=_typed(raw, "model", str),
                num_layers=_typed(raw, "num_layers", int),
                fingerprint=_typed(raw, "fingerprint", str),
                arch=_typed(raw, "arch", str)[:MAX_ARCH] if "arch" in raw else "",
            )
        except KeyError as exc:
            raise ValueError(f"model record lacks field {exc}") from None
        if not 1 <= rec.num_layers <= MAX_LAYERS or not 0 < len(rec.model) <= MAX_NAME:
            raise ValueError(f"model record {rec.model[:40]!r} with {rec.num_layers} layers")
        return rec


@dataclass(frozen=True)
class Report:
    """A node a client's check found computing wrongly (swarm.client.verify): outvoted by
    another route on blocks start:end at DHT time `at`."""

    peer: str
    start: int
    end: int
    at: float


@dataclass(frozen=True)
class ReportRecord:
    """What one reporter (the key signing it) keeps under `<model>.reports`: its recent
    reports. Anyone can make a key, so a reader counts reporters as a signal, not a verdict."""

    reports: tuple[Report, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"reports": [asdict(r) for r in self.reports]}

    @classmethod
    def from_wire(cls, raw: Any) -> ReportRecord:
        if not isinstance(raw, dict) or not isinstance(raw.get("reports"), list):
            raise ValueError("report record is not a map with a list of reports")
        if len(raw["reports"]) > MAX_REPORTED:
            raise ValueError(f"report record names {len(raw['reports'])} nodes")
        reports = []
        for r in raw["reports"]:
            if not isinstance(r, dict):
                raise ValueError("a report is not a map")
            try:
                report = Report(
                    peer=_typed(r, "peer", str),
                    start=_typed(r, "start", int),
                    end=_typed(r, "end", int),
                    at=float(_typed(r, "at", (int, float))),
                )
            except KeyError as exc:
                raise ValueError(f"report lacks field {exc}") from None
            if not 0 < len(report.peer) <= MAX_NAME or not 0 <= report.start < report.end:
                raise ValueError(f"report of {report.peer[:40]!r} on {report.start}:{report.end}")
            if report.end > MAX_LAYERS:
                raise ValueError(f"report on blocks past {MAX_LAYERS}")
            reports.append(report)
        return cls(tuple(reports))


@dataclass(frozen=True)
class Reported:
    """What the reports read of one node say: the distinct reporters (node ids of the keys
    that signed them), the blocks named, the newest report's DHT time."""

    peer: str
    reporters: frozenset[str]
    blocks: tuple[tuple[int, int], ...]
    last: float


@dataclass(frozen=True)
class Block:
    """One block as a set of records covers it: how many serve it, their summed tokens/s, and
    the sessions they announce (the demand on it)."""

    nodes: int = 0
    throughput: float = 0.0
    sessions: int = 0


def coverage(records: Iterable[NodeRecord], num_layers: int) -> tuple[Block, ...]:
    """Each block 0..num_layers-1 as `records` cover it (a span past the end is cut)."""
    nodes, speed, demand = [0] * num_layers, [0.0] * num_layers, [0] * num_layers
    for r in records:
        for b in range(r.start, min(r.end, num_layers)):
            nodes[b] += 1
            speed[b] += r.throughput
            demand[b] += r.sessions
    return tuple(Block(n, t, d) for n, t, d in zip(nodes, speed, demand))


def block_coverage(records: Iterable[NodeRecord], num_layers: int) -> tuple[int, ...]:
    """How many of `records` serve each block 0..num_layers-1."""
    return tuple(b.nodes for b in coverage(records, num_layers))


def coverage_gaps(coverage: Iterable[int]) -> list[tuple[int, int]]:
    """Half-open block ranges that no record serves, in order, from per-block node counts."""
    gaps: list[tuple[int, int]] = []
    for b, count in enumerate(coverage):
        if count:
            continue
        if gaps and gaps[-1][1] == b:
            gaps[-1] = (gaps[-1][0], b + 1)
        else:
            gaps.append((b, b + 1))
    return gaps


def format_blocks(ranges: Iterable[tuple[int, int]]) -> str:
    """Half-open block ranges as a reader sees them: `0:3, 5:6`."""
    return ", ".join(f"{start}:{end}" for start, end in ranges)
