"""A session longer than this node keeps, its oldest KV blocks lent to another node (DistKV's
rBlocks, issue #52; the lender's side is swarm/node/lender.py).

A session opened for more tokens than one session may reserve here (`session_room`: the node's
`--max-cache-tokens`, or an address's share of it if less) keeps `local_tokens` positions here
(half the node's cache, or that share if less): per layer attending over the whole session,
the newest `cap` positions [offset, offset + cap); a layer with a sliding window shorter than
the session keeps its ring and borrows nothing (it attends to nothing older). When a pass would
write past the local positions, the oldest whole blocks go to the lender (`Lend`), layer by
layer, and the local ones shift down. Each layer's attention is then its local piece merged
with the lender's (`AttendLent`: the rows' queries go there, their partial attention and
log-sum-exp come back; swarm.model.partial_attention), which is the attention over every
position: a borrowing session's greedy tokens are an unborrowed one's.

The lender, its connection, and the move of what it holds when it leaves:
swarm/node/borrow_link.py. The pass runs in a compute thread, which sends a layer's query to
the lender itself, computes the layer's local piece meanwhile, then waits for the lender's.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from swarm.errors import ProtocolError
from swarm.lending import AttendLent, Lend, LentPartial
from swarm.model.partial_attention import (
    Partial,
    cache_partial,
    merge,
    partial_attention,
    sink_partial,
)
from swarm.node.handover.cache import dtype_name
from swarm.wire import pack_tensor, unpack_tensor

if TYPE_CHECKING:
    from swarm.model.blocks import Block, Span
    from swarm.model.config import ModelConfig
    from swarm.node.config import Limits

BLOCK = 16  # positions a block: what moves to a lender at least, and whole


def session_room(limits: Limits) -> int:
    """The most cache tokens one session reserves here: the node's cache, within one address's
    share and what the previous node of a route may forward (swarm.node.session_table). A
    longer session borrows: refused past the share, it would need the operator to raise
    --max-host-cache-tokens beside --max-session-tokens."""
    lim = limits
    return min(lim.max_cache_tokens, lim.max_host_cache_tokens, lim.max_forwarded_cache_tokens)


def local_tokens(config: ModelConfig, limits: Limits, max_length: int) -> int | None:
    """The positions a session of `max_length` keeps here if it must borrow (half the node's
    cache, or `session_room` if less; whole blocks); None if it fits `session_room`, or cannot
    borrow (latent attention, Gated DeltaNet's state, Gemma 4's per-layer inputs and shared
    KV, or too little room for two blocks)."""
    room = session_room(limits)
    if max_length <= room:
        return None
    if config.latent is not None or config.delta is not None:
        return None
    if config.per_layer or config.kv_shared:
        return None
    cap = min(limits.max_cache_tokens // 2, room) // BLOCK * BLOCK
    return cap if cap >= 2 * BLOCK else None


def longest_borrowing(cap: int, lendable: int) -> int:
    """The longest session keeping `cap` positions here whose lent positions all fit in
    `lendable` at one lender (`lent_at_most`'s inverse)."""
    return max(0, lendable + cap - _ahead(cap))


def lent_at_most(cap: int, max_length: int) -> int:
    """The most positions a session of `max_length` keeping `cap` here ever lends."""
    return max(0, max_length - cap + _ahead(cap))


def _ahead(cap: int) -> int:
    """A pass lends whole blocks, a quarter of the local positions at least (`_make_room`), so
    what is lent runs ahead of `max_length - cap` by less than that quarter rounded up to a
    block."""
    return _whole_blocks(cap // 4)


def _whole_blocks(positions: int) -> int:
    """`positions` rounded up to whole blocks."""
    return -(-positions // BLOCK) * BLOCK


@dataclass
class BorrowedCache:
    """A borrowing session's cache on this hop: `keys`, `values` per layer [1, kv_heads, slots,
    head_dim], a ring for a windowed layer, else positions [offset, offset + cap)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lent: list[bool]  # per layer: it borrows (its oldest positions are at the lender)
    cap: int
    length: int = 0
    offset: int = 0  # positions [0, offset) of every lending layer are at the lender
    overwritten: dict = field(default_factory=dict)  # KVCache's; no rewinds here
    states: list = field(default_factory=list)  # KVCache's (Gated DeltaNet): none borrow

    @classmethod
    def allocate(cls, span: Span, start: int, end: int, max_length: int, cap: int):
        config = span.config
        (k_heads, k_width), (v_heads, v_width) = config.cache_widths
        keys, values, lent = [], [], []
        for layer in range(start, end):
            window = config.window(layer)
            ring = window is not None and window < max_length
            slots = window if ring else cap
            keys.append(torch.zeros((1, k_heads, slots, k_width), dtype=span.cache_dtype))
            values.append(torch.zeros((1, v_heads, slots, v_width), dtype=span.cache_dtype))
            lent.append(not ring)
        return cls(keys, values, lent, cap)

    @property
    def position_bytes(self) -> int:
        """What one lent position takes: every lending layer's keys and values."""
        return sum(
            k[0, :, 0].nbytes + v[0, :, 0].nbytes
            for k, v, lent in zip(self.keys, self.values, self.lent)
            if lent
        )

    def oldest(self, n: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """The `n` oldest local positions of each lending layer, as the wire carries them: [1,
        n, heads * width]."""
        return [
            (layer, _rows(k[0, :, :n]), _rows(v[0, :, :n]))
            for layer, (k, v, lent) in enumerate(zip(self.keys, self.values, self.lent))
            if lent
        ]

    def shift(self, n: int) -> None:
        """Positions [offset, offset + n) are at the lender now: the rest move down."""
        for k, v, lent in zip(self.keys, self.values, self.lent):
            if lent:
                k[0, :, : self.cap - n] = k[0, :, n:].clone()
                v[0, :, : self.cap - n] = v[0, :, n:].clone()
        self.offset += n


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[heads, n, width] -> [1, n, heads * width]."""
    return t.transpose(0, 1).reshape(1, t.shape[1], -1).contiguous()


def lend_frames(sid: str, cache: BorrowedCache, n: int) -> list[Lend]:
    """The `n` oldest local positions of every lending layer, to lend."""
    frames = []
    for layer, k, v in cache.oldest(n):
        _, heads, _, width = cache.keys[layer].shape
        kv = (pack_tensor(t, dtype_name(t.dtype)) for t in (k, v))
        frames.append(Lend(sid, layer, cache.offset, heads, width, *kv))
    return frames


def attend_request(sid: str, layer: int, upto: int, q: torch.Tensor, block: Block) -> AttendLent:
    """Rows q [rows, heads, head_dim] to attend over the `upto` lent positions of `layer`."""
    c = block.c
    return AttendLent(
        sid=sid,
        layer=layer,
        upto=upto,
        heads=c.heads,
        scale=c.scale,
        q=pack_tensor(q.reshape(1, q.shape[0], -1), "float32"),
        softcap=c.attn_softcap,
    )


def partial_of(reply: LentPartial, rows: int, block: Block) -> Partial:
    """The lender's piece, checked: out [rows, heads, head_dim], lse [rows, heads]."""
    c = block.c
    out = unpack_tensor(reply.out, hidden=c.heads * c.head_dim, max_tokens=rows, tokens=rows)
    lse = unpack_tensor(reply.lse, hidden=c.heads, max_tokens=rows, tokens=rows)
    return out[0].view(rows, c.heads, c.head_dim), lse[0]


class LentPiece(Protocol):
    """A query sent to the lender: its piece is `result()`; the connection stays the query's
    until then, or until the `with` block ends."""

    def result(self) -> Partial: ...

    def __enter__(self) -> LentPiece: ...

    def __exit__(self, *exc) -> None: ...


class Lending(Protocol):
    """A session's lender as a pass uses it, from a compute thread (swarm.node.borrow_link)."""

    def lend_sync(self, cache: BorrowedCache, n: int) -> None: ...

    def attend_soon(self, layer: int, upto: int, q: torch.Tensor, block: Block) -> LentPiece: ...


@torch.inference_mode()
def borrowed_pass(
    span: Span,
    cache: BorrowedCache,
    lender: Lending,
    start: int,
    end: int,
    pos: int,
    hidden: torch.Tensor,
) -> torch.Tensor:
    """h [1, tokens, hidden] at positions [pos, pos + tokens) through blocks [start, end), in a
    compute thread: in pieces that fit the local positions, lending the oldest blocks first."""
    if cache.length != pos:
        raise ProtocolError(
            f"step at position {pos} ran before the session's earlier positions"
            f" (cache holds {cache.length}); wait for each result"
        )
    piece = cache.cap - BLOCK  # after lending, fewer than a block of older ones stay local
    outs = []
    for at in range(0, hidden.shape[1], piece):
        h = hidden[0, at : at + piece].float()
        _make_room(cache, lender, pos + at + h.shape[0])
        outs.append(_through(span, cache, lender, start, end, pos + at, h))
        cache.length = pos + at + h.shape[0]
    return torch.cat(outs).unsqueeze(0)


def _make_room(cache: BorrowedCache, lender: Lending, upto: int) -> None:
    short = upto - cache.offset - cache.cap
    if short <= 0:
        return
    n = max(_whole_blocks(short), _ahead(cache.cap))
    n = min(n, (cache.length - cache.offset) // BLOCK * BLOCK)
    lender.lend_sync(cache, n)
    cache.shift(n)


def _through(span, cache: BorrowedCache, lender: Lending, start, end, pos, x) -> torch.Tensor:
    """x [tokens, hidden] at positions [pos, pos + tokens) through blocks [start, end)."""
    config, n = span.config, x.shape[0]
    turns = {rope: r.cos_sin(pos, n) for rope, r in span.rotaries.items()}
    for i in range(start, end):
        layer = i - start
        cos, sin = turns[config.rotary_of(i)]
        block = span.blocks[i - span.start]
        k_cache, v_cache = cache.keys[layer], cache.values[layer]
        if cache.lent[layer]:
            x = _attend_layer(block, cache, lender, layer, x, pos, cos, sin)
        else:  # a ring: the block's own
            x = block.forward(x, k_cache, v_cache, pos, cos, sin, config.window(i))
    return x


def _attend_layer(block, cache: BorrowedCache, lender: Lending, layer, x, pos, cos, sin):
    c, n = block.c, x.shape[0]
    q, k, v, gate = block._attention_inputs(x, cos, sin)  # q [n, heads, hd], k, v [n, kv, hd]
    # the query leaves at once: the lender computes its piece while this thread computes the
    # local one
    trip = lender.attend_soon(layer, cache.offset, q, block) if cache.offset else nullcontext()
    with trip as lent:
        lo = pos - cache.offset
        k_cache, v_cache = cache.keys[layer], cache.values[layer]
        k_cache[0, :, lo : lo + n] = k.transpose(0, 1)
        v_cache[0, :, lo : lo + n] = v.transpose(0, 1)
        if n == 1:
            parts = [cache_partial(q, k_cache, v_cache, lo + 1, c.scale, c.attn_softcap)]
        else:  # each row sees the positions up to its own
            mask = torch.arange(cache.offset, pos + n) <= torch.arange(pos, pos + n)[:, None]
            keys, values = k_cache[0, :, : lo + n], v_cache[0, :, : lo + n]
            parts = [partial_attention(q, keys, values, c.scale, mask, c.attn_softcap)]
        if lent is not None:
            parts.append(lent.result())
    if block.sinks is not None:
        parts.append(sink_partial(block.sinks, n, c.head_dim))
    out, _ = merge(parts)
    return block._finish(x, out.reshape(n, c.heads * c.head_dim), gate)
