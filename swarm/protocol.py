"""Typed data-plane messages. `parse_message` validates a decoded frame at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from swarm.address import join_host_port
from swarm.errors import ProtocolError, SwarmError, error_from_code

PREFILL = "prefill"
DECODE = "decode"
PHASES = (PREFILL, DECODE)


def link_name(addr: str, peer: str, relay: str) -> str:
    """What names the connection to a node: its address, or, behind a relay (whose address
    several nodes share), the relay's address and the node's peer id."""
    return f"{addr}/p2p/{peer}" if relay else addr


@dataclass(frozen=True)
class Hop:
    host: str
    port: int
    start: int
    end: int
    peer: str = ""
    tls: str = ""  # the key id the hop's record names ("": a plaintext node)
    relay: str = ""  # the relay's peer id when host:port is the relay's (swarm.relay)

    @property
    def addr(self) -> str:
        return join_host_port(self.host, self.port)

    @property
    def link(self) -> str:
        return link_name(self.addr, self.peer, self.relay)

    def to_wire(self) -> list:
        return [self.host, self.port, self.start, self.end, self.peer, self.tls, self.relay]


@dataclass(frozen=True)
class Open:
    """Open a session on this node for blocks route[hop], then forward along the route."""

    sid: str
    route: tuple[Hop, ...]
    hop: int
    fingerprint: str
    wire_dtype: str
    max_length: int
    sink_token: str
    # the user's host as the first node saw it, forwarded as is: a next hop gives each user
    # behind a forwarding node a share of its own (swarm.node.admission.share_of)
    origin: str = ""
    # on the last hop only: once the prompt is in, hand the session and its cache over to this
    # node serving the same blocks (prefill on one node, decode on another; swarm.node.mover)
    handoff: Hop | None = None
    t: str = field(default="open", init=False)


@dataclass(frozen=True)
class Opened:
    sid: str
    t: str = field(default="opened", init=False)


@dataclass(frozen=True)
class Attach:
    """The client's claim on the last node's output, proven by the token sent in Open."""

    sid: str
    sink_token: str
    t: str = field(default="attach", init=False)


@dataclass(frozen=True)
class Attached:
    sid: str
    t: str = field(default="attached", init=False)


@dataclass(frozen=True)
class Step:
    """Activations for tokens [pos, pos + n) of a phase whose input ends at `end`."""

    sid: str
    phase: str
    pos: int
    end: int
    hidden: Any  # wire tensor map; decoded by the receiver, which knows the expected shape
    t: str = field(default="step", init=False)


@dataclass(frozen=True)
class Result:
    """Last node -> client: hidden state of token end-1 after the final block."""

    sid: str
    end: int
    hidden: Any
    t: str = field(default="result", init=False)


@dataclass(frozen=True)
class Close:
    sid: str
    t: str = field(default="close", init=False)


@dataclass(frozen=True)
class Ping:
    nonce: int
    t: str = field(default="ping", init=False)


@dataclass(frozen=True)
class Pong:
    """`rx_bytes` and `rx_us`: how the last large frame before the ping arrived, bytes after the
    first read of it over microseconds until its last byte (0, 0: no such frame)."""

    nonce: int
    t: str = field(default="pong", init=False)
    rx_bytes: int = 0
    rx_us: int = 0


@dataclass(frozen=True)
class Error:
    code: str
    message: str
    sid: str = ""
    hop: int = -1
    t: str = field(default="error", init=False)

    @classmethod
    def of(cls, exc: SwarmError, sid: str = "", hop: int = -1) -> Error:
        return cls(code=exc.code, message=str(exc), sid=sid, hop=hop)

    def exception(self) -> SwarmError:
        exc = error_from_code(self.code, self.message)
        exc.hop = self.hop  # type: ignore[attr-defined]
        return exc


@dataclass(frozen=True)
class Relay:
    """Plaintext, before TLS, to a node that relays for nodes nobody can dial (swarm.relay).
    `op`: listen / challenge / prove / listening (a node behind NAT registers `peer`, proving it
    is that node: the relay sends a nonce `token`, the node answers with its signing `key` and
    its `proof`, the signature of `relay_claim`), splice / spliced (a dialler asks for `peer`),
    reverse (the relay asks `peer` to connect back, `token`, for a dialler at
    `addr`), accept (that connection back), dialback / dialed (dial `addr` with key `tls` and
    say whether it answered: `error` empty if so)."""

    op: str
    peer: str = ""
    token: str = ""
    addr: str = ""
    tls: str = ""
    error: str = ""
    key: str = ""
    proof: str = ""
    t: str = field(default="relay", init=False)


def relay_claim(relay: str, peer: str, nonce: str) -> bytes:
    """What a node behind NAT signs to register as `peer` with relay `relay` (a node id): bound
    to that relay and its fresh nonce, so a proof cannot be replayed to another relay."""
    return f"swarm relay listen|{relay}|{peer}|{nonce}".encode()


RELAY_FIELDS = ("peer", "token", "addr", "tls", "error", "key", "proof")
RELAY_LONG_FIELDS = ("error", "key", "proof")  # up to 1024 characters; the others 256
RELAY_OPS = (
    *("listen", "challenge", "prove", "listening", "splice", "spliced", "reverse", "accept"),
    *("dialback", "dialed"),
)


@dataclass(frozen=True)
class Handover:
    """A leaving node -> a replica serving the same blocks: take session `open.sid`, whose
    cache of `length` positions follows as KvChunk frames, then HandoverEnd. `open` is the
    session's open with this replica in the leaving node's place on the route."""

    open: Open
    length: int
    peer: str = ""  # the sender's node id, proven by its HandoverEnd
    t: str = field(default="handover", init=False)


@dataclass(frozen=True)
class KvChunk:
    """Positions [pos, pos + n) of one layer's cache of a session being handed over: `keys` and
    `values` as wire tensors [1, n, kv_heads * head_dim] in the cache's own dtype. A layer
    with a sliding window sends only the positions its ring holds."""

    sid: str
    layer: int
    pos: int
    keys: Any
    values: Any
    t: str = field(default="kv", init=False)


@dataclass(frozen=True)
class HandoverTail:
    """The session went on while its cache was sent: positions up to `length` follow (the
    sender paused it before sending them)."""

    sid: str
    length: int
    t: str = field(default="handover_tail", init=False)


@dataclass(frozen=True)
class HandoverEnd:
    """The last frame of a handover: the sender `peer` proves its node id by signing
    `handover_claim` with the key behind it (`key`, `proof`, as swarm.dht.sign_as_node)."""

    sid: str
    digest: str
    peer: str
    key: str
    proof: str
    t: str = field(default="handover_end", init=False)


@dataclass(frozen=True)
class Taken:
    """The replica holds the handed-over session and its cache."""

    sid: str
    t: str = field(default="taken", init=False)


@dataclass(frozen=True)
class Moved:
    """Session `sid`'s hop `hop` now runs on `to` (its cache moved there, `length` positions):
    whoever sends it steps, or reads its results, goes there with Resume."""

    sid: str
    hop: int
    to: Hop
    length: int
    t: str = field(default="moved", init=False)


@dataclass(frozen=True)
class Resume:
    """Claim a handed-over session on its new node, proven by the open's sink token: as its
    `owner` (who sends steps), its `sink` (who reads results), or both."""

    sid: str
    sink_token: str
    owner: bool
    sink: bool
    t: str = field(default="resume", init=False)


@dataclass(frozen=True)
class Resumed:
    sid: str
    t: str = field(default="resumed", init=False)


@dataclass(frozen=True)
class Release:
    """Owner -> leaving node (then leaving node -> replica): no more steps of `sid` follow on
    this connection; those sent before it are all in."""

    sid: str
    t: str = field(default="release", init=False)


def handover_claim(receiver: str, sid: str, length: int, digest: str) -> bytes:
    """What a leaving node signs for one handover: bound to the replica, the session, its
    length and the bytes of its cache, so a proof vouches for that transfer only."""
    return f"swarm handover|{receiver}|{sid}|{length}|{digest}".encode()


Message = (
    Open
    | Opened
    | Attach
    | Attached
    | Step
    | Result
    | Close
    | Ping
    | Pong
    | Error
    | Relay
    | Handover
    | KvChunk
    | HandoverTail
    | HandoverEnd
    | Taken
    | Moved
    | Resume
    | Resumed
    | Release
)


def to_wire(message: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"t": message.t}
    for name in message.__dataclass_fields__:
        if name == "t":
            continue
        value = getattr(message, name)
        if name == "handoff" and value is None:
            continue
        if name == "route":
            value = [h.to_wire() for h in value]
        elif name in ("to", "handoff"):
            value = value.to_wire()
        elif name == "open":
            value = to_wire(value)
        out[name] = value
    return out


def _str(d: dict, key: str, max_len: int = 256) -> str:
    v = d.get(key)
    if not isinstance(v, str) or len(v) > max_len:
        raise ProtocolError(f"field {key!r} must be a string of at most {max_len} characters")
    return v


def _int(d: dict, key: str, lo: int = 0, hi: int = 2**31) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ProtocolError(f"field {key!r} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _hop(raw: Any) -> Hop:
    if (
        not isinstance(raw, list)
        or not 5 <= len(raw) <= 7
        or not isinstance(raw[0], str)
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in raw[1:4])
        or not all(isinstance(x, str) for x in raw[4:])
    ):
        raise ProtocolError(
            f"route hop must be [host, port, start, end, peer, tls, relay], got {raw!r}"[:300]
        )
    return Hop(*raw)


def parse_message(d: dict[str, Any]) -> Message:
    kind = d.get("t")
    if kind == "open":
        return _open(d)
    if kind == "handover":
        inner = d.get("open")
        if not isinstance(inner, dict) or inner.get("t") != "open":
            raise ProtocolError("field 'open' must be an open message")
        return Handover(
            open=_open(inner),
            length=_int(d, "length", 1, 1 << 20),
            peer=_str(d, "peer", 64) if "peer" in d else "",
        )
    if kind == "kv":
        return KvChunk(
            sid=_str(d, "sid", 64),
            layer=_int(d, "layer", 0, 4096),
            pos=_int(d, "pos", 0, 1 << 20),
            keys=d.get("keys"),
            values=d.get("values"),
        )
    if kind == "handover_tail":
        return HandoverTail(sid=_str(d, "sid", 64), length=_int(d, "length", 1, 1 << 20))
    if kind == "handover_end":
        return HandoverEnd(
            sid=_str(d, "sid", 64),
            digest=_str(d, "digest", 64),
            peer=_str(d, "peer", 64),
            key=_str(d, "key", 1024),
            proof=_str(d, "proof", 1024),
        )
    if kind == "moved":
        return Moved(
            sid=_str(d, "sid", 64),
            hop=_int(d, "hop", 0, 63),
            to=_hop(d.get("to")),
            length=_int(d, "length", 1, 1 << 20),
        )
    if kind == "resume":
        owner, sink = d.get("owner"), d.get("sink")
        if not isinstance(owner, bool) or not isinstance(sink, bool) or not (owner or sink):
            raise ProtocolError("fields 'owner' and 'sink' must be booleans, one of them true")
        return Resume(
            sid=_str(d, "sid", 64), sink_token=_str(d, "sink_token", 64), owner=owner, sink=sink
        )
    if kind in ("taken", "resumed", "release"):
        cls = {"taken": Taken, "resumed": Resumed, "release": Release}[kind]
        return cls(sid=_str(d, "sid", 64))
    return _others(d, kind)


def _open(d: dict[str, Any]) -> Open:
    route = d.get("route")
    if not isinstance(route, list) or not 1 <= len(route) <= 64:
        raise ProtocolError("field 'route' must be a list of 1..64 hops")
    hops = tuple(_hop(h) for h in route)
    hop = _int(d, "hop", 0, len(hops) - 1)
    return Open(
        sid=_str(d, "sid", 64),
        route=hops,
        hop=hop,
        fingerprint=_str(d, "fingerprint", 128),
        wire_dtype=_str(d, "wire_dtype", 16),
        max_length=_int(d, "max_length", 1, 1 << 20),
        sink_token=_str(d, "sink_token", 64),
        origin=_str(d, "origin", 64) if "origin" in d else "",
        handoff=_hop(d["handoff"]) if "handoff" in d else None,
    )


def _others(d: dict[str, Any], kind: Any) -> Message:
    if kind == "step":
        phase = d.get("phase")
        if phase not in PHASES:
            raise ProtocolError(f"field 'phase' must be one of {PHASES}, got {phase!r}")
        return Step(
            sid=_str(d, "sid", 64),
            phase=phase,
            pos=_int(d, "pos"),
            end=_int(d, "end", 1),
            hidden=d.get("hidden"),
        )
    if kind == "result":
        return Result(sid=_str(d, "sid", 64), end=_int(d, "end", 1), hidden=d.get("hidden"))
    if kind == "attach":
        return Attach(sid=_str(d, "sid", 64), sink_token=_str(d, "sink_token", 64))
    if kind in ("opened", "attached", "close"):
        cls = {"opened": Opened, "attached": Attached, "close": Close}[kind]
        return cls(sid=_str(d, "sid", 64))
    if kind == "ping":
        return Ping(nonce=_int(d, "nonce", 0, 2**63))
    if kind == "pong":
        return Pong(
            nonce=_int(d, "nonce", 0, 2**63),
            rx_bytes=_int(d, "rx_bytes") if "rx_bytes" in d else 0,
            rx_us=_int(d, "rx_us") if "rx_us" in d else 0,
        )
    if kind == "relay":
        op = d.get("op")
        if op not in RELAY_OPS:
            raise ProtocolError(f"field 'op' must be one of {RELAY_OPS}, got {op!r}"[:200])
        return Relay(
            op=op,
            **{
                k: _str(d, k, 1024 if k in RELAY_LONG_FIELDS else 256)
                for k in RELAY_FIELDS
                if k in d
            },
        )
    if kind == "error":
        return Error(
            code=_str(d, "code", 64),
            message=_str(d, "message", 4096),
            sid=_str(d, "sid", 64) if "sid" in d else "",
            hop=_int(d, "hop", -1, 1024) if "hop" in d else -1,
        )
    raise ProtocolError(f"unknown message type {kind!r}")
