"""Lending KV blocks (DistKV's rBlocks, issue #52): this node holds the oldest positions of other
nodes' sessions, short of cache, and attends their query rows over them.

A borrower (swarm/node/borrow.py) sends a session's blocks layer by layer (`Lend`), each after
those already lent, and per layer and pass its rows' queries (`AttendLent`); the answer is their
attention over the lent positions with its log-sum-exp (`LentPartial`), which the borrower
merges with its own. What is lent belongs to the connection it came on: another connection
cannot read or extend it (a forged sid finds nothing), and it is gone when that connection ends.
Bounded: `max_bytes` in all, `max_host_bytes` per borrowing address; a lend that does not fit
is refused (LendRefused) before a byte is kept. A lender leaving (`leave`) takes no new loans;
each borrower asks its blocks back (`Reclaim`, answered by KvChunk frames) to lend them on.

`LendTable` is sans IO (messages in, messages out); the node's connections drive it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from swarm.errors import BlocksNotHeld, LendRefused, ProtocolError, ShapeMismatch
from swarm.lending import MAX_LENT_ROWS, AttendLent, Lend, Lent, LentPartial, Reclaim
from swarm.model.partial_attention import cache_partial, partial_attention
from swarm.node.handover.cache import dtype_name
from swarm.protocol import KvChunk
from swarm.wire import pack_tensor, unpack_tensor

# query rows x lent positions attended on the trio thread; more go to a worker thread
INLINE_ATTEND = 8192
MAX_LEND_POSITIONS = 1 << 16  # positions of one layer in one Lend: a frame bounds it anyway


@dataclass
class Loan:
    """What one connection lent of one session: per layer, positions [0, n) as [kv_heads, n,
    head_dim] in the dtype they came in."""

    host: str
    kv_heads: int
    head_dim: int
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.keys.values(), *self.values.values()))

    def length(self, layer: int) -> int:
        k = self.keys.get(layer)
        return 0 if k is None else k.shape[1]


class LendTable:
    """Every loan this node holds, keyed by (connection, session id)."""

    def __init__(self, max_bytes: int, max_host_bytes: int):
        self.max_bytes = max_bytes
        self.max_host_bytes = max_host_bytes
        self._loans: dict[tuple[object, str], Loan] = {}
        self.leaving = False  # no new loans: those held are being handed on
        self._reclaimed: set[tuple[object, str]] = set()  # asked back (to be lent elsewhere)
        self.handed_on = 0  # loans asked back whose connection then ended

    @property
    def lent_bytes(self) -> int:
        return sum(loan.nbytes for loan in self._loans.values())

    @property
    def free_for_one(self) -> int:
        """Bytes one more borrowing node could get now: its share, or what is left if less
        (one already borrowing here gets less; a record says this)."""
        if self.leaving:
            return 0
        return max(0, min(self.max_bytes - self.lent_bytes, self.max_host_bytes))

    @property
    def loans(self) -> int:
        return len(self._loans)

    def holds(self, conn: object) -> bool:
        return any(k[0] is conn for k in self._loans)

    def leave(self) -> list[tuple[object, str]]:
        """Take no new loans from now; the (connection, session id) of each loan held, whose
        borrower is to hear that this lender leaves."""
        self.leaving = True
        return list(self._loans)

    def lend(self, conn: object, host: str, msg: Lend) -> Lent:
        """Keep `msg`'s positions for (`conn`, its sid); raises the SwarmError the borrower
        gets (LendRefused when full, ProtocolError or ShapeMismatch when malformed)."""
        loan = self._loans.get((conn, msg.sid))
        if loan is not None and (loan.kv_heads, loan.head_dim) != (msg.kv_heads, msg.head_dim):
            raise ShapeMismatch(
                f"session {msg.sid[:8]}... lent {loan.kv_heads} heads of {loan.head_dim} before,"
                f" now {msg.kv_heads} of {msg.head_dim}"
            )
        held = loan.length(msg.layer) if loan is not None else 0
        if msg.pos != held:
            raise ProtocolError(
                f"lend of layer {msg.layer} at position {msg.pos}: this lender holds {held}"
                " positions of it; blocks are lent in order"
            )
        width = msg.kv_heads * msg.head_dim
        keys = _kv(msg.keys, width)
        values = _kv(msg.values, width, keys.shape[1])
        if keys.dtype != values.dtype:
            raise ShapeMismatch("lent keys and values differ in dtype")
        if loan is None and self.leaving:
            raise LendRefused("this lender is leaving: it takes no new loans")
        self._check_room(host, 2 * keys.nbytes)
        if loan is None:
            loan = self._loans[(conn, msg.sid)] = Loan(host, msg.kv_heads, msg.head_dim)
        # [1, n, kv_heads * head_dim] -> [kv_heads, n, head_dim], as a cache holds them
        k, v = (t[0].view(-1, msg.kv_heads, msg.head_dim).transpose(0, 1) for t in (keys, values))
        old_k, old_v = loan.keys.get(msg.layer), loan.values.get(msg.layer)
        loan.keys[msg.layer] = k.contiguous() if old_k is None else torch.cat((old_k, k), 1)
        loan.values[msg.layer] = v.contiguous() if old_v is None else torch.cat((old_v, v), 1)
        return Lent(sid=msg.sid, layer=msg.layer, length=loan.length(msg.layer))

    def query(
        self, conn: object, msg: AttendLent
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Check `msg` against what (`conn`, its sid) lent: (q [rows, heads, head_dim], keys,
        values [kv_heads, upto, head_dim]) to attend; raises BlocksNotHeld or ShapeMismatch."""
        loan = self._loans.get((conn, msg.sid))
        held = loan.length(msg.layer) if loan is not None else 0
        if loan is None or held != msg.upto:
            raise BlocksNotHeld(
                f"this lender holds {held} positions of layer {msg.layer} of session"
                f" {msg.sid[:8]}... for this connection, the query names {msg.upto}"
            )
        if msg.heads % loan.kv_heads:
            raise ShapeMismatch(
                f"{msg.heads} query heads do not group over {loan.kv_heads} key heads"
            )
        q = unpack_tensor(msg.q, hidden=msg.heads * loan.head_dim, max_tokens=MAX_LENT_ROWS)
        q = q[0].view(-1, msg.heads, loan.head_dim)
        return q, loan.keys[msg.layer], loan.values[msg.layer]

    def reclaim(self, conn: object, msg: Reclaim, frame_bytes: int) -> Iterator[KvChunk]:
        """Everything (`conn`, its sid) lent, as KvChunk frames of at most about `frame_bytes`
        each (BlocksNotHeld if it lent nothing); kept here until the connection ends."""
        loan = self._loans.get((conn, msg.sid))
        if loan is None:
            raise BlocksNotHeld(f"this connection lent nothing of session {msg.sid[:8]}...")
        self._reclaimed.add((conn, msg.sid))
        return _chunks(msg.sid, loan, frame_bytes)

    def forget(self, conn: object) -> None:
        """The connection ended: what it lent goes."""
        for key in [k for k in self._loans if k[0] is conn]:
            del self._loans[key]
            if key in self._reclaimed:
                self._reclaimed.discard(key)
                self.handed_on += 1

    def _check_room(self, host: str, more: int) -> None:
        mine = sum(loan.nbytes for loan in self._loans.values() if loan.host == host)
        if mine + more > self.max_host_bytes:
            raise LendRefused(
                f"this lender holds {mine} bytes for {host}, its share is {self.max_host_bytes};"
                f" {more} more do not fit"
            )
        total = self.lent_bytes
        if total + more > self.max_bytes:
            raise LendRefused(
                f"this lender has {max(0, self.max_bytes - total)} bytes free to lend, the"
                f" blocks take {more}"
            )


