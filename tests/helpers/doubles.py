"""Stand-ins for the model where a test looks at the node around it, not at what it computes."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from swarm.model.blocks import KVCache

HIDDEN = 8


class Doubling:
    """Blocks that double the activations; a session's cache only counts its positions."""

    config = SimpleNamespace(hidden=HIDDEN, window=lambda layer: None)  # no sliding window
    start, end = 0, 4
    embedding = None  # steps carry activations, as a client of a node without the table sends
    head = None  # results carry hidden states, as from a node without the model's head

    def allocate_cache(self, start: int, end: int, max_length: int) -> KVCache:
        return KVCache(keys=[], values=[])

    def forward(self, h, cache: KVCache, pos: int, start: int, end: int, ids=None) -> torch.Tensor:
        cache.length = pos + h.shape[1]
        return h * 2

    def decode(self, h, caches: list[KVCache], positions: list[int], start, end, ids=None):
        for cache, pos in zip(caches, positions):
            cache.length = pos + 1
        return h * 2
