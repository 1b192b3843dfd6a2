"""How a session computes its steps: decode steps first, prompt pieces gathered into passes
(prompt.py) in their turn in the prompt lane, each awaited in the compute lanes and its output
handed to the uplink, for the next hop or the client. The session's task runs `_work` until
the session closes (session.py: the rest of a session, and where it stands)."""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from typing import TYPE_CHECKING

import torch
import trio

from swarm.errors import ProtocolError, SessionNotFound, SwarmError
from swarm.model.sampling import Sampler
from swarm.node.borrow import borrowed_pass
from swarm.node.passes import (
    DecodeItem,
    Picked,
    Picker,
    decode_pass,
    forward_pass,
    picked,
    verify_pass,
)
from swarm.node.prompt import PromptPieces
from swarm.node.session_state import Copy, SessionState
from swarm.node.signal import Signal
from swarm.node.spread import candidates, spread_pass, spreadable
from swarm.node.uplink import CLIENTS, Payload
from swarm.protocol import DECODE, MAX_REWIND, PREFILL, Error, Open, Step

if TYPE_CHECKING:
    from swarm.model.blocks import KVCache
    from swarm.node.borrow_link import Lender
    from swarm.node.compute import Done, Early, Ticket
    from swarm.node.context import SessionContext
    from swarm.node.handover.cache import CacheIntake
    from swarm.transport import FramedStream

log = logging.getLogger("swarm.node")


