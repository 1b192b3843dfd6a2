"""The replica's side of a spread prompt pass (swarm/node/spread.py): the later rows of another
node's prompt pass, computed here over the keys and values that node streams, and answered
layer by layer.

A spread belongs to the connection that opened it, one at a time on it and `MAX_SPREADS` in the
node; its cache (its positions through its blocks) lives only while it runs and goes with its
connection. Its rows wait in the prompt lane ahead of this node's own prompt passes (the owner
is waiting), and each layer waits in the lane's thread until the owner's keys and values of
that layer are in. Refused (SpreadRefused) for other weights or blocks, layers that cannot
split, or more positions than this node gives a session or has free; a frame out of place or
shape is a typed error that ends the spread, never the connection or the node.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import trio

from swarm.errors import PeerFailed, ProtocolError, SpreadRefused, SwarmError
from swarm.model.blocks import KVCache, Span
from swarm.node.context import send_quietly
from swarm.node.spread import REPLY_S, kv_frames, rows_frames, spreadable, take_kv, through
from swarm.protocol import PREFILL, Error
from swarm.spreading import SpreadKv, SpreadOpen, SpreadRows, SpreadTaken
from swarm.wire import unpack_tensor

if TYPE_CHECKING:
    from swarm.node.compute import ComputeQueue
    from swarm.node.session_table import SessionTable

log = logging.getLogger("swarm.node")

MAX_SPREADS = 1  # spreads computed here at once: each holds a pass's cache


@dataclass(eq=False)
class Job:
    """One spread this node computes rows of: what has come of its inputs so far."""

    conn: object
    ask: SpreadOpen
    cache: KVCache
    hidden: torch.Tensor  # [rows, hidden]: its input rows, then nothing else
    rows_in: int = 0
    have: list[int] = field(default_factory=list)  # per layer: positions [0, have) are in
    inputs: trio.Event = field(default_factory=trio.Event)  # every input row is in
    ready: threading.Condition = field(default_factory=threading.Condition)  # a layer came
    failed: str = ""  # why it ended early; the lane's thread stops at its next layer


class SpreadReplica:
    """Every spread this node computes rows of; the node's connections hand it their frames
    (`handlers`) and tell it when they end (`forget`)."""

    def __init__(
        self,
        span: Span,
        fingerprint: str,
        compute: ComputeQueue,
        sessions: SessionTable,
        spawn: Callable,
    ):
        """`sessions`: the node's, whose free cache tokens bound a spread; `spawn(fn, *args)`:
        start a task in the node's nursery."""
        self.span, self.fingerprint, self.compute = span, fingerprint, compute
        self.sessions, self.spawn = sessions, spawn
        self._jobs: dict[object, Job] = {}
        self.handlers = {SpreadOpen: self.open, SpreadRows: self.rows, SpreadKv: self.kv}

    def holds(self, conn: object) -> bool:
        return conn in self._jobs

    def forget(self, conn: object) -> None:
        """The connection ended: its spread, if any, stops at its next layer."""
        job = self._jobs.pop(conn, None)
        if job is not None:
            self._stop(job, "the owner's connection ended")

    async def open(self, conn, ask: SpreadOpen) -> None:
        self._check(conn, ask)
        length = ask.at + ask.rows
        cache = self.span.allocate_cache(ask.start, ask.end, length)
        hidden = torch.empty(ask.rows, self.span.config.hidden)
        job = Job(conn, ask, cache, hidden, have=[0] * (ask.end - ask.start))
        self._jobs[conn] = job
        await conn.send(SpreadTaken(sid=ask.sid))
        self.spawn(self._serve, job)

    async def rows(self, conn, msg: SpreadRows) -> None:
        job = self._job(conn, msg.sid)
        try:
            if msg.row != job.rows_in:
                raise ProtocolError(f"spread rows from {msg.row}: expected {job.rows_in} next")
            width, left = self.span.config.hidden, job.ask.rows - job.rows_in
            h = unpack_tensor(msg.hidden, hidden=width, max_tokens=left)
        except SwarmError as exc:
            self._end(job, str(exc))
            raise
        job.hidden[job.rows_in : job.rows_in + h.shape[1]] = h[0]
        job.rows_in += h.shape[1]
        if job.rows_in == job.ask.rows:
            job.inputs.set()

    async def kv(self, conn, msg: SpreadKv) -> None:
        job = self._job(conn, msg.sid)
        with job.ready:
            try:
                have = job.have[msg.layer] if 0 <= msg.layer < len(job.have) else 0
                job.have[msg.layer] = take_kv(job.cache, msg, have, job.ask.at)
            except SwarmError as exc:
                self._end(job, str(exc))
                raise
            job.ready.notify_all()

    def _check(self, conn, ask: SpreadOpen) -> None:
        span, length = self.span, ask.at + ask.rows
        if conn in self._jobs:
            raise SpreadRefused("a spread runs on this connection already: one at a time")
        if len(self._jobs) >= MAX_SPREADS:
            raise SpreadRefused(f"this node computes {MAX_SPREADS} spread passes at once")
        if ask.fingerprint != self.fingerprint:
            raise SpreadRefused(
                f"this node serves weights {self.fingerprint}, the spread's are {ask.fingerprint}"
            )
        if not span.start <= ask.start < ask.end <= span.end:
            raise SpreadRefused(
                f"a spread of blocks {ask.start}:{ask.end}, this node serves"
                f" {span.start}:{span.end}"
            )
        if not spreadable(span.config, ask.start, ask.end, length):
            raise SpreadRefused(f"blocks {ask.start}:{ask.end} of this model do not split rows")
        room = min(self.sessions.limits.max_session_tokens, self.sessions.free_cache_tokens)
        if length > room:
            raise SpreadRefused(
                f"a spread pass to position {length}; this node has room for {room}"
            )

    def _job(self, conn, sid: str) -> Job:
        job = self._jobs.get(conn)
        if job is None or job.ask.sid != sid:
            raise ProtocolError(f"no spread of session {sid[:8]}... on this connection")
        return job

    def _end(self, job: Job, why: str) -> None:
        if self._jobs.get(job.conn) is job:
            del self._jobs[job.conn]
        self._stop(job, why)

    @staticmethod
    def _stop(job: Job, why: str) -> None:
        with job.ready:
            job.failed = job.failed or why
            job.ready.notify_all()
        job.inputs.set()

    async def _serve(self, job: Job) -> None:
        """Wait for the input rows, compute in the prompt lane, send what it gives meanwhile."""
        ask = job.ask
        out, frames = trio.open_memory_channel(math.inf)
        token = trio.lowlevel.current_trio_token()

        def emit(batch: list) -> None:  # from the lane's thread
            if not job.failed:
                trio.from_thread.run_sync(out.send_nowait, batch, trio_token=token)

        try:
            with trio.move_on_after(REPLY_S):
                await job.inputs.wait()
            if not job.inputs.is_set():
                raise PeerFailed(f"the spread's {ask.rows} input rows did not come in time")
            if job.failed:
                return  # its owner was told why
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_send, job, frames)
                fn = functools.partial(self._compute, job, emit)
                with out:
                    await self.compute.run(PREFILL, fn, ask.rows)
        except SwarmError as exc:
            if not job.failed:
                log.info("spread of session %s... failed here: %s", ask.sid[:8], exc)
                await send_quietly(job.conn, Error.of(exc, sid=ask.sid))
        except Exception:  # a bug costs this spread only (the owner computes its rows)
            log.exception("spread of session %s... failed on an internal error", ask.sid[:8])
            await send_quietly(job.conn, Error.of(SwarmError("internal error"), sid=ask.sid))
        finally:
            self._end(job, "done")

    def _compute(self, job: Job, emit) -> None:
        """In the lane's thread: the rows through every layer, each after the owner's keys
        and values of it are in; their own keys and values sent after each, outputs last."""
        ask = job.ask

        def wait(layer: int) -> None:
            with job.ready:
                job.ready.wait_for(lambda: job.failed or job.have[layer] >= ask.at, REPLY_S)
            if job.failed:
                raise PeerFailed(job.failed)
            if job.have[layer] < ask.at:
                raise PeerFailed(f"layer {layer}'s keys did not come within {REPLY_S:g} s")

        def sent(layer: int) -> None:
            emit(kv_frames(ask.sid, job.cache, layer, ask.at, ask.at + ask.rows))

        x = through(self.span, job.cache, ask.start, ask.end, ask.at, job.hidden, wait, sent)
        emit(rows_frames(ask.sid, x))


async def _send(job: Job, frames) -> None:
    try:
        async for batch in frames:
            for frame in batch:
                if job.failed:
                    return
                await job.conn.send(frame)
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        SpreadReplica._stop(job, f"the owner's connection broke: {exc}")
