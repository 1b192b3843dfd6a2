"""Data-plane messages of KV blocks lent (swarm.node.lender, swarm.node.borrow_link): a
borrower keeps a connection to its lender per session; the lender forgets what it holds for a
connection when that connection ends. swarm.protocol parses them with the rest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarm.schema import integer, number, tag, text, unchecked

MAX_LENT_ROWS = 4096  # query rows in one AttendLent: a prompt pass's, at most
# query rows whose AttendLent and LentPartial each go in one write (swarm.transport `at_once`):
# a decode step's or a verification round's, 16 KiB a row at 8B size
AT_ONCE_ROWS = 16


@dataclass(frozen=True)
class Lend:
    """Borrower -> lender: hold positions [pos, pos + n) of layer `layer` of the borrower's
    session `sid` after those it holds already: `keys` and `values` as wire tensors [1, n,
    kv_heads * head_dim] in the cache's own dtype. Answered by Lent or an Error."""

    sid: str = text(64)
    layer: int = integer(0, 4096)
    pos: int = integer(0, 1 << 20)
    kv_heads: int = integer(1, 1024)
    head_dim: int = integer(1, 1024)
    keys: Any = unchecked()
    values: Any = unchecked()
    t: str = tag("lend")


@dataclass(frozen=True)
class Lent:
    """The lender holds positions [0, length) of (`sid`, `layer`)."""

    sid: str = text(64)
    layer: int = integer(0, 4096)
    length: int = integer(0, 1 << 20)
    t: str = tag("lent")


@dataclass(frozen=True)
class AttendLent:
    """Borrower -> lender: attend query rows `q` (a wire tensor [1, rows, heads * head_dim],
    float32, rotated) over the `upto` positions lent for (`sid`, `layer`), scores times
    `scale`, softcapped at `softcap` if given. Answered by LentPartial or an Error."""

    sid: str = text(64)
    layer: int = integer(0, 4096)
    upto: int = integer(1, 1 << 20)
    heads: int = integer(1, 1024)
    scale: float = number(0.0, 1e4)
    q: Any = unchecked()
    softcap: float | None = number(1e-3, 1e6, default=None)
    t: str = tag("attend_lent")


@dataclass(frozen=True)
class LentPartial:
    """The rows' attention over the lent positions (swarm.model.partial_attention): `out` [1,
    rows, heads * head_dim] and `lse` [1, rows, heads], float32."""

    sid: str = text(64)
    layer: int = integer(0, 4096)
    out: Any = unchecked()
    lse: Any = unchecked()
    t: str = tag("lent_partial")


@dataclass(frozen=True)
class LendLeaving:
    """Lender -> borrower, unasked: this lender leaves within its --grace; take the blocks of
    `sid` elsewhere (Reclaim) before it does, or the session replays."""

    sid: str = text(64)
    t: str = tag("lend_leaving")


@dataclass(frozen=True)
class Reclaim:
    """Borrower -> lender: send back every position lent for `sid`, as KvChunk frames, each
    lending layer in turn from position 0 (the lender holds them until the connection ends)."""

    sid: str = text(64)
    t: str = tag("reclaim")