def attend(msg: AttendLent, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
    """The rows' attention over the lent positions, as the reply (in a worker thread)."""
    if q.shape[0] == 1:  # a decode step's
        n = keys.shape[1]
        out, lse = cache_partial(q, keys[None], values[None], n, msg.scale, msg.softcap)
    else:
        out, lse = partial_attention(q, keys, values, msg.scale, softcap=msg.softcap)
    rows = q.shape[0]
    return LentPartial(
        sid=msg.sid,
        layer=msg.layer,
        out=pack_tensor(out.reshape(1, rows, -1), "float32"),
        lse=pack_tensor(lse.reshape(1, rows, -1), "float32"),
    )


def _chunks(sid: str, loan: Loan, frame_bytes: int) -> Iterator[KvChunk]:
    for layer in sorted(loan.keys):
        k, v = loan.keys[layer], loan.values[layer]  # [kv_heads, n, head_dim]
        width = k.shape[0] * k.shape[2]
        step = max(1, frame_bytes // (2 * width * k.element_size()))
        for at in range(0, k.shape[1], step):
            # [kv_heads, n, head_dim] -> [1, n, kv_heads * head_dim], as it was lent
            kv = [t[:, at : at + step].transpose(0, 1).reshape(1, -1, width) for t in (k, v)]
            keys, values = (pack_tensor(t.contiguous(), dtype_name(t.dtype)) for t in kv)
            yield KvChunk(sid=sid, layer=layer, pos=at, keys=keys, values=values)


def _kv(obj, width: int, tokens: int | None = None) -> torch.Tensor:
    return unpack_tensor(
        obj, hidden=width, max_tokens=MAX_LEND_POSITIONS, tokens=tokens, native=True
    )
