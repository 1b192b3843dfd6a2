"""Typed data-plane messages, each field declared with its bounds (swarm.schema);
`parse_message` validates a decoded frame at the edge against them, `to_wire` encodes one."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

from swarm.address import join_host_port
from swarm.errors import ProtocolError, SwarmError, error_from_code
from swarm.lending import AttendLent, Lend, LendLeaving, Lent, LentPartial, Reclaim
from swarm.schema import (
    AnyTrue,
    Codec,
    Integer,
    ListOf,
    Nested,
    OneOf,
    Row,
    declare,
    integer,
    one_of,
    tag,
    text,
    unchecked,
)
from swarm.spreading import SpreadKv, SpreadOpen, SpreadRows, SpreadTaken

PREFILL = "prefill"
DECODE = "decode"
PHASES = (PREFILL, DECODE)
# A verification step (speculative decoding: a step with `spec`) carries a token and the drafts
# after it, at most this many in all, and may start up to MAX_REWIND positions before the end of
# what the session holds (the drafts of rounds a rejection made stale), never before a plain step.
MAX_VERIFY_TOKENS = 16
MAX_REWIND = 64


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
        return HOP.write(self)


# a hop travels as [host, port, start, end, peer, tls, relay]; peer, tls and relay came later
HOP = Row(Hop, 5, "route hop")


@dataclass(frozen=True)
class Picking:
    """How a route's last hop picks each token after the session's steps (swarm.model.sampling.
    Sampler: greedy at temperature 0, else a draw fixed by `seed` and the position), so that a
    Result carries token ids, not the final hidden states the client would turn into them."""

    temperature: float
    top_p: float
    top_k: int
    seed: int

    def __post_init__(self) -> None:
        if not (0.0 <= self.temperature < float("inf") and 0.0 < self.top_p <= 1.0):
            raise ProtocolError(f"picking: temperature {self.temperature}, top_p {self.top_p}")
        if not (0 <= self.top_k < 2**31 and 0 <= self.seed < 2**64):
            raise ProtocolError(f"picking: top_k {self.top_k}, seed {self.seed}")

    @classmethod
    def of(cls, sampler) -> Picking:
        s = sampler.sampling
        return cls(float(s.temperature), float(s.top_p), int(s.top_k), int(sampler.seed))


PICKING = Row(Picking, 4, "picking")


def _last_hop(parsed: dict[str, Any]) -> int:
    return len(parsed["route"]) - 1


@dataclass(frozen=True)
class Open:
    """Open a session on this node for blocks route[hop], then forward along the route."""

    sid: str = text(64)
    route: tuple[Hop, ...] = declare(ListOf(HOP, 1, 64, "hops"))
    hop: int = integer(0, _last_hop)
    fingerprint: str = text(128)
    wire_dtype: str = text(16)
    max_length: int = integer(1, 1 << 20)
    sink_token: str = text(64)
    # the user's host as the first node saw it, forwarded as is: a next hop gives each user
    # behind a forwarding node a share of its own (swarm.node.admission.share_of)
    origin: str = text(64, default="")
    # on the last hop only: once the prompt is in, hand the session and its cache over to this
    # node serving the same blocks (prefill on one node, decode on another; swarm.node.handover)
    handoff: Hop | None = declare(HOP, default=None)
    # read by the last hop: it picks the tokens (Result.picks) where it holds the model's head
    picking: Picking | None = declare(PICKING, default=None)
    t: str = tag("open")


@dataclass(frozen=True)
class Opened:
    sid: str = text(64)
    # from the route's first hop to the client: its blocks start at 0 and it holds the
    # embedding table, so steps may carry token ids alone (Step.hidden left out)
    embeds: bool = declare(OneOf((False, True)), default=False)
    t: str = tag("opened")


@dataclass(frozen=True)
class Attach:
    """The client's claim on the last node's output, proven by the token sent in Open."""

    sid: str = text(64)
    sink_token: str = text(64)
    t: str = tag("attach")


@dataclass(frozen=True)
class Attached:
    sid: str = text(64)
    t: str = tag("attached")


@dataclass(frozen=True)
class Step:
    """Activations for tokens [pos, pos + n) of a phase whose input ends at `end`. With `spec`
    (a verification round's id, the client's): a decode step of up to MAX_VERIFY_TOKENS tokens
    that may rewind the session to `pos`; the last hop returns every token's hidden state."""

    sid: str = text(64)
    phase: str = one_of(PHASES)
    pos: int = integer()
    end: int = integer(1)
    # a wire tensor map: the receiver, which knows the shape expected, decodes and checks it;
    # None to a first hop that embeds (Opened.embeds): it looks `ids` up itself
    hidden: Any = unchecked()
    spec: int | None = integer(1, default=None)
    # the tokens' ids, one a position: to a first hop that embeds them, and where the model's
    # layers read them (Gemma 4's per-layer inputs) to every hop; otherwise left out
    ids: tuple[int, ...] | None = declare(
        ListOf(Integer(0, 2**31 - 1), 1, 1 << 20, "token ids"), default=None
    )
    t: str = tag("step")


