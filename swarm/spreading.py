"""Data-plane messages of a prompt pass spread over two nodes serving the same blocks
(swarm.node.spread, swarm.node.spread_replica); swarm.protocol parses them with the rest.

The owner of a session computes rows [pos, at) of a long prompt pass and asks a replica of its
blocks for rows [at, at + rows) (`SpreadOpen`, answered `SpreadTaken` or an Error): the replica's
input rows follow as `SpreadRows`, and each layer's keys and values of positions [0, at) as
`SpreadKv` as soon as the owner has them. The replica answers with its rows' keys and values,
layer by layer (`SpreadKv`), then its rows' outputs (`SpreadRows`). Everything of one spread
belongs to the connection it came on, one spread a connection at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarm.schema import integer, tag, text, unchecked

MAX_SPREAD_POSITIONS = 1 << 20  # a pass's end: a session longer than this is refused anyway


@dataclass(frozen=True)
class SpreadOpen:
    """Owner -> replica: compute rows [at, at + rows) of session `sid` through blocks
    [start, end) of the weights `fingerprint`; positions [0, at) of every layer follow."""

    sid: str = text(64)
    fingerprint: str = text(128)
    start: int = integer(0, 4095)
    end: int = integer(1, 4096)
    at: int = integer(1, MAX_SPREAD_POSITIONS)
    rows: int = integer(1, MAX_SPREAD_POSITIONS)
    t: str = tag("spread_open")


@dataclass(frozen=True)
class SpreadTaken:
    """The replica computes the rows; what it needs may come."""

    sid: str = text(64)
    t: str = tag("spread_taken")


@dataclass(frozen=True)
class SpreadRows:
    """Rows [row, row + n) of the replica's part, counted from its first: the input (owner ->
    replica) or the output (replica -> owner), a float32 wire tensor [1, n, hidden]."""

    sid: str = text(64)
    row: int = integer(0, MAX_SPREAD_POSITIONS)
    hidden: Any = unchecked()
    t: str = tag("spread_rows")


@dataclass(frozen=True)
class SpreadKv:
    """Positions [pos, pos + n) of layer `layer` (of the spread's blocks, from 0): `keys` and
    `values` as wire tensors [1, n, kv_heads * head_dim] in the cache's own dtype."""

    sid: str = text(64)
    layer: int = integer(0, 4095)
    pos: int = integer(0, MAX_SPREAD_POSITIONS)
    keys: Any = unchecked()
    values: Any = unchecked()
    t: str = tag("spread_kv")
