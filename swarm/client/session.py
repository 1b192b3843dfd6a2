"""One inference session through a fixed route: open it, push steps, read the last hidden state."""

from __future__ import annotations

import secrets
import time

import torch
import trio

from swarm.errors import PeerFailed, ProtocolError, SwarmError
from swarm.heartbeat import INTERVAL_S, Heartbeat, send_queue_busy
from swarm.protocol import (
    DECODE,
    PREFILL,
    Attach,
    Attached,
    Close,
    Error,
    Hop,
    Moved,
    Open,
    Opened,
    Picking,
    Ping,
    Release,
    Result,
    Resume,
    Resumed,
    Step,
)
from swarm.transport import FramedStream, dial_hop
from swarm.wire import DEFAULT_MAX_FRAME, DEFAULT_WIRE_DTYPE, pack_tensor, unpack_tensor

PREFILL_CHUNK = 256  # tokens per prefill step the client sends


class RemoteSession:
    """Async session over a route. Not thread-safe; the client runtime drives it from one task."""

    def __init__(
        self,
        route: list[Hop],
        fingerprint: str,
        hidden: int,
        max_length: int,
        wire_dtype: str | None = None,
        step_timeout: float = 30.0,
        max_frame: int = DEFAULT_MAX_FRAME,
        prefill_chunk: int = PREFILL_CHUNK,
        own_dtype: str = DEFAULT_WIRE_DTYPE,
        handoff: Hop | None = None,
        with_ids: bool = False,
        picking: Picking | None = None,
    ):
        self.route = list(route)  # a hop handed over by a leaving node changes here
        self.with_ids = with_ids  # steps carry their tokens' ids (Gemma 4's per-layer inputs)
        self.own_dtype = own_dtype  # what the client sends where it asks nodes for none
        self.prefill_chunk = max(1, prefill_chunk)
        self.fingerprint = fingerprint
        self.hidden = hidden
        self.max_length = max_length
        self.wire_dtype = wire_dtype or ""
        self.step_timeout = step_timeout
        self.max_frame = max_frame
        self.sid = secrets.token_hex(16)
        self.position = 0
        self.first: FramedStream | None = None
        self.last: FramedStream | None = None
        self._beats: dict[int, Heartbeat] = {}  # id(connection) -> its heartbeat, while stepping
        self._token = ""  # the sink token, which also claims the session where it moves
        self.moves = 0  # hops handed over to another node (their caches moved; no replay)
        self.handoff = handoff  # where the last hop hands the session once the prompt is in
        self.embeds = False  # the first hop looks token ids up itself: steps carry ids alone
        self._rounds: dict[int, Result] = {}  # verification rounds' results read early
        self.picking = picking  # asks the last hop to pick the tokens (Result.picks)

    async def open(self) -> None:
        first, last = self.route[0], self.route[-1]
        self.first = await self._connect(0, first)
        token = self._token = secrets.token_hex(16)
        await self.first.send(
            Open(
                sid=self.sid,
                route=tuple(self.route),
                hop=0,
                fingerprint=self.fingerprint,
                wire_dtype=self.wire_dtype,
                max_length=self.max_length,
                sink_token=token,
                handoff=self.handoff,
                picking=self.picking,
            )
        )
        opened = await self._expect(self.first, Opened, 0, timeout=60 + 5 * len(self.route))
        self.embeds = opened.embeds
        if len(self.route) == 1:
            self.last = self.first
        else:
            self.last = await self._connect(len(self.route) - 1, last)
        await self.last.send(Attach(sid=self.sid, sink_token=token))
        await self._expect(self.last, Attached, len(self.route) - 1, timeout=30)

    async def _connect(self, hop: int, h: Hop) -> FramedStream:
        try:
            with trio.fail_after(10):
                return await dial_hop(h, self.max_frame)
        except (OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
            raise self._failed(hop, f"cannot connect: {exc or type(exc).__name__}") from None
        except PeerFailed as exc:  # the wrong peer at the address, or its relay lost it
            raise self._failed(hop, str(exc), type(exc)) from None

    def _failed(self, hop: int, why: str, kind: type[PeerFailed] = PeerFailed) -> PeerFailed:
        h = self.route[hop]
        return kind(
            f"hop {hop} ({h.addr}, blocks {h.start}:{h.end}) failed: {why}",
            hop=hop,
            peer=h.peer,
        )

    def _raise_error(self, msg: Error, default_hop: int):
        hop = msg.hop if 0 <= msg.hop < len(self.route) else default_hop
        raise _with_hop(msg.exception(), hop, self.route[hop].peer)

    async def _receive(self, conn: FramedStream, hop: int):
        try:
            msg = await conn.receive()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise self._failed(hop, f"connection lost: {exc}") from None
        if msg is None:
            raise self._failed(hop, "connection closed")
        if (beat := self._beats.get(id(conn))) is not None:
            beat.heard()
        return msg

    async def _expect(self, conn: FramedStream, kind: type, hop: int, timeout: float):
        with trio.move_on_after(timeout):
            while True:
                msg = await self._receive(conn, hop)
                if isinstance(msg, Error):
                    self._raise_error(msg, hop)
                if isinstance(msg, kind) and getattr(msg, "sid", None) == self.sid:
                    return msg
        raise self._failed(hop, f"no {kind.__name__.lower()} within {timeout:.0f} s")

    async def step(self, hidden: torch.Tensor | None, ids=None) -> torch.Tensor | tuple[int]:
        """Activations [1, tokens, hidden] in; the last token's final hidden [1, hidden] out,
        or where the last hop picks (`picking`), the token it picked after it, (token,).
        `ids`: the tokens' ids, sent along where the model's layers read them (Gemma 4), and
        alone, `hidden` None, to a first hop that embeds them (`embeds`)."""
        n = self._tokens(hidden, ids)
        if self.position + n > self.max_length:
            raise ProtocolError(
                f"session holds {self.max_length} tokens; {self.position + n} requested"
            )
        phase = DECODE if n == 1 and self.position > 0 else PREFILL
        end = self.position + n
        # A long prompt goes as several steps of one phase, so the first node computes it in
        # pieces and other sessions' decode steps run in between (the nodes' queues put decode
        # first); only the step reaching `end` comes back as a Result.
        for lo in range(0, n, self.prefill_chunk):
            hi = min(n, lo + self.prefill_chunk)
            await self._send_first(
                Step(
                    sid=self.sid,
                    phase=phase,
                    pos=self.position + lo,
                    end=end,
                    hidden=self._packed(hidden, lo, hi),
                    ids=self._ids(ids, lo, hi, alone=hidden is None),
                )
            )
        timeout = self.step_timeout + 0.05 * n
        while True:
            answer = await self._await_result(end, timeout)
            if not isinstance(answer, Moved):
                break
            await self._follow(answer)  # the step's result comes from the new node
        result = answer
        if result is None:
            raise PeerFailed(f"no result within {timeout:.0f} s", hop=None)
        self.position = end
        if (picks := self._picks(result, 1)) is not None:
            return picks
        out = unpack_tensor(result.hidden, hidden=self.hidden, max_tokens=1)
        return out[:, -1]

    def _picks(self, result: Result, tokens: int) -> tuple[int, ...] | None:
        """The tokens `result` carries, one after each of the step's last `tokens` (None: it
        carries hidden states); ProtocolError, the last hop's, for any other count."""
        if result.picks is None:
            return None
        if self.picking is None or len(result.picks) != tokens:
            why = f"a result of {len(result.picks)} picked tokens where {tokens} were due"
            why += "" if self.picking else ", none asked for"
            hop = len(self.route) - 1
            raise _with_hop(ProtocolError(why), hop, self.route[hop].peer)
        return result.picks

    def _tokens(self, hidden: torch.Tensor | None, ids) -> int:
        if hidden is not None:
            return hidden.shape[1]
        if ids is None or not self.embeds:
            raise ValueError("steps without activations need token ids and a hop that embeds")
        return len(ids)

    def _packed(self, hidden: torch.Tensor | None, lo: int, hi: int):
        if hidden is None:
            return None
        return pack_tensor(hidden[:, lo:hi], self.wire_dtype or self.own_dtype)

    def _ids(self, ids, lo: int, hi: int, alone: bool = False) -> tuple[int, ...] | None:
        """ids[lo:hi] where they travel `alone` (the first hop embeds them) or the model's
        layers read them (Gemma 4's per-layer inputs), else None: other models' steps travel
        without them."""
        if ids is None or not (alone or self.with_ids):
            return None
        return tuple(int(i) for i in ids[lo:hi])

    async def send_round(self, hidden: torch.Tensor | None, pos: int, spec: int, ids=None) -> None:
        """Send verification round `spec`: tokens [1, n, hidden] at positions [pos, pos + n),
        drafts after a token the client has decided; rounds before it need not be answered
        yet, and a round at a position before the last one's end rewinds the route there.
        `hidden` None: the ids alone, as `step`'s."""
        n = self._tokens(hidden, ids)
        end = pos + n
        if end > self.max_length:
            raise ProtocolError(f"session holds {self.max_length} tokens; {end} requested")
        packed = self._packed(hidden, 0, n)
        ids = self._ids(ids, 0, n, alone=hidden is None)
        await self._send_first(Step(self.sid, DECODE, pos, end, packed, spec=spec, ids=ids))
        self.position = end

    async def round_result(self, spec: int, pos: int, tokens: int) -> torch.Tensor | tuple:
        """Round `spec`'s final hidden states [tokens, hidden], or where the last hop picks,
        the token it picked after each; a stale round's are dropped."""
        for old in [r for r in self._rounds if r < spec]:
            del self._rounds[old]
        answer = self._rounds.pop(spec, None)
        timeout = self.step_timeout + 0.05 * tokens
        while answer is None:
            answer = await self._await_result(pos + tokens, timeout, spec)
            if isinstance(answer, Moved):
                await self._follow(answer)
                answer = None
            elif answer is None:
                raise PeerFailed(f"no result within {timeout:.0f} s", hop=None)
        if (picks := self._picks(answer, tokens)) is not None:
            return picks
        return unpack_tensor(answer.hidden, hidden=self.hidden, max_tokens=tokens)[0]

    async def _await_result(
        self, end: int, timeout: float, spec: int | None = None
    ) -> Result | Moved | None:
        """The step's Result (None: none within `timeout`), or a Moved: a hop was handed over
        to another node, whose connection the result then comes on. Awaiting verification
        round `spec`, the results of later rounds are kept for their turn."""
        # most results come before the heartbeat's first pings are due: until then the last
        # hop's connection alone is read, without the two tasks a step's wait starts after it
        # (each task started and cancelled costs the client's loop a step's worth of wake-ups)
        quick = min(INTERVAL_S, timeout)
        with trio.move_on_after(quick):
            return await self._last_hop_answer(end, spec, None)
        answer: Result | Moved | None = None
        try:
            async with trio.open_nursery() as nursery:

                def moved(msg: Moved) -> None:
                    nonlocal answer
                    answer = msg
                    nursery.cancel_scope.cancel()

                if self.first is not self.last:
                    nursery.start_soon(self._watch_first, moved)
                nursery.start_soon(self._heartbeat, INTERVAL_S - quick)
                with trio.move_on_after(timeout - quick):
                    answer = await self._last_hop_answer(end, spec, moved)
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise _first_swarm_error(group) from None
        finally:
            self._beats = {}
        return answer

    async def _last_hop_answer(self, end: int, spec: int | None, moved) -> Result | Moved:
        """The awaited Result (or a Moved of this session) off the last hop's connection;
        `moved(msg)` is told of a Moved where a nursery waits with this read."""
        while True:
            msg = await self._receive(self.last, len(self.route) - 1)
            if isinstance(msg, Error):
                self._raise_error(msg, len(self.route) - 1)
            if isinstance(msg, Moved) and msg.sid == self.sid:
                if moved is None:
                    return msg
                moved(msg)
            if not isinstance(msg, Result) or msg.sid != self.sid:
                continue
            if msg.spec == spec and msg.end == end:
                return msg
            if msg.spec is not None and spec is not None and msg.spec > spec:
                self._rounds[msg.spec] = msg

    async def _follow(self, moved: Moved) -> None:
        """Hop `moved.hop` now runs on `moved.to`, its cache moved there: claim the session
        there (as its owner if it is the first hop, its sink if the last), then release it on
        the node it left, whose last steps then follow to the new one."""
        hop = moved.hop
        if not 0 <= hop < len(self.route):
            raise self._failed(0, f"moved hop {hop} is not on the route", ProtocolError)
        owner, sink = hop == 0, hop == len(self.route) - 1
        old = {id(c): c for c in (self.first, self.last)}
        if owner or sink:
            conn = await self._connect(hop, moved.to)
            await self._send(conn, hop, Resume(self.sid, self._token, owner=owner, sink=sink))
            self.route[hop] = moved.to
            await self._expect(conn, Resumed, hop, timeout=30)
            if owner:
                await self._send(self.first, 0, Release(sid=self.sid))
                self.first = conn
            if sink:
                self.last = conn
        else:
            self.route[hop] = moved.to
        self.moves += 1
        for c in old.values():
            if c is not self.first and c is not self.last:
                await c.aclose()

    async def _send_first(self, msg) -> None:
        try:
            await self.first.send(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise self._failed(0, f"connection lost: {exc}") from None

    async def _heartbeat(self, first: float) -> None:
        """While a step is out, ping the first and the last hop; a hop silent for the
        heartbeat's timeout is hung (a hop in between is watched by the node before it). The
        first pings go once the step has been out an interval (`first` s from now): most steps
        are answered sooner, and a ping and its pong would cost every hop they cross work
        beside its compute."""
        ends = {0: self.first, len(self.route) - 1: self.last}
        if self.first is self.last:
            ends = {0: self.first}
        beats = {hop: Heartbeat() for hop in ends}
        self._beats = {id(conn): beats[hop] for hop, conn in ends.items()}
        nonce, delay = 0, first
        while True:
            await trio.sleep(delay)
            delay = INTERVAL_S
            for hop, conn in ends.items():
                now = time.monotonic()
                beat = beats[hop]
                beat.queued(now, send_queue_busy(conn.socket))
                if beat.hung(now):
                    raise self._failed(hop, f"no answer to pings for {beat.silent_for(now):.1f} s")
                nonce += 1
                await self._send(conn, hop, Ping(nonce=nonce))
                beat.pinged(now)

    async def _send(self, conn: FramedStream, hop: int, msg) -> None:
        try:
            await conn.send(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise self._failed(hop, f"connection lost: {exc}") from None

    async def _watch_first(self, moved) -> None:
        """Errors travel back hop by hop to the first node's connection, and so do moves."""
        while True:
            msg = await self._receive(self.first, 0)
            if isinstance(msg, Error):
                self._raise_error(msg, 0)
            if isinstance(msg, Moved) and msg.sid == self.sid:
                moved(msg)
                return

    async def aclose(self) -> None:
        for conn in {id(c): c for c in (self.first, self.last) if c is not None}.values():
            if conn is self.first:
                with trio.move_on_after(1):
                    try:
                        await conn.send(Close(sid=self.sid))
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
            await conn.aclose()


def _with_hop(exc: SwarmError, hop: int, peer: str) -> SwarmError:
    exc.hop = hop  # type: ignore[attr-defined]
    exc.peer = peer  # type: ignore[attr-defined]
    return exc


def _first_swarm_error(group: BaseExceptionGroup) -> BaseException:
    """The error a caller can act on: the first SwarmError inside a nursery's group."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            exc = _first_swarm_error(exc)
        if isinstance(exc, SwarmError):
            return exc
    return group