@dataclass(frozen=True)
class Result:
    """Last node -> client: hidden state of token end-1 after the final block; for a
    verification step (`spec`, its round's id), of each of its tokens. Or, where the session
    was opened with `picking` and the node holds the head, `hidden` None and `picks`: the
    token picked after each of those."""

    sid: str = text(64)
    end: int = integer(1)
    hidden: Any = unchecked()
    spec: int | None = integer(1, default=None)
    picks: tuple[int, ...] | None = declare(
        ListOf(Integer(0, 2**31 - 1), 1, MAX_VERIFY_TOKENS, "picks"), default=None
    )
    t: str = tag("result")


@dataclass(frozen=True)
class Close:
    sid: str = text(64)
    t: str = tag("close")


@dataclass(frozen=True)
class Ping:
    nonce: int = integer(0, 2**63)
    t: str = tag("ping")


@dataclass(frozen=True)
class Pong:
    """`rx_bytes` and `rx_us`: how the last large frame before the ping arrived, bytes after the
    first read of it over microseconds until its last byte (0, 0: no such frame)."""

    nonce: int = integer(0, 2**63)
    t: str = tag("pong")
    rx_bytes: int = integer(default=0)
    rx_us: int = integer(default=0)


MAX_ERROR_MESSAGE = 4096


@dataclass(frozen=True)
class Error:
    code: str = text(64)
    message: str = text(MAX_ERROR_MESSAGE)
    sid: str = text(64, default="")
    hop: int = integer(-1, 1024, default=-1)
    t: str = tag("error")

    @classmethod
    def of(cls, exc: SwarmError, sid: str = "", hop: int = -1) -> Error:
        # a message quoting a stranger's long value would make a frame its peer refuses
        return cls(code=exc.code, message=str(exc)[:MAX_ERROR_MESSAGE], sid=sid, hop=hop)

    def exception(self) -> SwarmError:
        exc = error_from_code(self.code, self.message)
        exc.hop = self.hop  # type: ignore[attr-defined]
        exc.reported = True  # type: ignore[attr-defined]  # by a node, not seen by us
        return exc


RELAY_OPS = (
    *("listen", "challenge", "prove", "listening", "splice", "spliced", "reverse", "accept"),
    *("dialback", "dialed"),
)


@dataclass(frozen=True)
class Relay:
    """Plaintext, before TLS, to a node that relays for nodes nobody can dial (swarm.relay).
    `op`: listen / challenge / prove / listening (a node behind NAT registers `peer`, proving it
    is that node: the relay sends a nonce `token`, the node answers with its signing `key` and
    its `proof`, the signature of `relay_claim`), splice / spliced (a dialler asks for `peer`),
    reverse (the relay asks `peer` to connect back, `token`, for a dialler at
    `addr`), accept (that connection back), dialback / dialed (dial `addr` with key `tls` and
    say whether it answered: `error` empty if so)."""

    op: str = one_of(RELAY_OPS, cut=200)
    peer: str = text(256, default="")
    token: str = text(256, default="")
    addr: str = text(256, default="")
    tls: str = text(256, default="")
    error: str = text(1024, default="")
    key: str = text(1024, default="")
    proof: str = text(1024, default="")
    t: str = tag("relay")


def relay_claim(relay: str, peer: str, nonce: str) -> bytes:
    """What a node behind NAT signs to register as `peer` with relay `relay` (a node id): bound
    to that relay and its fresh nonce, so a proof cannot be replayed to another relay."""
    return f"swarm relay listen|{relay}|{peer}|{nonce}".encode()


