"""The compute a session hands to the lanes (compute.py): one forward pass over a session's
prompt or step, or one decode pass over several sessions' steps. Each runs in a compute thread,
never on the trio thread, and checks first that the step comes at its session's cache position.
On a route's last hop, a session opened with `picking` gets its tokens picked in the same
thread (`Picked`): the head's rows of a decode pass's sessions go through it as one matmul.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import outcome
import torch

from swarm.errors import ProtocolError, SwarmError
from swarm.model.blocks import KVCache, Span
from swarm.model.head import LazyHead
from swarm.model.sampling import Sampler

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


class Picked(NamedTuple):
    """A pass's output [1, n, hidden] and the tokens picked after its last len(picks) rows."""

    hidden: torch.Tensor
    picks: tuple[int, ...]


@dataclass(frozen=True)
class Picker:
    """What picks a session's tokens on its last hop: the span's head (loaded at first use, in a
    compute thread) and the session's sampler."""

    head: LazyHead
    sampler: Sampler


def pick_rows(rows: list[tuple[Picker, torch.Tensor, int]]) -> list[int]:
    """The token after each final hidden state [hidden] at its position, as its Picker says:
    rows of one head go through it together (a float32 head, the exact path, a row at a time:
    a GEMM over several rows may round differently from one row's)."""
    picks: list[int] = [0] * len(rows)
    by_head: dict[int, list[int]] = {}
    for i, (picker, _, _) in enumerate(rows):
        by_head.setdefault(id(picker.head), []).append(i)
    for idx in by_head.values():
        head = rows[idx[0]][0].head.get()
        hidden = torch.stack([rows[i][1].reshape(-1) for i in idx])
        if head.weights == "float32":
            logits = [head.logits_rows(hidden[j : j + 1])[0] for j in range(len(idx))]
        else:
            logits = list(head.logits_rows(hidden))
        for i, row in zip(idx, logits):
            picker, _, pos = rows[i]
            picks[i] = picker.sampler(row, pos + 1)
    return picks


def picked(fn: Callable[[], torch.Tensor], picker: Picker, pos: int, last: int) -> Picked:
    """`fn`'s pass from position `pos`, with the tokens picked after its last `last` rows."""
    out = fn()
    n = out.shape[1]
    rows = [(picker, out[0, i], pos + i) for i in range(n - last, n)]
    return Picked(out, tuple(pick_rows(rows)))


@dataclass(frozen=True)
class DecodeItem:
    """One session's decode step, as a decode pass takes it."""

    cache: KVCache
    pos: int
    hidden: torch.Tensor  # [1, 1, hidden]
    ids: tuple[int, ...] | None = None  # its token's, for a model whose layers read it
    picker: Picker | None = None  # on the last hop, where the session's tokens are picked


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
            _pick_items(items, ready, out, outs)
            return outs
        except Exception:
            log.exception("a decode pass of %d sessions failed; each runs alone", len(ready))
    for i in ready:
        item = items[i]
        fn = functools.partial(
            forward_pass, span, item.cache, start, end, item.pos, item.hidden, item.ids
        )
        if item.picker is not None:
            fn = functools.partial(picked, fn, item.picker, item.pos, 1)
        outs[i] = outcome.capture(fn)
    return outs


def _pick_items(items: list[DecodeItem], ready: list[int], out, outs) -> None:
    """The picks of a decode pass's rows whose sessions are picked here, as one matmul."""
    rows = [(row, i) for row, i in enumerate(ready) if items[i].picker is not None]
    if not rows:
        return
    try:
        picks = pick_rows([(items[i].picker, out[row], items[i].pos) for row, i in rows])
    except Exception as exc:  # the pass's hidden states stand; those sessions fail
        log.exception("picking the tokens of a decode pass failed")
        for _, i in rows:
            outs[i] = outcome.Error(exc)
        return
    for (row, i), token in zip(rows, picks):
        outs[i] = outcome.Value(Picked(out[row].view(1, 1, -1), (token,)))


def _check_position(cache: KVCache, pos: int) -> None:
    if cache.length != pos:
        # only a client that sends a step before its previous one returned
        raise ProtocolError(
            f"step at position {pos} ran before the session's earlier positions"
            f" (cache holds {cache.length}); wait for each result"
        )
