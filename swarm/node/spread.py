"""A long prompt pass spread over two nodes serving the same blocks (issue #52): sequence
parallelism, the owner's side (the replica's is swarm/node/spread_replica.py).

The owner of a session takes a prompt of at least `--spread-prompt-tokens` ready tokens as one
pass and splits its rows: it computes [pos, at) itself, through every layer, and a replica of
its blocks computes [at, pos + n). Each of the replica's rows attends to every position before
it, so the owner sends each layer's keys and values of [0, at) as soon as its layer is done,
and the replica, a layer behind, computes its rows through that layer meanwhile; it answers
with its rows' keys and values, layer by layer, then their outputs. The owner then holds the
whole pass in its cache, as if it had computed it alone, and decodes on as usual.

`at` is chosen so that both finish together (`split`), from the work a row costs in each: the
matmuls alike, attention by how many positions each row sees, the replica's rows more. Spreading
the attention alone (each node attending over the positions it holds, as a lender does) would
leave every matmul to the owner: at most 1.5x where attention is two thirds of a pass (the
default model at 16k), 1.3x on an 8B shape; splitting the rows takes both halves.

The owner's layers are the same `Block.forward` of its rows as an unsplit pass's, and the
replica's are a pass from position `at` over the owner's keys and values: at float32 the tokens
are an unsplit run's. A replica that refuses, fails or stalls mid-pass costs no client anything:
the owner computes the rest of the rows itself, from its own cache, and logs it.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from concurrent.futures import Future

import outcome
import torch
import trio

from swarm.errors import PeerFailed, ProtocolError, SwarmError
from swarm.model.blocks import KVCache, Span
from swarm.model.config import ModelConfig
from swarm.node.handover.cache import dtype_name
from swarm.node.passes import forward_pass
from swarm.protocol import Error
from swarm.records import CACHE, ONLINE, NodeRecord
from swarm.spreading import SpreadKv, SpreadOpen, SpreadRows, SpreadTaken
from swarm.transport import FramedStream, dial_hop
from swarm.wire import pack_tensor, unpack_tensor

log = logging.getLogger("swarm.node")

FRAME_BYTES = 4 << 20  # tensor bytes a frame carries at most: the link interleaves others
DIAL_S = 10.0  # to reach a replica and hear it take the rows
REPLY_S = 60.0  # between two frames of the other side: a layer of its rows, at most
# an attention flop's time over a matmul flop's: fitted to the owner's and the replica's times
# of an 8190-token spread pass of the default model (int4, --threads 1, 2-core AMD EPYC)
ATTENTION = 1.8


def spreadable(config: ModelConfig, start: int, end: int, length: int) -> bool:
    """Blocks [start, end) compute a pass of up to `length` positions in rows split anywhere:
    plain keys and values per layer, no ring, no state, nothing read across layers."""
    if config.latent is not None or config.delta is not None:
        return False
    if config.per_layer or config.kv_shared:
        return False
    return all((w := config.window(i)) is None or w >= length for i in range(start, end))


def split(config: ModelConfig, layers: int, pos: int, n: int) -> int:
    """Where rows [pos, pos + n) split, `at`: the owner's [pos, at) through `layers` layers
    taking as long as the replica's [at, pos + n) a layer behind. A row costs its matmuls
    and ATTENTION x 4 x heads x head_dim per position it attends to; SDPA skips the masked
    half only in a pass from position 0, and the replica's always starts later."""
    ffn = config.intermediate
    if config.experts:
        ffn = config.experts_used * config.expert_intermediate + config.shared_intermediate
    width = config.heads * config.head_dim
    row = 2 * (
        config.hidden * (width + 2 * config.kv_heads * config.head_dim) + width * config.hidden
    )
    row += 6 * config.hidden * ffn
    pair = ATTENTION * 4 * width

    def owner(m: int) -> float:
        seen = m / 2 if pos == 0 else pos + m
        return m * (row + pair * seen)

    def replica(m: int) -> float:
        return (n - m) * (row + pair * (pos + n))

    lo, hi = 1, n - 1
    while lo < hi:  # the first m at which the owner's layers take longer than the replica's
        m = (lo + hi) // 2
        if owner(m) * (layers - 1) >= replica(m) * layers:
            hi = m
        else:
            lo = m + 1
    return pos + lo