@dataclass(frozen=True)
class Handover:
    """A leaving node -> a replica serving the same blocks: take session `open.sid`, whose
    cache of `length` positions follows as KvChunk frames (StateChunk for its states), then
    HandoverEnd. `open` is the session's open with this replica in the leaving node's place."""

    open: Open = declare(Nested(Open))
    length: int = integer(1, 1 << 20)
    peer: str = text(64, default="")  # the sender's node id, proven by its HandoverEnd
    t: str = tag("handover")


@dataclass(frozen=True)
class KvChunk:
    """Positions [pos, pos + n) of one layer's cache of a session being handed over: `keys` and
    `values` as wire tensors [1, n, kv_heads * head_dim] in the cache's own dtype. A layer
    with a sliding window sends only the positions its ring holds."""

    sid: str = text(64)
    layer: int = integer(0, 4096)
    pos: int = integer(0, 1 << 20)
    keys: Any = unchecked()
    values: Any = unchecked()
    t: str = tag("kv")


STATE_PARTS = ("conv", "s")


@dataclass(frozen=True)
class StateChunk:
    """Rows [row, row + n) of one part of a Gated DeltaNet layer's state, sent after the paused
    session's last KV: `part` "conv" (its conv's last inputs, [1, conv_dim, kernel]) or "s" (the
    recurrent state, [1, v_heads * k_dim, v_dim]), as float32 wire tensors."""

    sid: str = text(64)
    layer: int = integer(0, 4096)
    part: str = one_of(STATE_PARTS)
    row: int = integer(0, 1 << 24)
    data: Any = unchecked()
    t: str = tag("state")


@dataclass(frozen=True)
class HandoverTail:
    """The session went on while its cache was sent: positions up to `length` follow (the
    sender paused it before sending them)."""

    sid: str = text(64)
    length: int = integer(1, 1 << 20)
    t: str = tag("handover_tail")


@dataclass(frozen=True)
class HandoverEnd:
    """The last frame of a handover: the sender `peer` proves its node id by signing
    `handover_claim` with the key behind it (`key`, `proof`, as swarm.dht.NodeKey.sign)."""

    sid: str = text(64)
    digest: str = text(64)
    peer: str = text(64)
    key: str = text(1024)
    proof: str = text(1024)
    t: str = tag("handover_end")


@dataclass(frozen=True)
class Taken:
    """The replica holds the handed-over session and its cache."""

    sid: str = text(64)
    t: str = tag("taken")


@dataclass(frozen=True)
class Moved:
    """Session `sid`'s hop `hop` now runs on `to` (its cache moved there, `length` positions):
    whoever sends it steps, or reads its results, goes there with Resume."""

    sid: str = text(64)
    hop: int = integer(0, 63)
    to: Hop = declare(HOP)
    length: int = integer(1, 1 << 20)
    t: str = tag("moved")


_RESUME_AS = AnyTrue(("owner", "sink"))  # a claim as owner, sink or both; never neither


@dataclass(frozen=True)
class Resume:
    """Claim a handed-over session on its new node, proven by the open's sink token: as its
    `owner` (who sends steps), its `sink` (who reads results), or both."""

    sid: str = text(64)
    sink_token: str = text(64)
    owner: bool = declare(_RESUME_AS)
    sink: bool = declare(_RESUME_AS)
    t: str = tag("resume")


@dataclass(frozen=True)
class Resumed:
    sid: str = text(64)
    t: str = tag("resumed")


@dataclass(frozen=True)
class Release:
    """Owner -> leaving node (then leaving node -> replica): no more steps of `sid` follow on
    this connection; those sent before it are all in."""

    sid: str = text(64)
    t: str = tag("release")


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
    | StateChunk
    | HandoverTail
    | HandoverEnd
    | Taken
    | Moved
    | Resume
    | Resumed
    | Release
    | Lend
    | Lent
    | AttendLent
    | LentPartial
    | LendLeaving
    | Reclaim
    | SpreadOpen
    | SpreadTaken
    | SpreadRows
    | SpreadKv
)
_CODEC = Codec(*typing.get_args(Message))


def parse_message(d: dict[str, Any]) -> Message:
    """The message a decoded frame holds, each field checked against its declaration; anything
    else (an unknown type, a field missing, of the wrong type or out of bounds) a ProtocolError."""
    return _CODEC.parse(d)


def to_wire(message: Message) -> dict[str, Any]:
    """The map `message` travels as (swarm.wire.encode_frame frames it)."""
    return _CODEC.encode(message)