class StepWork:
    """The half of a `Session` that computes: what it reads of the session is declared here."""

    ctx: SessionContext
    sid: str
    hop: int
    start: int
    end: int
    max_length: int
    wire_dtype: str
    open_msg: Open
    state: SessionState
    sink: FramedStream | None
    downstream: str | None
    intake: CacheIntake | None
    cache: KVCache | None
    lender: Lender | None  # where its oldest KV blocks are, if it borrows
    changed: Signal
    pieces: PromptPieces
    decodes: deque[tuple[Step, torch.Tensor, float]]
    prompt_end: int
    _tickets: list[Ticket]
    _wake: trio.Event
    _computing: bool
    _idling: bool  # its task waits for something to do
    _early: tuple[Step, Early] | None  # a decode step whose pass began as it arrived

    @property
    def is_last(self) -> bool:
        raise NotImplementedError

    async def fail(self, error: Error) -> None:
        raise NotImplementedError

    def moved(self, event) -> object:
        raise NotImplementedError

    def _queue(self, msg: Step, hidden: torch.Tensor, now: float) -> None:
        if msg.phase == DECODE:
            self.ctx.uplink.observe_decode_arrival(self.sid)
            self._start_early(msg, hidden)
            self.decodes.append((msg, hidden, now))
        else:
            self.pieces.add(msg, hidden, now)
            self.ctx.observer.prompt_piece(self.sid, now, msg.pos, hidden.shape[1], msg.end)
        self._wake.set()

    def _start_early(self, step: Step, hidden: torch.Tensor) -> None:
        """A one-token decode step coming to a session whose task waits for work: where the
        decode lane is idle its pass starts now (compute.decode_now), and the task takes its
        result when it wakes."""
        if not self._idling or self.decodes or self.pieces or self._early is not None:
            return
        if hidden.shape[1] != 1 or step.spec is not None or self.lender is not None:
            return
        if self.cache is None or self.state.closed:
            return
        early = self.ctx.compute.decode_now(*self._one_token(self.cache, step, hidden))
        if early is not None:
            self._early = (step, early)

    async def _settle_early(self) -> None:
        """An early pass left as the session ends: its thread is done with the cache before
        the cache is let go, and the lane is released."""
        if self._early is None:
            return
        _, early = self._early
        self._early = None
        try:
            await self.ctx.compute.finish(early)
        except Exception:
            pass  # its step is gone: nothing to tell

    def _drop_decodes_from(self, pos: int) -> None:
        stale = [d for d in self.decodes if d[0].pos >= pos]
        for d in stale:
            self.decodes.remove(d)
        self.ctx.counters.steps_dropped += len(stale)

    async def _work(self, cache: KVCache) -> None:
        try:
            while not self.state.closed:
                self._computing = True
                if self.decodes:
                    await self._decode(cache, *self.decodes.popleft())
                elif self.pieces:
                    await self._prompt_pass(cache)
                else:
                    self._computing = False
                    self.changed.fire()
                    await self._idle()
                self._computing = False
                self.changed.fire()
        finally:
            await self._settle_early()
            for ticket in self._tickets:
                ticket.release()

    @property
    def quiet(self) -> bool:
        """Nothing of the session is computing or waiting to be: its cache stands still."""
        return not (self._computing or self.decodes or self.pieces)

    async def _sink_in_time(self) -> bool:
        """A handed-over last hop may compute a step before the client has resumed it here:
        the result waits for the client a little while."""
        if self.intake is None:
            return False
        with trio.move_on_after(self.ctx.config.limits.open_timeout_s):
            await self.changed.until(lambda: self.sink is not None)
        return self.sink is not None

    async def _woken(self) -> None:
        self._wake = trio.Event()
        await self._wake.wait()

    async def _idle(self) -> None:
        limits = self.ctx.config.limits
        idle, unused = limits.session_idle_s, limits.open_deadline_s
        with trio.move_on_after(self.state.deadline(idle, unused) - time.monotonic()):
            self._idling = True
            try:
                await self._woken()
            finally:
                self._idling = False
            return
        if self.state.expired(time.monotonic(), idle, unused):
            if self.state.used:
                err = SessionNotFound("session expired after idling")
            else:
                what = "attached" if self.is_last else "stepped"
                err = SessionNotFound(f"session dropped: not {what} within {unused:g} s of opening")
            await self.fail(Error.of(err, self.sid, self.hop))

    async def _decode(self, cache: KVCache, step: Step, hidden: torch.Tensor, arrived: float):
        compute, early = self.ctx.compute, None
        if self._early is not None:
            if self._early[0] is step:
                early, self._early = self._early[1], None
            else:  # not met (a rewind drops no plain step), but the lane must never stay held
                await self._settle_early()
        try:
            done = await (compute.finish(early) if early else self._compute(cache, step, hidden))
        except Exception as exc:
            await self._compute_failed(exc)
            return
        if step.spec is not None:
            self.ctx.counters.rounds_done += 1
        if await self._forward(step, done):
            self.ctx.observer.decode_step(arrived, time.monotonic(), done.elapsed, done.usage)

    async def _compute(self, cache: KVCache, step: Step, hidden: torch.Tensor) -> Done:
        compute, span = self.ctx.compute, self.ctx.span
        if step.spec is not None:  # a verification round: its drafts may be rejected
            cache.rewind(step.pos)
            cache.keep_for_rewind(step.pos, hidden.shape[1], MAX_REWIND)
        n = hidden.shape[1]
        if self.lender is not None:  # aside: each layer waits for the lender's piece
            fn = self._picking(self._pass(cache, step.pos, hidden, step.ids), step, n)
            return await compute.aside(fn, 1)
        if n == 1:  # joins other sessions' steps through the same blocks
            return await compute.decode(*self._one_token(cache, step, hidden))
        run_pass = verify_pass if step.spec is not None else forward_pass
        args = (span, cache, self.start, self.end, step.pos, hidden, step.ids)
        fn = functools.partial(run_pass, *args)
        return await compute.run(DECODE, self._picking(fn, step, n), n)

    def _one_token(self, cache: KVCache, step: Step, hidden: torch.Tensor):
        """A one-token decode step as a decode pass takes it (ComputeQueue.decode): its
        blocks, its item, the pass, its session."""
        run = functools.partial(decode_pass, self.ctx.span, self.start, self.end)
        item = DecodeItem(cache, step.pos, hidden, step.ids, self._picker())
        return (self.start, self.end), item, run, self.sid

    async def _prompt_pass(self, cache: KVCache) -> None:
        """Wait for the prompt lane, then compute what has arrived by then (up to a pass's
        worth), holding the next place in the lane already if more waits."""
        config, compute = self.ctx.config.compute, self.ctx.compute
        if not self._tickets:
            self._tickets.append(compute.reserve(PREFILL, self._rank()))
        ticket = self._tickets[0]
        await ticket.turn()
        spread = await self._spreads()  # a long prompt: gathered for one pass over two nodes
        least = self.pieces.tokens_left() if spread else config.min_pass_tokens  # all of it
        wait = self.pieces.wait(time.monotonic(), least, config.gather_s)
        if wait > 0:  # a few tokens only: let more come, a little while
            self._tickets.pop(0).release()
            with trio.move_on_after(wait):
                while self.pieces.wait(time.monotonic(), least, config.gather_s) > 0:
                    await self._woken()
            return
        spread = spread and self.pieces.ready() >= config.spread_tokens
        limit = self.max_length if spread else config.pass_tokens
        step, hidden = self.pieces.take(limit, time.monotonic())
        self.prompt_end = step.end
        if self.pieces:  # more than one pass waits: queue the next, behind any decode step
            self._tickets.append(compute.reserve(PREFILL, self._rank()))
        try:
            if spread:
                args = (cache, self.sid, self.start, self.end, step.pos, hidden)
                done = await spread_pass(self.ctx, ticket, *args)
            else:
                fn = self._pass(cache, step.pos, hidden, step.ids)
                done = await ticket.run(self._picking(fn, step, hidden.shape[1]), hidden.shape[1])
        except Exception as exc:
            await self._compute_failed(exc)
            return
        finally:
            self._tickets.remove(ticket)
            ticket.release()
        self.ctx.counters.prompt_passes += 1
        self.ctx.counters.prompt_tokens += hidden.shape[1]
        if await self._forward(step, done):
            out = _hidden(done.result)
            self._prompt_computed(done_all=step.pos + out.shape[1] == step.end)
            self.ctx.observer.prompt_pass(
                self.sid,
                time.monotonic(),
                step.pos,
                out.shape[1],
                step.end,
                done.elapsed,
                done.usage,
            )

    async def _spreads(self) -> bool:
        """The oldest prompt waiting is long enough to spread over a replica
        (swarm/node/spread.py), this session's blocks compute it in split rows, and some
        replica of them is announced."""
        least = self.ctx.config.compute.spread_tokens
        if not least or self.lender is not None or self.pieces.tokens_left() < max(2, least):
            return False
        if not spreadable(self.ctx.span.config, self.start, self.end, self.max_length):
            return False
        return bool(await candidates(self.ctx, self.start, self.end, 0))

    def _pass(self, cache, pos: int, hidden: torch.Tensor, ids=None):
        """The compute of one forward pass from `pos`, for a lane; `ids`: its tokens' (a
        model whose layers read them; such a model's sessions do not borrow)."""
        if self.lender is not None:
            args = (self.ctx.span, cache, self.lender, self.start, self.end, pos, hidden)
            return functools.partial(borrowed_pass, *args)
        return functools.partial(
            forward_pass, self.ctx.span, cache, self.start, self.end, pos, hidden, ids
        )

    def _prompt_computed(self, done_all: bool) -> None:
        """Opened with a handoff (this node computes prompts for a decode node): the session
        goes to that node, its cache streaming there from the prompt's first pass on (the
        rest follows as passes finish), decoding here until it has all arrived. A layer with a
        sliding window shorter than the session waits for the whole prompt: the next pass
        would overwrite positions of its ring while they are copied out."""
        if self.open_msg.handoff is None or self.ctx.hand_off is None or self.lender:
            return
        if not self.state.accepts(Copy()):
            return  # moving already
        assert self.cache is not None
        rings = any(k.shape[2] < self.max_length for k in self.cache.keys)
        if done_all or not rings:
            self.moved(Copy())
            self.ctx.hand_off(self)

    def _rank(self) -> float:
        compute = self.ctx.compute
        left = self.pieces.tokens_left()
        rank = compute.prefill_rank(self.pieces.prompt_since, left)
        per_token = compute.prefill_token_seconds or 0.0
        cost = min(left, self.ctx.config.compute.pass_tokens) * per_token
        return self.ctx.sessions.prompt_rank(self, rank, cost)

    async def _compute_failed(self, error: Exception) -> None:
        if self.state.closed:
            return
        log.exception("step failed in session %s...", self.sid[:8], exc_info=error)
        err = error if isinstance(error, SwarmError) else ProtocolError(f"compute failed: {error}")
        await self.fail(Error.of(err, sid=self.sid, hop=self.hop))

    async def _forward(self, step: Step, done: Done) -> bool:
        """Queue a pass's output for the next hop (or the client); False if the session ended."""
        if self.state.closed:
            return False
        out, picks = done.result, None
        if isinstance(out, Picked):
            out, picks = out
        n = out.shape[1]
        self.ctx.counters.steps_done += 1
        self.ctx.counters.tokens_done += n
        if not self.is_last:
            ds = self.ctx.downstream.stream(self.downstream)
            if ds is None:
                return True  # lost: the sessions through it are failing
            to, dest, phase, result = ds, self.downstream, step.phase, False
        elif step.pos + n != step.end:
            return True  # a middle chunk of a prefill: the client needs only the last token
        elif self.sink is None and not await self._sink_in_time():
            err = SessionNotFound("no client attached to receive results")
            await self.fail(Error.of(err, self.sid, self.hop))
            return False
        elif step.spec is not None:  # a verification round: the client checks every token
            to, dest, phase, result = self.sink, CLIENTS, DECODE, True
        else:
            to, dest, phase, result = self.sink, CLIENTS, DECODE, True
            out = out if n == 1 else out[:, -1:]
        if result and picks is not None:  # the tokens, not the hidden states they come from
            out = out[:, -len(picks) :, :0]
        payload = Payload(
            to,
            dest,
            self.sid,
            phase,
            step.pos,
            step.end,
            out,
            self.wire_dtype,
            result=result,
            spec=step.spec,
            ids=None if result else step.ids,
            picks=picks if result else None,
        )
        self.ctx.uplink.send_activations(payload)
        return True

    def _picker(self) -> Picker | None:
        """Where this node picks the session's tokens: on the route's last hop, for a session
        opened with `picking`, where the span holds the model's head."""
        picking, head = self.open_msg.picking, self.ctx.span.head
        if picking is None or head is None or not self.is_last:
            return None
        return Picker(head, Sampler(picking))

    def _picking(self, fn, step: Step, n: int):
        """`fn`, a pass over the `n` tokens of `step`, then the picks the client reads of it
        where this node picks the session's tokens: after each token of a verification round,
        after the last of a step that ends its phase's input, none after a middle piece."""
        picker = self._picker()
        if picker is None or step.pos + n != step.end:
            return fn
        return functools.partial(picked, fn, picker, step.pos, n if step.spec is not None else 1)


def _hidden(result) -> torch.Tensor:
    return result.hidden if isinstance(result, Picked) else result