def through(span: Span, cache: KVCache, start: int, end: int, pos: int, x, before, after):
    """x [rows, hidden] at positions [pos, pos + rows) through blocks [start, end), in a compute
    thread; `before(layer)` runs before each layer (a replica waits there for the owner's
    keys and values), `after(layer)` after it (its keys and values are then in `cache`)."""
    config, n = span.config, x.shape[0]
    turns = {rope: r.cos_sin(pos, n) for rope, r in span.rotaries.items()}
    with torch.inference_mode():
        for i in range(start, end):
            layer = i - start
            before(layer)
            cos, sin = turns[config.rotary_of(i)]
            block = span.blocks[i - span.start]
            x = block.forward(x, *cache.layer(layer), pos, cos, sin, config.window(i))
            after(layer)
    return x


def kv_frames(sid: str, cache: KVCache, layer: int, lo: int, hi: int) -> list[SpreadKv]:
    """Positions [lo, hi) of `layer` in `cache`, in frames of FRAME_BYTES at most."""
    k, v = cache.keys[layer][0], cache.values[layer][0]  # [kv_heads, slots, head_dim]
    per = max(1, FRAME_BYTES // (2 * k.shape[0] * k.shape[2] * k.element_size()))
    frames = []
    for a in range(lo, hi, per):
        b = min(hi, a + per)
        kv = (pack_tensor(_rows(t[:, a:b]), dtype_name(t.dtype)) for t in (k, v))
        frames.append(SpreadKv(sid, layer, a, *kv))
    return frames


def rows_frames(sid: str, h: torch.Tensor) -> list[SpreadRows]:
    """h [rows, hidden] in frames of FRAME_BYTES at most, float32."""
    per = max(1, FRAME_BYTES // (4 * h.shape[1]))
    return [
        SpreadRows(sid, a, pack_tensor(h[a : a + per].unsqueeze(0), "float32"))
        for a in range(0, h.shape[0], per)
    ]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[heads, n, width] -> [1, n, heads * width]."""
    return t.transpose(0, 1).reshape(1, t.shape[1], -1)


def take_kv(cache: KVCache, msg: SpreadKv, have: int, upto: int) -> int:
    """Write `msg`'s positions into `cache` if they come next for their layer (`have` held,
    `upto` the most expected): the positions it now holds. Raises ProtocolError or
    ShapeMismatch for a frame out of place or out of shape."""
    if not 0 <= msg.layer < len(cache.keys):
        raise ProtocolError(f"spread keys for layer {msg.layer}: the pass has {len(cache.keys)}")
    if msg.pos != have or have >= upto:
        raise ProtocolError(
            f"spread keys of layer {msg.layer} at position {msg.pos}: expected {have} next, of"
            f" {upto}; they come in order"
        )
    k_cache, v_cache = cache.keys[msg.layer], cache.values[msg.layer]
    heads, width = k_cache.shape[1], k_cache.shape[3]
    k, v = (
        unpack_tensor(t, hidden=heads * width, max_tokens=upto - have, native=True)
        for t in (msg.keys, msg.values)
    )
    if k.shape != v.shape or k.dtype != k_cache.dtype or v.dtype != k_cache.dtype:
        raise ProtocolError(f"spread keys and values must match in shape and be {k_cache.dtype}")
    n = k.shape[1]
    k_cache[0, :, have : have + n] = k[0].view(n, heads, width).transpose(0, 1)
    v_cache[0, :, have : have + n] = v[0].view(n, heads, width).transpose(0, 1)
    return have + n


class Spread:
    """The owner's side of one spread pass: rows `hidden` [n, hidden] of session `sid` at
    [pos, pos + n), blocks [start, end), its rows [pos, at) here and the rest at a replica."""

    def __init__(self, ctx, sid: str, cache: KVCache, start: int, end: int, pos: int, hidden):
        self.ctx, self.sid, self.cache = ctx, sid, cache
        self.start, self.end, self.pos, self.hidden = start, end, pos, hidden
        self.at = split(ctx.span.config, end - start, pos, hidden.shape[0])
        self.conn: FramedStream | None = None
        self.peer = ""
        self.tail: Future = Future()  # the replica's rows' outputs, its keys already here
        self.token = trio.lowlevel.current_trio_token()
        self._out, self._frames = trio.open_memory_channel(math.inf)

    async def open(self) -> bool:
        """Ask the replicas in turn until one takes the rows; False if none did."""
        rows = self.pos + self.hidden.shape[0] - self.at
        ask = SpreadOpen(self.sid, self.ctx.fingerprint, self.start, self.end, self.at, rows)
        for rec in await candidates(self.ctx, self.start, self.end, self.at + rows):
            conn = None
            try:
                with trio.fail_after(DIAL_S):
                    conn = await dial_hop(rec.hop(), self.ctx.config.limits.max_frame)
                    await conn.send(ask)
                    reply = await conn.receive()
            except (OSError, trio.TooSlowError, trio.BrokenResourceError, SwarmError) as exc:
                log.info(
                    "spread of session %s...: %s did not answer: %r", self.sid[:8], rec.addr, exc
                )
                if conn is not None:
                    await trio.aclose_forcefully(conn.stream)
                continue
            if isinstance(reply, SpreadTaken) and reply.sid == self.sid:
                self.conn, self.peer = conn, rec.addr
                return True
            log.info("spread of session %s...: %s refused: %.200r", self.sid[:8], rec.addr, reply)
            await conn.aclose()
        return False

    async def run(self, ticket):
        """The pass, in `ticket`'s lane here and at the replica meanwhile: the compute's Done."""
        assert self.conn is not None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._send)
                nursery.start_soon(self._receive)
                self._emit(rows_frames(self.sid, self.hidden[self.at - self.pos :]), soon=True)
                ran = await outcome.acapture(ticket.run, self.compute, self.hidden.shape[0])
                nursery.cancel_scope.cancel()
        finally:
            self._fail(PeerFailed("the spread pass ended"))
            await self.conn.aclose()
        return ran.unwrap()

    def compute(self) -> torch.Tensor:
        """In the lane's thread: the owner's rows, then the replica's (or, if it failed, the
        owner computes them too): [1, n, hidden]."""
        if self.cache.length != self.pos:
            raise ProtocolError(
                f"step at position {self.pos} ran before the session's earlier positions"
                f" (cache holds {self.cache.length}); wait for each result"
            )
        own = self.hidden[: self.at - self.pos].float()

        def sent(layer: int) -> None:
            if not self.tail.done():
                self._emit(kv_frames(self.sid, self.cache, layer, 0, self.at))

        began = time.perf_counter()
        out = through(self.ctx.span, self.cache, self.start, self.end, self.pos, own, _no, sent)
        mine = time.perf_counter() - began
        try:
            tail = self.tail.result()
            log.info(
                "spread of session %s...: %d rows here in %.2f s, then %.2f s waiting for %s's %d",
                *(self.sid[:8], own.shape[0], mine, time.perf_counter() - began - mine),
                *(self.peer, tail.shape[0]),
            )
        except SwarmError as exc:
            log.warning(
                "spread of session %s... to %s failed (%s): computing its %d rows here",
                *(self.sid[:8], self.peer, exc, self.pos + self.hidden.shape[0] - self.at),
            )
            rest = self.hidden[self.at - self.pos :].float()
            tail = through(self.ctx.span, self.cache, self.start, self.end, self.at, rest, _no, _no)
        self.cache.length = self.pos + self.hidden.shape[0]
        return torch.cat((out, tail)).unsqueeze(0)

    def _emit(self, frames: list, soon: bool = False) -> None:
        if soon:
            self._out.send_nowait(frames)
        else:  # from the compute thread
            trio.from_thread.run_sync(self._out.send_nowait, frames, trio_token=self.token)

    def _fail(self, exc: SwarmError) -> None:
        if not self.tail.done():
            self.tail.set_exception(exc)

    async def _send(self) -> None:
        try:
            async for frames in self._frames:
                for frame in frames:
                    if self.tail.done():
                        return
                    await self.conn.send(frame)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._fail(PeerFailed(f"the replica's connection broke: {exc}"))
        except Exception as exc:  # a bug here must not leave the lane waiting for the tail
            log.exception("spread of session %s...: sending to the replica failed", self.sid[:8])
            self._fail(PeerFailed(f"sending to the replica failed: {exc!r}"))

    async def _receive(self) -> None:
        """The replica's keys and values into the cache, then its outputs into `tail`."""
        n, at, layers = self.pos + self.hidden.shape[0], self.at, self.end - self.start
        have = [at] * layers
        out = torch.empty(n - at, self.hidden.shape[1])
        rows = 0
        try:
            while rows < n - at or min(have) < n:
                with trio.fail_after(REPLY_S):
                    msg = await self.conn.receive()
                if msg is None:
                    raise PeerFailed("the replica closed the connection")
                if isinstance(msg, Error):
                    raise msg.exception()
                if getattr(msg, "sid", None) != self.sid:
                    raise ProtocolError(f"the replica sent {msg.t!r} out of place")
                if isinstance(msg, SpreadKv):
                    have[msg.layer] = take_kv(self.cache, msg, have[msg.layer], n)
                elif isinstance(msg, SpreadRows) and msg.row == rows:
                    width = self.hidden.shape[1]
                    h = unpack_tensor(msg.hidden, hidden=width, max_tokens=n - at - rows)
                    out[rows : rows + h.shape[1]] = h[0]
                    rows += h.shape[1]
                else:
                    raise ProtocolError(f"the replica sent {msg.t!r} out of place")
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._fail(PeerFailed(f"the replica's connection broke: {exc}"))
        except trio.TooSlowError:
            self._fail(PeerFailed(f"the replica sent nothing for {REPLY_S:g} s"))
        except SwarmError as exc:
            self._fail(exc)
        except Exception as exc:  # a bug here must not leave the lane waiting for the tail
            log.exception("spread of session %s...: reading the replica failed", self.sid[:8])
            self._fail(PeerFailed(f"reading the replica failed: {exc!r}"))
        else:
            if not self.tail.done():
                self.tail.set_result(out)
        finally:  # cancelled: the lane computes the rest itself
            self._fail(PeerFailed("the spread pass was cancelled"))


