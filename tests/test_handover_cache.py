"""The cache a handover moves (swarm/node/handover/cache.py, sans IO): copied while the session goes
on, then its tail, it lands exactly as the sender holds it, sliding-window rings included."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from swarm.errors import HandoverRefused
from swarm.model.blocks import KVCache
from swarm.node.handover.cache import CacheIntake, pick_replicas, slab_digest, slabs
from tests.helpers.handover import chunks
from tests.helpers.records import rec

HEADS, DIM, LENGTH = 2, 4, 64
CAPACITIES = (LENGTH, 8)  # a full layer and a sliding window of 8 (a ring)


def empty(dtype=torch.float32) -> KVCache:
    shapes = [(1, HEADS, c, DIM) for c in CAPACITIES]
    return KVCache(
        [torch.zeros(s, dtype=dtype) for s in shapes], [torch.zeros(s, dtype=dtype) for s in shapes]
    )


def compute(cache: KVCache, lo: int, hi: int) -> None:
    """Write positions [lo, hi) as a pass would: position p in slot p % capacity."""
    for layer, cap in enumerate(CAPACITIES):
        for p in range(lo, hi):
            cache.keys[layer][0, :, p % cap] = torch.full((HEADS, DIM), 1000.0 * layer + p)
            cache.values[layer][0, :, p % cap] = torch.full((HEADS, DIM), -1000.0 * layer - p)
    cache.length = hi


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_copied_while_it_grows_then_its_tail_lands_exactly(dtype):
    sender, receiver = empty(dtype), empty(dtype)
    compute(sender, 0, 20)
    early = slabs(sender, 0, 20)
    compute(sender, 20, 27)  # the session went on: the ring of 8 wrapped past what was copied
    tail = slabs(sender, 20, 27)
    intake = CacheIntake(receiver, 20)
    for chunk in chunks(early):
        intake.take(chunk)
    intake.extend(27, LENGTH)
    for chunk in chunks(tail):
        intake.take(chunk)
    intake.install()
    assert receiver.length == 27
    for layer, cap in enumerate(CAPACITIES):
        held = slice(0, min(27, cap))
        assert torch.equal(receiver.keys[layer][:, :, held], sender.keys[layer][:, :, held])
        assert torch.equal(receiver.values[layer][:, :, held], sender.values[layer][:, :, held])
    assert intake.digest() == slab_digest([early, tail])


def test_a_ring_sends_only_the_positions_it_still_holds():
    cache = empty()
    compute(cache, 0, 20)
    (full_first, full, _), (ring_first, ring, _) = slabs(cache, 0, 20)
    assert (full_first, full.shape[1], ring_first, ring.shape[1]) == (0, 20, 12, 8)
    assert ring[0, 0].tolist() == [1012.0] * HEADS * DIM  # oldest first, not in slot order


def test_chunks_out_of_order_are_refused():
    intake = CacheIntake(empty(), 20)
    early = chunks(slabs(_grown(20), 0, 20))
    with pytest.raises(HandoverRefused, match="expected 0"):
        intake.take(early[1])


def test_a_tail_before_the_cache_is_complete_is_refused():
    intake = CacheIntake(empty(), 20)
    intake.take(chunks(slabs(_grown(20), 0, 20))[0])
    with pytest.raises(HandoverRefused, match="before the cache is complete"):
        intake.extend(27, LENGTH)


def test_installing_an_incomplete_cache_is_refused():
    intake = CacheIntake(empty(), 20)
    with pytest.raises(HandoverRefused, match="incomplete"):
        intake.install()


def _grown(length: int) -> KVCache:
    cache = empty()
    compute(cache, 0, length)
    return cache


def test_replicas_are_online_nodes_of_the_weights_serving_the_blocks_least_loaded_first():
    def node(peer, start=0, end=6, free=1000, **kw):
        return replace(rec(peer, start, end, **kw), free_cache_tokens=free)

    records = [
        node("me"),
        node("busy", sessions=2),
        node("idle"),
        node("partial", 0, 3),
        node("gone", state="offline"),
        node("full", free=0),
        replace(node("other"), fingerprint="g"),
    ]
    wants = [(0, 6, 100)] * 3 + [(0, 6, 2000)]
    got = pick_replicas(records, "me", "f", wants)
    assert [r.peer if r else None for r in got] == ["idle", "idle", "busy", None]
