"""The node's outbound link: every byte sent downstream leaves through here.

Control frames (open, close, errors) are tiny and go first. Activations are queued as volumes in
the sans-IO LinkScheduler, which decides what goes next and how many tokens of it; this driver
slices the activation on those token boundaries, writes one send at a time, and feeds the
scheduler with the link measurements it takes along the way.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import torch
import trio

from swarm.protocol import Message, Result, Step, to_wire
from swarm.transport import FramedStream
from swarm.wire import encode_frame, pack_tensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Volume:
    """What the scheduler knows of a queued activation: enough to order and cut it."""

    session: str
    dest: str
    phase: str
    tokens: int
    bytes_per_token: int


@dataclass(frozen=True)
class Send:
    vid: int
    session: str
    dest: str
    phase: str
    offset: int  # first token of the volume this send carries
    tokens: int
    nbytes: int
    last: bool  # the volume is finished by this send


class FifoQueue:
    """Whole volumes in arrival order: what concurrent socket sends amount to."""

    def __init__(self, policy: str = "fifo"):
        self._queue: deque[tuple[int, Volume]] = deque()
        self._ids = itertools.count()

    def enqueue(self, volume: Volume, now: float) -> int:
        vid = next(self._ids)
        self._queue.append((vid, volume))
        return vid

    def next_send(self, now: float) -> Send | None:
        if not self._queue:
            return None
        vid, v = self._queue.popleft()
        return Send(
            vid, v.session, v.dest, v.phase, 0, v.tokens, v.tokens * v.bytes_per_token, True
        )

    def sent(self, send: Send, started: float, finished: float) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {"queued_volumes": float(len(self._queue))}


@dataclass
class Payload:
    stream: FramedStream
    dest: str
    sid: str
    phase: str
    pos: int
    end: int
    hidden: torch.Tensor  # [1, tokens, hidden] float32
    wire_dtype: str
    result: bool  # last hop: a Result for the client rather than a Step


class Uplink:
    def __init__(
        self,
        policy: str,
        on_broken: Callable[[FramedStream, Exception], Awaitable[None]],
        send_timeout: float = 60.0,
    ):
        self.scheduler = FifoQueue(policy)
        self._on_broken = on_broken
        self._send_timeout = send_timeout
        self._control: deque[tuple[FramedStream, bytes]] = deque()
        self._payloads: dict[int, Payload] = {}
        self._wake = trio.Event()
        self._clock0 = time.monotonic()
        self._ids = itertools.count()
        self.bytes_sent = 0

    def now(self) -> float:
        return time.monotonic() - self._clock0

    def send_control(self, stream: FramedStream, message: Message) -> None:
        self._control.append((stream, encode_frame(to_wire(message))))
        self._wake.set()

    def send_activations(self, payload: Payload) -> None:
        tokens = payload.hidden.shape[1]
        per_token = payload.hidden.shape[2] * (4 if payload.wire_dtype == "float32" else 2)
        vid = self.scheduler.enqueue(
            Volume(
                session=payload.sid,
                dest=payload.dest,
                phase=payload.phase,
                tokens=tokens,
                bytes_per_token=per_token,
            ),
            self.now(),
        )
        self._payloads[vid] = payload
        self._wake.set()

    def observe_decode_arrival(self, sid: str) -> None:
        pass

    def observe_compute(self, phase: str, tokens: int, seconds: float) -> None:
        pass

    def on_ping(self, dest: str, rtt: float) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return self.scheduler.stats()

    async def _write(self, stream: FramedStream, frame: bytes) -> bool:
        try:
            with trio.fail_after(self._send_timeout):
                await stream.send_raw(frame)
        except (
            trio.BrokenResourceError,
            trio.ClosedResourceError,
            trio.TooSlowError,
            OSError,
        ) as exc:
            await self._on_broken(stream, exc)
            return False
        self.bytes_sent += len(frame)
        return True

    async def run(self) -> None:
        while True:
            if self._control:
                stream, frame = self._control.popleft()
                if not stream.closed:
                    await self._write(stream, frame)
                continue
            send = self.scheduler.next_send(self.now())
            if send is None:
                self._wake = trio.Event()
                if not self._control:
                    await self._wake.wait()
                continue
            p = self._payloads[send.vid]
            if send.last:
                del self._payloads[send.vid]
            started = self.now()
            if not p.stream.closed:
                frame = self._frame(p, send.offset, send.tokens)
                await self._write(p.stream, frame)
                finished = self.now()
                self.scheduler.sent(send, started=started, finished=finished)
            else:
                self.scheduler.sent(send, started=started, finished=started)

    def _frame(self, p: Payload, offset: int, tokens: int) -> bytes:
        hidden = pack_tensor(p.hidden[:, offset : offset + tokens], p.wire_dtype)
        if p.result:
            msg: Message = Result(sid=p.sid, end=p.end, hidden=hidden)
        else:
            msg = Step(sid=p.sid, phase=p.phase, pos=p.pos + offset, end=p.end, hidden=hidden)
        return encode_frame(to_wire(msg))
