"""Moving a session's KV cache to a replica serving the same blocks, so a leaving node's sessions
go on there without replaying their tokens.

The sender cuts each layer's cache into `slabs` (slots x kv_heads*head_dim, in the cache's own
dtype) that the uplink sends as bulk volumes behind decode, in token chunks like a prompt's
activations. The receiver's `CacheIntake` checks every chunk against the cache it allocated for
the session (layer, slot order, shape, dtype, finiteness) and writes it in place; the
`cache_digest` of what arrived, signed by the sender's node key, ends the transfer. Sans IO:
the node's connections and the uplink drive both sides.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from swarm.errors import HandoverRefused, SwarmError
from swarm.model.blocks import KVCache
from swarm.protocol import KvChunk
from swarm.records import ONLINE, NodeRecord
from swarm.wire import WIRE_DTYPES, unpack_tensor

CACHE_WIRE_DTYPES = {dtype: name for name, dtype in WIRE_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return CACHE_WIRE_DTYPES[dtype]


def slots_held(cache: KVCache, layer: int, length: int) -> int:
    """Slots of `layer` holding positions below `length` (a sliding window's ring holds fewer)."""
    return min(length, cache.keys[layer].shape[2])


def slabs(cache: KVCache, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, keys and values of the first `length` positions as [1, slots, width]: the
    wire's [1, tokens, hidden] layout, so chunks cut on slot boundaries."""
    out = []
    for layer, (k, v) in enumerate(zip(cache.keys, cache.values)):
        n = slots_held(cache, layer, length)
        # [1, kv_heads, slots, head_dim] -> [1, slots, kv_heads * head_dim]
        out.append(
            tuple(t[0, :, :n].transpose(0, 1).reshape(1, n, -1).contiguous() for t in (k, v))
        )
    return out


def slab_digest(pieces: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """What the sender signs: each layer's key bytes, then its value bytes, as the wire packs
    them (a bfloat16 tensor's raw 16-bit patterns)."""
    total = hashlib.sha256()
    for keys, values in pieces:
        for t in (keys, values):
            raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
            total.update(hashlib.sha256(raw.numpy().tobytes()).digest())
    return total.hexdigest()


@dataclass
class CacheIntake:
    """The receiver's side of one handover: `cache` (allocated for the session) fills chunk by
    chunk; `take` raises HandoverRefused (or the wire's ShapeMismatch) on anything that does not
    fit, before a byte lands."""

    cache: KVCache
    length: int
    width: int  # kv_heads * head_dim
    _filled: list[int] = field(init=False)
    _hashes: list[tuple[hashlib._Hash, hashlib._Hash]] = field(init=False)

    def __post_init__(self) -> None:
        layers = len(self.cache.keys)
        self._filled = [0] * layers
        self._hashes = [(hashlib.sha256(), hashlib.sha256()) for _ in range(layers)]
        self.dtype = dtype_name(self.cache.keys[0].dtype) if layers else "float32"

    def take(self, chunk: KvChunk) -> None:
        layers = len(self.cache.keys)
        if not 0 <= chunk.layer < layers:
            raise HandoverRefused(f"chunk for layer {chunk.layer}; the session has {layers}")
        held = slots_held(self.cache, chunk.layer, self.length)
        if chunk.slot != self._filled[chunk.layer]:
            raise HandoverRefused(
                f"chunk of layer {chunk.layer} starts at slot {chunk.slot}; expected"
                f" {self._filled[chunk.layer]}"
            )
        left = held - chunk.slot
        if left <= 0:
            raise HandoverRefused(f"layer {chunk.layer} holds {held} slots; all have arrived")
        tensors = []
        for name, obj in (("keys", chunk.keys), ("values", chunk.values)):
            if not isinstance(obj, dict) or obj.get("dtype") != self.dtype:
                got = obj.get("dtype") if isinstance(obj, dict) else type(obj).__name__
                raise HandoverRefused(f"{name} come as {got!r}; this cache holds {self.dtype}")
            tensors.append(unpack_tensor(obj, hidden=self.width, max_tokens=left))
        keys, values = tensors
        n = keys.shape[1]
        if values.shape[1] != n:
            raise HandoverRefused(f"chunk carries {n} key slots but {values.shape[1]} value slots")
        lo, hi = chunk.slot, chunk.slot + n
        for dst, src in ((self.cache.keys, keys), (self.cache.values, values)):
            heads = dst[chunk.layer].shape[1]
            # [1, n, kv_heads * head_dim] -> [kv_heads, n, head_dim]
            dst[chunk.layer][0, :, lo:hi] = src[0].view(n, heads, -1).transpose(0, 1)
        hk, hv = self._hashes[chunk.layer]
        hk.update(chunk.keys["data"])
        hv.update(chunk.values["data"])
        self._filled[chunk.layer] = hi

    @property
    def complete(self) -> bool:
        return all(
            self._filled[i] == slots_held(self.cache, i, self.length)
            for i in range(len(self.cache.keys))
        )

    def missing(self) -> str:
        """Which layers lack slots, for the refusal."""
        short = [
            f"layer {i}: {self._filled[i]}/{slots_held(self.cache, i, self.length)}"
            for i in range(len(self.cache.keys))
            if self._filled[i] != slots_held(self.cache, i, self.length)
        ]
        return ", ".join(short[:4]) + (" ..." if len(short) > 4 else "")

    def digest(self) -> str:
        total = hashlib.sha256()
        for hk, hv in self._hashes:
            total.update(hk.digest())
            total.update(hv.digest())
        return total.hexdigest()

    def install(self) -> None:
        if not self.complete:
            raise HandoverRefused(f"the cache is incomplete ({self.missing()})")
        self.cache.length = self.length


def pick_replicas(
    records: Sequence[NodeRecord],
    me: str,
    fingerprint: str,
    wants: Sequence[tuple[int, int, int]],
) -> list[NodeRecord | None]:
    """For each session (its blocks start:end and its length), an online node of the same
    weights serving those blocks, other than `me`: the one with the fewest sessions counting
    those given it here, so a leaving node's sessions spread over its replicas."""
    load = {r.peer: r.sessions for r in records}
    out: list[NodeRecord | None] = []
    for start, end, length in wants:
        fits = [
            r
            for r in records
            if r.peer != me
            and r.state == ONLINE
            and r.fingerprint == fingerprint
            and r.start <= start < end <= r.end
            and r.free_cache_tokens >= length
        ]
        if not fits:
            out.append(None)
            continue
        best = min(fits, key=lambda r: (load[r.peer], -r.throughput, r.peer))
        load[best.peer] += 1
        out.append(best)
    return out


def refusal(exc: SwarmError) -> HandoverRefused:
    """What a sender is told when a chunk does not fit: a typed refusal whatever the check."""
    return exc if isinstance(exc, HandoverRefused) else HandoverRefused(str(exc))
