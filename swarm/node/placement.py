"""Which blocks a node serves when its volunteer does not say: where the swarm is thinnest.

Pure functions over the DHT's records. A block's coverage is how many nodes serve it (online,
or joining: a node announces its choice before it loads, so the next one sees it) and their
summed throughput, against the sessions its nodes announce (the demand on it). A new node
takes the window of its size with the most uncovered blocks, then the most sessions per token/s
of throughput (where users wait longest), then the fewest nodes, then the least throughput,
then the lowest start.

A running node moves only when that fills a gap without opening one: its own blocks stay
covered by others, some other window has blocks nobody serves, and among the nodes that could
leave their blocks without opening a gap it has the lowest peer id (so two redundant nodes do
not both jump). A node that moves drains its sessions first (see lifecycle.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from swarm.records import JOINING, ONLINE, Block, NodeRecord, coverage_gaps
from swarm.records import coverage as covered_by

COUNTED_STATES = (ONLINE, JOINING)
MIN_THROUGHPUT = 1.0  # tokens/s a block's nodes are counted at when they announce less


def coverage(
    records: Iterable[NodeRecord], num_layers: int, exclude: frozenset[str] = frozenset()
) -> tuple[Block, ...]:
    """Per block, the nodes (other than `exclude`) that serve or are about to serve it."""
    counted = (r for r in records if r.state in COUNTED_STATES and r.peer not in exclude)
    return covered_by(counted, num_layers)


def gaps(blocks: Iterable[Block]) -> list[tuple[int, int]]:
    """Half-open ranges of the blocks nobody serves."""
    return coverage_gaps(b.nodes for b in blocks)


def _window_key(blocks: tuple[Block, ...], start: int, size: int):
    window = blocks[start : start + size]
    return (
        -sum(1 for b in window if b.nodes == 0),
        -sum(b.sessions / max(b.throughput, MIN_THROUGHPUT) for b in window),
        sum(b.nodes for b in window),
        sum(b.throughput for b in window),
        start,
    )


def choose_span(blocks: tuple[Block, ...], size: int, span_ok=None) -> tuple[int, int]:
    """The window of `size` blocks where the swarm is thinnest, among those `span_ok(start,
    end)` allows (Gemma 4: a KV-sharing layer goes with the layer it reads; from 0 always)."""
    size = max(1, min(size, len(blocks)))
    starts = [s for s in range(len(blocks) - size + 1) if span_ok is None or span_ok(s, s + size)]
    start = min(starts or [0], key=lambda s: _window_key(blocks, s, size))
    return start, start + size


def room_for_head(num_layers: int, ending: int, span_ok=None):
    """`span_ok`, and no span ending the model wider than `ending` blocks: the node serving
    the last block also holds the head it picks tokens with."""

    def ok(start: int, end: int) -> bool:
        fits = end < num_layers or end - start <= ending
        return fits and (span_ok is None or span_ok(start, end))

    return ok


def span_beside_head(
    blocks: tuple[Block, ...], size: int, ending: int, span_ok=None
) -> tuple[int, int]:
    """`choose_span` for a node fitting `size` blocks, or `ending` beside the head: where the
    thinnest window ends the model, its last `ending` blocks (the end stays served); where
    not even one fits beside the head, the thinnest window elsewhere."""
    start, end = choose_span(blocks, size, span_ok)
    ok = room_for_head(len(blocks), ending, span_ok)
    if ok(start, end):
        return start, end
    narrower = (max(0, len(blocks) - ending), len(blocks))
    if ending > 0 and ok(*narrower):
        return narrower
    return choose_span(blocks, min(size, max(1, len(blocks) - 1)), ok)


def settled_span(
    records: list[NodeRecord], me: str, chosen: tuple[int, int], num_layers: int, span_ok=None
) -> tuple[tuple[int, int], NodeRecord | None]:
    """A span `chosen` a moment ago, looked at again once other nodes' choices had time to
    arrive: where a node with a lower peer id serves or joins on overlapping blocks, it keeps
    them and this node chooses again knowing it (the same span if that node was known at the
    first choice; a node that loads fast may be online already). Returns the span and that
    rival (or None)."""
    others = [r for r in records if r.peer != me]
    start, end = chosen
    rivals = [
        r
        for r in others
        if r.state in COUNTED_STATES and r.peer < me and r.start < end and start < r.end
    ]
    if not rivals:
        return chosen, None
    again = choose_span(coverage(others, num_layers), end - start, span_ok)
    return again, (rivals[0] if again != chosen else None)


def better_span(
    records: list[NodeRecord], me: str, current: tuple[int, int], num_layers: int, span_ok=None
) -> tuple[int, int] | None:
    """Where this node (`me`, serving `current`) should move, or None to stay."""
    others = coverage(records, num_layers, frozenset({me}))
    if not gaps(others) or any(others[b].nodes == 0 for b in range(*current)):
        return None  # nothing to fill, or leaving would open a gap of our own
    movable = [r.peer for r in records if r.state == ONLINE and _redundant(r, records, num_layers)]
    if me not in movable or min(movable) != me:
        return None  # another redundant node goes first
    target = choose_span(others, current[1] - current[0], span_ok)
    return None if target == current else target


def _redundant(r: NodeRecord, records: list[NodeRecord], num_layers: int) -> bool:
    """Whether every block `r` serves stays served without it."""
    without = coverage(records, num_layers, frozenset({r.peer}))
    return all(without[b].nodes > 0 for b in range(r.start, min(r.end, num_layers)))


def blocks_for_memory(
    block_bytes: int, cache_bytes_per_block: int, budget: int, least: int = 1
) -> int:
    """How many blocks fit `budget` bytes, each with its weights and its share of the cache
    (at least `least`)."""
    return max(least, budget // max(1, block_bytes + cache_bytes_per_block))