def _no(layer: int) -> None:
    pass


async def candidates(ctx, start: int, end: int, length: int) -> list[NodeRecord]:
    """Online nodes other than this one serving blocks [start, end) of the same weights in the
    same format, with room for `length` positions: the least busy first."""
    if ctx.directory is None or ctx.key is None:
        return []  # a node without the swarm's records (tests of a session alone)
    plaintext = ctx.directory.plaintext
    ok = [
        r
        for r in await ctx.directory.fresh()
        if r.state == ONLINE
        and r.role != CACHE
        and r.peer != ctx.key.peer
        and r.start <= start < end <= r.end
        and r.fingerprint == ctx.fingerprint
        and r.weights == ctx.span.format
        and r.free_cache_tokens >= length
        and (r.tls or plaintext)
    ]
    return sorted(ok, key=lambda r: (r.sessions, -r.free_cache_tokens))


async def spread_pass(ctx, ticket, cache: KVCache, sid: str, start: int, end: int, pos, hidden):
    """Rows hidden [1, n, hidden] at [pos, pos + n) through blocks [start, end) in `ticket`'s
    lane, a replica computing the later rows if one takes them: the compute's Done."""
    spread = Spread(ctx, sid, cache, start, end, pos, hidden[0])
    if await spread.open():
        log.info(
            "session %s...: prompt pass of %d tokens spread, rows from %d at %s",
            *(sid[:8], hidden.shape[1], spread.at, spread.peer),
        )
        return await spread.run(ticket)
    alone = functools.partial(forward_pass, ctx.span, cache, start, end, pos, hidden)
    return await ticket.run(alone, hidden.shape[1])
