"""NodeRecords as the pure tests of placement, coverage, routing and health make them."""

from __future__ import annotations

from swarm.records import NodeRecord

LAYERS = 12  # the model of placement's and coverage's records (`rec`)
ROUTE_LAYERS = 6  # the model of routing's records (`route_rec`)


def node_record(peer: str, start: int, end: int, state: str = "online", **fields) -> NodeRecord:
    """`peer` serving blocks start:end of model "m" (fingerprint "f", version "v", `end` blocks)
    at 127.0.0.1:1; `fields` set any other field of the record."""
    required = {"addr": "127.0.0.1:1", "model": "m", "fingerprint": "f", "version": "v"}
    fields = {**required, "num_layers": end, **fields}
    return NodeRecord(peer=peer, start=start, end=end, state=state, **fields)


def rec(
    peer: str, start: int, end: int, state: str = "online", tps: float = 10.0, sessions: int = 0
) -> NodeRecord:
    """A node of a LAYERS-block model at `tps` tokens/s, all at one address."""
    return node_record(
        peer, start, end, state, num_layers=LAYERS, throughput=tps, sessions=sessions
    )


def route_rec(
    peer: str, start: int, end: int, sessions: int = 0, throughput: float = 100.0
) -> NodeRecord:
    """A TLS node of a ROUTE_LAYERS-block model with room for 4096 tokens, peers with names of
    different lengths at different addresses."""
    return node_record(
        peer, start, end, addr=f"10.0.0.{len(peer)}:7000", num_layers=ROUTE_LAYERS,
        free_cache_tokens=4096, throughput=throughput, sessions=sessions, tls="a" * 64,
    )  # fmt: skip
