"""A decode step that finds its session waiting and the decode lane idle starts its pass as it
arrives, before the session's task runs (ComputeQueue.decode_now); what the task would have
guaranteed still holds: one pass a lane, a session's cache kept until its pass is done. Real
compute lanes, a stand-in model (tests/helpers)."""

from __future__ import annotations

import threading
from dataclasses import replace

import torch
import trio

from swarm.model.blocks import KVCache
from swarm.protocol import DECODE, Open
from tests.helpers.doubles import Doubling
from tests.helpers.sessions import SID, TOKEN, Conn, context, open_msg, start, step, until

WAIT_S = 5.0


class Held(Doubling):
    """Blocks whose decode passes wait until `go` is set: each pass's start is recorded, and
    what its sessions' caches held when it ended."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.started = threading.Event()
        self.passes: list[tuple[int, ...]] = []  # each pass's positions
        self.kept: list[int] = []  # each pass's first cache's keys, at its end

    def allocate_cache(self, start: int, end: int, max_length: int) -> KVCache:
        return KVCache(keys=[torch.zeros(1)], values=[torch.zeros(1)])

    def forward(self, h, cache: KVCache, pos: int, start: int, end: int, ids=None):
        if h.shape[1] == 1:  # a step alone (prompts pass at once)
            self._hold([cache], [pos])
        return super().forward(h, cache, pos, start, end, ids)

    def decode(self, h, caches, positions, start, end, ids=None):
        self._hold(caches, positions)
        return super().decode(h, caches, positions, start, end, ids)

    def _hold(self, caches: list[KVCache], positions: list[int]) -> None:
        self.passes.append(tuple(positions))
        self.started.set()
        assert self.go.wait(WAIT_S)
        self.kept.append(len(caches[0].keys))


async def prefilled(ctx, nursery, msg: Open | None = None):
    """A last-hop session with its client attached and a prompt of 4 computed, its task idle."""
    msg = msg or open_msg()
    session, owner = await start(ctx, nursery, msg)
    await until(lambda: owner.sent)
    session.attach(Conn(), TOKEN)
    session.take_step(replace(step(0, 4, 4)[0], sid=msg.sid))
    await until(lambda: session.quiet and session._idling)
    return session


OTHER = "u" * 32


async def two_sessions(nursery):
    """Two prefilled sessions on one node: its blocks, its context, the sessions."""
    span = Held()
    ctx = replace(context(nursery), span=span)
    first = await prefilled(ctx, nursery)
    second = await prefilled(ctx, nursery, replace(open_msg(), sid=OTHER))
    return span, ctx, first, second


def decode_step(pos: int, sid: str = SID):
    msg, hidden = step(pos, 1, pos + 1, DECODE)
    return replace(msg, sid=sid), hidden


async def test_a_decode_step_to_a_waiting_session_starts_its_pass_before_its_task_runs(nursery):
    span = Held()
    ctx = replace(context(nursery), span=span)
    session = await prefilled(ctx, nursery)
    msg, hidden = decode_step(4)
    session.take_step(msg)
    assert span.started.wait(WAIT_S)  # no await since the step came: no task has run
    span.go.set()
    await until(lambda: len(ctx.uplink.payloads) == 2)
    sent = ctx.uplink.payloads[1]
    assert (sent.phase, sent.pos) == (DECODE, 4)
    assert torch.equal(sent.hidden, hidden * 2)


async def test_a_decode_step_finding_the_lane_busy_waits_for_its_turn(nursery):
    span, ctx, first, second = await two_sessions(nursery)
    first.take_step(decode_step(4)[0])
    assert span.started.wait(WAIT_S)
    second.take_step(decode_step(4, OTHER)[0])
    await trio.sleep(0.1)
    assert span.passes == [(4,)]  # one pass a lane: the second waits behind the first
    span.go.set()
    await until(lambda: len(ctx.uplink.payloads) == 4)
    assert span.passes == [(4,), (4,)]


async def test_a_session_closed_during_its_early_pass_keeps_its_cache_until_the_pass_ends(
    nursery,
):
    span = Held()
    ctx = replace(context(nursery), span=span)
    session = await prefilled(ctx, nursery)
    session.take_step(decode_step(4)[0])
    assert span.started.wait(WAIT_S)
    session.close()
    await trio.sleep(0.1)  # the session's task ends as far as it may
    span.go.set()
    await until(lambda: span.kept)
    assert span.kept == [1]
    assert len(ctx.uplink.payloads) == 1  # a closed session's result goes nowhere


async def test_a_decode_step_where_another_session_steps_takes_its_turn_in_the_queue(nursery):
    # steps of several sessions arriving in one burst, each started as it came, would go one
    # a pass: they queue and share passes as before
    span, ctx, first, second = await two_sessions(nursery)
    span.go.set()
    first.take_step(decode_step(4)[0])
    await until(lambda: len(ctx.uplink.payloads) == 3 and second._idling)
    span.go.clear()
    span.started.clear()
    second.take_step(decode_step(4, OTHER)[0])
    assert not span.started.wait(0.2)  # the lane is idle, but the step waits for its turn
    span.go.set()
    await until(lambda: len(ctx.uplink.payloads) == 4)
