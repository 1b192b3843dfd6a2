"""Moving a session's KV cache to a replica serving the same blocks, so a leaving node's sessions
go on there without replaying their tokens.

The sender cuts each layer's cache into `slabs` (positions x heads*width, in the cache's
own dtype) that the uplink sends as bulk volumes behind decode, in token chunks like a prompt's
activations: first every position so far while the session goes on, then, paused, the tail it
computed meanwhile. A Gated DeltaNet layer holds no positions but a `State` that changes at
every step: its parts go last, copied from the paused session (`state_slabs`), as rows. The
receiver's `CacheIntake` checks every chunk against the cache it allocated for the session
(layer, position order, shape, dtype, finiteness) and writes it in place; the digest of what
arrived, signed by the sender's node key, ends the transfer. Sans IO: the node's connections
and the uplink drive both sides.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from swarm.errors import HandoverRefused, SwarmError
from swarm.model.blocks import KVCache
from swarm.model.deltanet import State
from swarm.protocol import STATE_PARTS, KvChunk, StateChunk
from swarm.records import ONLINE, NodeRecord
from swarm.wire import WIRE_DTYPES, unpack_tensor

CACHE_WIRE_DTYPES = {dtype: name for name, dtype in WIRE_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return CACHE_WIRE_DTYPES[dtype]


def first_held(cache: KVCache, layer: int, length: int) -> int:
    """The first position `layer` still holds at `length` (a sliding window's ring forgets;
    a Gated DeltaNet layer's state holds none)."""
    if layer in cache.states:
        return length
    return max(0, length - cache.keys[layer].shape[2])


Slab = tuple[int, torch.Tensor, torch.Tensor]  # first position, keys, values [1, n, width]


def slabs(cache: KVCache, lo: int, hi: int) -> list[Slab]:
    """Per layer, keys and values of positions [lo, hi) that it holds at `hi`, copied out as
    [1, positions, width]: the wire's [1, tokens, hidden] layout, so chunks cut on position
    boundaries. Copies: the session may go on writing its cache meanwhile."""
    out = []
    for layer, (k, v) in enumerate(zip(cache.keys, cache.values)):
        first = max(lo, first_held(cache, layer, hi))
        slots = torch.arange(first, hi) % k.shape[2]  # a ring holds position p in slot p % size
        # [1, kv_heads, slots, head_dim] -> [1, positions, kv_heads * head_dim]
        keys, values = (
            t[0][:, slots].transpose(0, 1).reshape(1, hi - first, t.shape[1] * t.shape[3])
            for t in (k, v)
        )
        out.append((first, keys.contiguous(), values.contiguous()))
    return out


StateSlab = tuple[int, torch.Tensor, torch.Tensor]  # layer, conv and S as [1, rows, width]


def state_rows(state: State, part: str) -> torch.Tensor:
    """A state's part as rows: conv [conv_dim, kernel], S [v_heads * k_dim, v_dim] (views)."""
    return state.conv if part == "conv" else state.s.view(-1, state.s.shape[-1])


def state_slabs(cache: KVCache) -> list[StateSlab]:
    """Each Gated DeltaNet layer's state, copied (the wire's [1, rows, width])."""
    out = []
    for layer, state in sorted(cache.states.items()):
        conv, s = (state_rows(state, part)[None].clone() for part in STATE_PARTS)
        out.append((layer, conv, s))
    return out


def slab_digest(phases: Sequence[Sequence[Slab]], states: Sequence[StateSlab] = ()) -> str:
    """What the sender signs: per layer, the bytes of its keys in every phase in order, then
    those of its values, as the wire packs them (a bfloat16 tensor's raw 16-bit patterns);
    then per state, its conv's then its S's."""
    total = hashlib.sha256()
    for layer in range(len(phases[0])):
        for part in (1, 2):
            h = hashlib.sha256()
            for phase in phases:
                t = phase[layer][part]
                raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
                h.update(raw.numpy().tobytes())
            total.update(h.digest())
    for _, *parts in states:
        for t in parts:
            total.update(hashlib.sha256(t.numpy().tobytes()).digest())
    return total.hexdigest()


@dataclass
class CacheIntake:
    """The receiver's side of one handover: `cache` (allocated for the session) fills chunk by
    chunk; `take` (`take_state`) raises HandoverRefused (or the wire's ShapeMismatch) on
    anything that does not fit, before a byte lands."""

    cache: KVCache
    length: int
    _filled: list[int] = field(init=False)
    _hashes: list[tuple[hashlib._Hash, hashlib._Hash]] = field(init=False)
    # (layer, part) -> the rows of a state's part come so far, and their hash
    _rows: dict[tuple[int, str], tuple[int, hashlib._Hash]] = field(init=False)

    def __post_init__(self) -> None:
        layers = len(self.cache.keys)
        self._filled = [first_held(self.cache, i, self.length) for i in range(layers)]
        self._hashes = [(hashlib.sha256(), hashlib.sha256()) for _ in range(layers)]
        # in the order the sender hashes them (slab_digest)
        delta = sorted(self.cache.states)
        self._rows = {(i, p): (0, hashlib.sha256()) for i in delta for p in STATE_PARTS}
        self.dtype = dtype_name(self.cache.keys[0].dtype) if layers else "float32"

    def take(self, chunk: KvChunk) -> None:
        layers = len(self.cache.keys)
        if not 0 <= chunk.layer < layers:
            raise HandoverRefused(f"chunk for layer {chunk.layer}; the session has {layers}")
        if chunk.pos != self._filled[chunk.layer]:
            raise HandoverRefused(
                f"chunk of layer {chunk.layer} starts at position {chunk.pos}; expected"
                f" {self._filled[chunk.layer]}"
            )
        left = self.length - chunk.pos
        if left <= 0:
            raise HandoverRefused(f"layer {chunk.layer}: all {self.length} positions have come")
        tensors = []
        for name, obj, dst in (
            ("keys", chunk.keys, self.cache.keys[chunk.layer]),
            ("values", chunk.values, self.cache.values[chunk.layer]),
        ):
            if not isinstance(obj, dict) or obj.get("dtype") != self.dtype:
                got = obj.get("dtype") if isinstance(obj, dict) else type(obj).__name__
                raise HandoverRefused(f"{name} come as {got!r}; this cache holds {self.dtype}")
            width = dst.shape[1] * dst.shape[3]  # heads x head width (a latent's: 1 x rank)
            tensors.append(unpack_tensor(obj, hidden=width, max_tokens=left, native=True))
        keys, values = tensors
        n = keys.shape[1]
        if values.shape[1] != n:
            raise HandoverRefused(f"chunk carries {n} key positions but {values.shape[1]} values")
        size = self.cache.keys[chunk.layer].shape[2]
        first = chunk.pos % size
        # a ring holds position p in slot p % size; a chunk that does not wrap is one slice
        slots = (
            slice(first, first + n) if first + n <= size else torch.arange(first, first + n) % size
        )
        for dst, src in ((self.cache.keys, keys), (self.cache.values, values)):
            heads = dst[chunk.layer].shape[1]
            # [1, n, kv_heads * head_dim] -> [kv_heads, n, head_dim]
            dst[chunk.layer][0][:, slots] = src[0].view(n, heads, -1).transpose(0, 1)
        hk, hv = self._hashes[chunk.layer]
        hk.update(chunk.keys["data"])
        hv.update(chunk.values["data"])
        self._filled[chunk.layer] = chunk.pos + n

    def take_state(self, chunk: StateChunk) -> None:
        """Rows of a Gated DeltaNet state's part, in order, after the last positions."""
        state = self.cache.states.get(chunk.layer)
        if state is None:
            raise HandoverRefused(
                f"a state for layer {chunk.layer} of the span, which has no Gated DeltaNet state"
            )
        if not self._positions_in:
            raise HandoverRefused(f"a state before the positions are complete ({self.missing()})")
        dst = state_rows(state, chunk.part)
        at, h = self._rows[chunk.layer, chunk.part]
        name, obj = f"{chunk.part} of layer {chunk.layer}'s state", chunk.data
        if chunk.row != at:
            raise HandoverRefused(f"{name} from row {chunk.row}; expected {at}")
        if at >= dst.shape[0]:
            raise HandoverRefused(f"{name}: all {dst.shape[0]} rows have come")
        if not isinstance(obj, dict) or obj.get("dtype") != "float32":
            got = obj.get("dtype") if isinstance(obj, dict) else type(obj).__name__
            raise HandoverRefused(f"{name} comes as {got!r}; a state is float32")
        rows = unpack_tensor(obj, hidden=dst.shape[1], max_tokens=dst.shape[0] - at, native=True)
        dst[at : at + rows.shape[1]] = rows[0]
        h.update(obj["data"])
        self._rows[chunk.layer, chunk.part] = at + rows.shape[1], h

    def extend(self, length: int, max_length: int) -> None:
        """The session went on while its cache came: positions up to `length` follow."""
        if not self._positions_in or any(at for at, _ in self._rows.values()):
            raise HandoverRefused(f"a tail before the cache is complete ({self.missing()})")
        if not self.length < length <= max_length:
            raise HandoverRefused(
                f"a tail to position {length}; the cache holds {self.length} of {max_length}"
            )
        self.length = length
        self._filled = [
            max(f, first_held(self.cache, i, length)) for i, f in enumerate(self._filled)
        ]

    @property
    def _positions_in(self) -> bool:
        return all(f == self.length for f in self._filled)

    def _rows_of(self, layer: int, part: str) -> int:
        return state_rows(self.cache.states[layer], part).shape[0]

    @property
    def complete(self) -> bool:
        return self._positions_in and all(
            at == self._rows_of(*key) for key, (at, _) in self._rows.items()
        )

    def missing(self) -> str:
        """Which layers lack positions or state rows, for the refusal."""
        short = [
            f"layer {i}: up to {f} of {self.length}"
            for i, f in enumerate(self._filled)
            if f != self.length
        ] + [
            f"layer {i}'s {part}: {at} rows of {self._rows_of(i, part)}"
            for (i, part), (at, _) in self._rows.items()
            if at != self._rows_of(i, part)
        ]
        return ", ".join(short[:4]) + (" ..." if len(short) > 4 else "")

    def digest(self) -> str:
        total = hashlib.sha256()
        for hk, hv in self._hashes:
            total.update(hk.digest())
            total.update(hv.digest())
        for _, h in self._rows.values():
            total.update(h.digest())
        return total.hexdigest()

    def install(self) -> None:
        if not self.complete:
            raise HandoverRefused(f"the cache is incomplete ({self.missing()})")
        for state in self.cache.states.values():
            state.started = True  # a pass ran there: the next one here reads conv and S
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
