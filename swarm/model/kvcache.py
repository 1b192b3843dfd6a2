"""A session's keys and values for the layers of a span, preallocated; sliding-window layers
as rings. Layers that read another layer's KV (Gemma 4's shared KV) hold that layer's tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarm.errors import ProtocolError, RewindRefused
from swarm.model.config import ModelConfig
from swarm.model.deltanet import NO_REWIND, DeltaNetNoRewind, State


def ring_slots(config: ModelConfig, start: int, end: int, max_length: int) -> int:
    """The fewest slots of a sliding window's ring among layers [start, end) of a session of
    `max_length` tokens (max_length where none is a ring): the most positions one pass may
    write where it may be rewound (KVCache.keep_for_rewind)."""
    windows = (config.window(i) for i in range(start, end))
    return min((w for w in windows if w and w < max_length), default=max_length)


@dataclass
class KVCache:
    """Keys and values for every layer of a span, preallocated: a layer with a sliding window
    shorter than the session keeps only the window, as a ring (position p in slot p % window)."""

    keys: list[torch.Tensor]  # per layer [1, kv_heads, capacity, head_dim]
    values: list[torch.Tensor]
    length: int = 0
    # position -> [(layer, keys, values)] a ring's slot held before that position took it: what
    # a rewind (speculative decoding's rejected drafts) puts back
    overwritten: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = field(
        default_factory=dict
    )
    states: dict[int, State] = field(default_factory=dict)  # Gated DeltaNet layers' (by layer)

    def layer(self, i: int) -> tuple:
        """What block i of the cache's layers reads: its keys and values, or its state."""
        return (self.states[i], None) if i in self.states else (self.keys[i], self.values[i])

    def keep_for_rewind(self, pos: int, tokens: int, depth: int) -> None:
        """Before positions [pos, pos + tokens) are written: keep what they overwrite in ring
        layers, so that `rewind` can go back up to `depth` positions from their end. More
        positions than a ring's slots in one pass would leave some in no slot: refused."""
        if rings := [k.shape[2] for k in self.keys if pos + tokens > k.shape[2] < tokens]:
            raise ProtocolError(
                f"a pass of {tokens} tokens that may be rewound is longer than a sliding"
                f" window's {min(rings)}"
            )
        for q in range(pos, pos + tokens):
            kept = [
                (layer, k[0, :, q % k.shape[2]].clone(), v[0, :, q % k.shape[2]].clone())
                for layer, (k, v) in enumerate(zip(self.keys, self.values))
                if q >= k.shape[2]  # a ring that wraps here: position q - capacity goes
            ]
            if kept:
                self.overwritten[q] = kept
        for q in [q for q in self.overwritten if q < pos + tokens - depth]:
            del self.overwritten[q]

    def rewind(self, pos: int) -> None:
        """Forget positions [pos, length): every ring slot they took gets back what it held.
        Raises RewindRefused, changing nothing, where a ring no longer holds what it needs."""
        if pos >= self.length:
            return
        if self.states:  # speculative decoding is refused for such a model (DeltaNetNoRewind)
            raise DeltaNetNoRewind(f"cannot rewind to position {pos}: {NO_REWIND}")
        capacity = min(k.shape[2] for k in self.keys) if self.keys else self.length
        lost = [q for q in range(max(pos, capacity), self.length) if q not in self.overwritten]
        if lost:
            raise RewindRefused(
                f"cannot rewind to position {pos}: a sliding window's cache no longer holds"
                f" what position {lost[0]} overwrote"
            )
        for q in range(self.length - 1, pos - 1, -1):
            for layer, k, v in self.overwritten.pop(q, ()):
                slot = q % self.keys[layer].shape[2]
                self.keys[layer][0, :, slot] = k
                self.values[layer][0, :, slot] = v
        self.length = pos

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        start: int,
        end: int,
        max_length: int,
        dtype: torch.dtype = torch.float32,
    ) -> KVCache:
        """For layers [start, end) of the model, sessions of up to max_length tokens."""
        config.check_span(start, end)
        keys, values, states = [], [], {}
        for layer in range(start, end):
            if (source := config.kv_source(layer)) is not None:  # Gemma 4: that layer's KV
                keys.append(keys[source - start])
                values.append(values[source - start])
                continue
            (k_heads, k_width), (v_heads, v_width) = config.at(layer).cache_widths
            window = config.window(layer)
            length = min(max_length, window) if window else max_length
            if config.is_delta(layer):  # a fixed-size State instead of keys and values
                k_heads = v_heads = 0
                states[layer - start] = State.allocate(config.delta)
            keys.append(torch.zeros((1, k_heads, length, k_width), dtype=dtype))
            values.append(torch.zeros((1, v_heads, length, v_width), dtype=dtype))
        return cls(keys, values, states=states)

    @staticmethod
    def bytes_per_token(
        config: ModelConfig, layers: int, dtype: torch.dtype = torch.float32, start: int = 0
    ) -> int:
        """Of layers [start, start + layers), at most: layers with a window hold fewer once
        sessions pass it; Gemma 4's full layers are wider, its KV-sharing ones hold none, nor
        do Gated DeltaNet layers (a fixed State a session instead: State.nbytes)."""
        total = 0
        for layer in range(start, min(start + layers, config.num_layers)):
            if config.kv_source(layer) is None and not config.is_delta(layer):
                (k_heads, k_width), (v_heads, v_width) = config.at(layer).cache_widths
                total += k_heads * k_width + v_heads * v_width
        return total * dtype.itemsize
