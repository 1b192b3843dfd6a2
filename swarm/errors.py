"""Errors a caller can catch. Each has a wire code so a node can send it back along a route."""

from __future__ import annotations


class SwarmError(Exception):
    """Base of every error this package raises on purpose."""

    code = "error"
    retry_elsewhere = False  # True: another route may succeed (busy, dead peer)


class ProtocolError(SwarmError):
    """A frame or message that does not follow the wire protocol."""

    code = "protocol"


class RewindRefused(ProtocolError):
    """A rewind to positions a sliding window's cache no longer holds what they overwrote:
    a node that took a session over (its ring filled by the transfer, without the slots a
    rewind gives back) or a round behind its time. The node computes honestly; the session
    replays its accepted tokens on a route, which rebuilds every cache."""

    code = "rewind_refused"
    retry_elsewhere = True


class FrameTooLarge(ProtocolError):
    code = "frame_too_large"


class ShapeMismatch(ProtocolError):
    """A tensor whose dtype, shape or size does not fit where it was sent."""

    code = "shape_mismatch"


class SessionNotFound(SwarmError):
    code = "session_not_found"


class FingerprintMismatch(SwarmError):
    """Client and node disagree on which weights "the model" is."""

    code = "fingerprint_mismatch"


class SpanError(SwarmError):
    """A layer range that is empty, out of order or beyond the model."""

    code = "span"


class RouteUnavailable(SwarmError):
    """No chain of online nodes covers every block of the model."""

    code = "route_unavailable"
    retry_elsewhere = True


class NodeBusy(SwarmError):
    """The node is at its session or cache limit, or shutting down. Try another route."""

    code = "busy"
    retry_elsewhere = True


class NoChatTemplate(SwarmError, ValueError):
    """A conversation was given to a model without a chat template (a base model): send it
    plain text instead."""

    code = "no_chat_template"


class CacheFull(SwarmError):
    """The sequence would exceed the session's or node's cache budget. Shorten the request."""

    code = "cache_full"


class PeerFailed(SwarmError):
    """A node on the route died, hung or dropped the connection."""

    code = "peer_failed"
    retry_elsewhere = True

    def __init__(self, message: str, hop: int | None = None, peer: str | None = None):
        super().__init__(message)
        self.hop = hop
        self.peer = peer


class LenderFailed(PeerFailed):
    """The node lending a session's oldest KV blocks died or hung: the hop that reports it is
    sound, and a replay there borrows anew (from another lender)."""

    code = "lender_failed"


class UnannouncedPeer(PeerFailed):
    """An open names a next hop at an address the DHT does not announce for that peer: the
    node dials nobody on a stranger's word. A client whose view was stale routes elsewhere."""

    code = "unannounced_peer"


class WrongPeer(PeerFailed):
    """The peer at a node's address failed to prove, by the TLS key its signed DHT record
    names, that it is that node (an impostor, or a new node at an old address)."""

    code = "wrong_peer"


class PlaintextRefused(ProtocolError):
    """A connection to a TLS node began without a TLS handshake. Dial nodes with
    swarm.transport.dial_hop (or connect with the key id their record names)."""

    code = "tls_required"

    def __init__(self, message: str = ""):
        super().__init__(
            message or "this node speaks only TLS: dial it with the key id its DHT record names"
        )


class MissingShards(SwarmError, FileNotFoundError):
    """A model split into GGUF shards (llama.cpp's gguf-split) lacks, beside the one given,
    shards holding tensors this process needs: `files` names them (their paths)."""

    code = "missing_shards"

    def __init__(self, message: str, files: tuple[str, ...] = ()):
        super().__init__(message)
        self.files = files


class SpeculationRefused(SwarmError, ValueError):
    """Speculative decoding asked of a model whose caches cannot rewind a round's rejected
    drafts (Gated DeltaNet's fixed-size state: Qwen3.5)."""

    code = "speculation_refused"


class HandoverRefused(SwarmError):
    """A session's cache handed over by a leaving node was refused: malformed, incomplete, for
    other weights or blocks, or not proven to come from an announced node of this model. The
    session is dropped here; nothing else is."""

    code = "handover_refused"


class LendRefused(NodeBusy):
    """A lender cannot hold the KV blocks offered: its lending memory, or the borrower's share
    of it, is full. The borrower tries another lender."""

    code = "lend_refused"


class SpreadRefused(NodeBusy):
    """A replica will not compute part of a prompt pass: other weights or blocks, a pass
    longer than it takes, or one spread already running for it. The owner asks another
    replica, or computes the pass alone."""

    code = "spread_refused"


class BlocksNotHeld(SwarmError):
    """A query for KV blocks this lender does not hold for that session and layer (never lent
    on this connection, or fewer positions than the query names)."""

    code = "blocks_not_held"


class DhtUnavailable(SwarmError):
    """This process's DHT peer cannot be asked: the swarm's directory cannot be read or
    written until it answers again (a route elsewhere would need it too)."""

    code = "dht_unavailable"


class DhtGone(DhtUnavailable):
    """The DHT process has exited, or does not answer: nothing more will come from it."""


class DhtBusy(DhtUnavailable):
    """A DHT call abandoned after its timeout is still running; hivemind's pipe is not shared."""


ERRORS_BY_CODE: dict[str, type[SwarmError]] = {
    cls.code: cls
    for cls in (
        SwarmError,
        ProtocolError,
        RewindRefused,
        FrameTooLarge,
        ShapeMismatch,
        SessionNotFound,
        FingerprintMismatch,
        SpanError,
        RouteUnavailable,
        NodeBusy,
        CacheFull,
        PeerFailed,
        LenderFailed,
        UnannouncedPeer,
        WrongPeer,
        PlaintextRefused,
        HandoverRefused,
        LendRefused,
        SpreadRefused,
        BlocksNotHeld,
        DhtUnavailable,
    )
}


def error_from_code(code: str, message: str) -> SwarmError:
    return ERRORS_BY_CODE.get(code, SwarmError)(message)
