"""The compute a session hands to the lanes (compute.py): one forward pass over a session's
prompt or step, or one decode pass over several sessions' steps. Each runs in a compute thread,
never on the trio thread, and checks first that the step comes at its session's cache position.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import outcome
import torch

from swarm.errors import ProtocolError, SwarmError
from swarm.model.blocks import KVCache, Span

log = logging.getLogger("swarm.node")


def forward_pass(
    span: Span, cache: KVCache, start: int, end: int, pos: int, hidden: torch.Tensor, ids=None
) -> torch.Tensor:
    """One forward pass through blocks start:end from position `pos`, in a compute thread;
    `ids`: the tokens' ids, for a model whose layers read them (Gemma 4)."""
    _check_position(cache, pos)
    return span.forward(hidden, cache, pos, start, end, ids=ids)


def verify_pass(
    span: Span, cache: KVCache, start: int, end: int, pos: int, hidden: torch.Tensor, ids=None
) -> torch.Tensor:
    """A verification round's tokens [1, n, hidden] at positions [pos, pos + n) through blocks
    start:end, in a compute thread: as n one-token decode steps of one pass (the matmuls on
    the stacked rows, each row's attention as a decode step's), so that every position's
    output is the one a plain decode step gives, bit for bit, and a speculative reply the
    plain one even where two tokens nearly tie."""
    _check_position(cache, pos)
    n = hidden.shape[1]
    out = span.decode(hidden[0], [cache] * n, list(range(pos, pos + n)), start, end, ids=ids)
    return out.unsqueeze(0)


@dataclass(frozen=True)
class DecodeItem:
    """One session's decode step, as a decode pass takes it."""

    cache: KVCache
    pos: int
    hidden: torch.Tensor  # [1, 1, hidden]
    ids: tuple[int, ...] | None = None  # its token's, for a model whose layers read it


def decode_pass(span: Span, start: int, end: int, items: list[DecodeItem]) -> list[outcome.Outcome]:
    """One token of each session through blocks start:end as one pass, in a compute thread.
    Each item gets its own outcome: a step that cannot run, or a pass that fails, fails only
    the sessions it belongs to (a failed pass is rerun a session at a time)."""
    outs: list[outcome.Outcome | None] = [None] * len(items)
    ready = []
    for i, item in enumerate(items):
        try:
            _check_position(item.cache, item.pos)
            ready.append(i)
        except SwarmError as exc:
            outs[i] = outcome.Error(exc)
    if len(ready) > 1:
        try:
            hidden = torch.cat([items[i].hidden.reshape(1, -1) for i in ready])  # [rows, hidden]
            caches = [items[i].cache for i in ready]
            positions = [items[i].pos for i in ready]
            ids = None if items[0].ids is None else [i for r in ready for i in items[r].ids]
            out = span.decode(hidden, caches, positions, start, end, ids=ids)
            for row, i in enumerate(ready):
                outs[i] = outcome.Value(out[row].view(1, 1, -1))
            return outs
        except Exception:
            log.exception("a decode pass of %d sessions failed; each runs alone", len(ready))
    for i in ready:
        item = items[i]
        outs[i] = outcome.capture(
            forward_pass, span, item.cache, start, end, item.pos, item.hidden, item.ids
        )
    return outs


def _check_position(cache: KVCache, pos: int) -> None:
    if cache.length != pos:
        # only a client that sends a step before its previous one returned
        raise ProtocolError(
            f"step at position {pos} ran before the session's earlier positions"
            f" (cache holds {cache.length}); wait for each result"
        )
