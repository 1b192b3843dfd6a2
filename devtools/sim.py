"""Virtual-time harness: one node's uplink driven by the very same LinkScheduler as production.

The link carries one send at a time at `bandwidth` bytes/s; a byte reaches the next node
`latency` seconds after it left. A decode session is a closed loop: its step arrives, computes
for `compute_s`, its volume queues on the link, and the next step arrives `ring_s` after that
volume reached the next node (ring_s is the rest of the pipeline and the client), so delaying a
decode volume here slows its session, as it would in a swarm. Prefill volumes appear at given
times. Events at the same instant are all applied before the link picks its next send.

With `acks`, the simulation is also the driver that tells the scheduler what is unacknowledged,
as the node's uplink does: a send is in flight from its first byte until a round trip after its
last (the next hop reads it, its acknowledgement comes back), so the in-flight cap works on it.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from swarm.link.queues import Send, Volume
from swarm.link.scheduler import LinkScheduler
from swarm.protocol import DECODE, PREFILL


@dataclass(frozen=True)
class SimLink:
    bandwidth: float  # bytes per second
    latency: float = 0.0  # one-way, seconds
    believed_bandwidth: float | None = None  # what the scheduler is told, if not the truth
    acks: bool = False  # tell the scheduler what is unacknowledged (its in-flight cap)


@dataclass(frozen=True)
class DecodeStream:
    session: str
    start: float  # first step arrives here
    steps: int
    compute_s: float  # this node's decode step time, T_d
    ring_s: float  # from reaching the next node until the next step arrives here
    bytes_per_token: int
    dest: str = "next"


@dataclass(frozen=True)
class PrefillArrival:
    session: str
    at: float  # when its volume is queued (this node's compute is done)
    tokens: int
    bytes_per_token: int
    dest: str = "next"
    phase_left: int = 0  # the prompt's tokens from this volume on, if more follow (Volume's)


@dataclass
class VolumeTrace:
    vid: int
    session: str
    phase: str
    tokens: int
    enqueued: float
    first_start: float | None = None
    finished: float | None = None  # last byte left this node
    sends: int = 0

    @property
    def send_delay(self) -> float:
        """Queueing before the first byte went out."""
        if self.first_start is None:
            raise ValueError(f"volume {self.vid} was never sent")
        return self.first_start - self.enqueued


@dataclass
class SimResult:
    link: SimLink
    volumes: list[VolumeTrace]
    sends: list[tuple[float, float, Send]] = field(default_factory=list)  # (start, end, send)
    end: float = 0.0

    def of_phase(self, phase: str) -> list[VolumeTrace]:
        return [v for v in self.volumes if v.phase == phase]

    def decode_delays(self) -> list[float]:
        return [v.send_delay for v in self.of_phase(DECODE) if v.first_start is not None]

    def prefill_completion(self) -> float:
        """Time from the first prefill queued to the last prefill byte reaching the next node."""
        prefills = self.of_phase(PREFILL)
        finished = [v.finished for v in prefills if v.finished is not None]
        if not prefills or len(finished) < len(prefills):
            raise ValueError("the run has no prefill, or one it did not finish")
        return max(finished) + self.link.latency - min(v.enqueued for v in prefills)


def simulate(
    scheduler: LinkScheduler,
    link: SimLink,
    decodes: Iterable[DecodeStream] = (),
    prefills: Iterable[PrefillArrival] = (),
    until: float = math.inf,
) -> SimResult:
    """Run until every volume has been sent (or `until`); the scheduler is used as given."""
    return _Simulation(scheduler, link).run(list(decodes), list(prefills), until)


class _Simulation:
    """One run: a heap of timed events, and at most one send on the link at a time."""

    def __init__(self, scheduler: LinkScheduler, link: SimLink):
        self.scheduler = scheduler
        self.link = link
        self.result = SimResult(link, [])
        self._seq = itertools.count()
        self._events: list[tuple[float, int, Callable[[float], None]]] = []
        self._traces: dict[int, VolumeTrace] = {}
        self._steps: dict[int, tuple[DecodeStream, int]] = {}  # decode vid -> stream, step number
        self._wire: list[tuple[float, int, Send]] = []  # at most one (start, number, send)
        self._sends = itertools.count()
        self._unacked: dict[int, Send] = {}  # with `acks`: sends not yet acknowledged, by number

    def run(
        self, decodes: list[DecodeStream], prefills: list[PrefillArrival], until: float
    ) -> SimResult:
        told = self.link.believed_bandwidth or self.link.bandwidth
        for dest in sorted({d.dest for d in decodes} | {p.dest for p in prefills}):
            self.scheduler.update_link(dest, rtt=2 * self.link.latency, bandwidth=told, now=0.0)
        for d in decodes:
            if d.steps > 0:
                self._at(d.start, self._arrive(d, 1))
        for p in prefills:
            self._at(p.at, self._prefill(p))
        now = 0.0
        events = self._events
        while events and events[0][0] <= until:
            now = events[0][0]
            while events and events[0][0] == now:
                heapq.heappop(events)[2](now)
            if not self._wire:
                self._next_send(now)
        self.result.volumes = sorted(self._traces.values(), key=lambda v: v.vid)
        self.result.end = now
        return self.result

    def _at(self, time: float, event: Callable[[float], None]) -> None:
        heapq.heappush(self._events, (time, next(self._seq), event))

    def _queue(self, volume: Volume, now: float) -> int:
        vid = self.scheduler.enqueue(volume, now)
        self._traces[vid] = VolumeTrace(vid, volume.session, volume.phase, volume.tokens, now)
        return vid

    def _arrive(self, stream: DecodeStream, step: int) -> Callable[[float], None]:
        def event(now: float) -> None:
            self.scheduler.observe_decode_arrival(stream.session, now)
            self._at(now + stream.compute_s, self._computed(stream, step))

        return event

    def _computed(self, stream: DecodeStream, step: int) -> Callable[[float], None]:
        def event(now: float) -> None:
            self.scheduler.observe_compute(DECODE, 1, stream.compute_s)
            volume = Volume(stream.session, stream.dest, DECODE, 1, stream.bytes_per_token)
            self._steps[self._queue(volume, now)] = (stream, step)

        return event

    def _prefill(self, p: PrefillArrival) -> Callable[[float], None]:
        volume = Volume(p.session, p.dest, PREFILL, p.tokens, p.bytes_per_token, p.phase_left)
        return lambda now: self._queue(volume, now)

    def _next_send(self, now: float) -> None:
        send = self.scheduler.next_send(now)
        if send is not None:
            trace = self._traces[send.vid]
            if trace.first_start is None:
                trace.first_start = now
            trace.sends += 1
            number = next(self._sends)
            self._wire.append((now, number, send))
            self._at(now + send.nbytes / self.link.bandwidth, self._free)
            if self.link.acks:
                self._unacked[number] = send
                self._tell_in_flight(send.dest, now)
        elif self.scheduler.hold_until is not None:  # pacing: look again when it says
            self._at(max(self.scheduler.hold_until, now + 1e-6), lambda now: None)

    def _tell_in_flight(self, dest: str, now: float) -> None:
        sends = [s for s in self._unacked.values() if s.dest == dest]
        prompts = [s.nbytes for s in sends if s.phase == PREFILL]
        self.scheduler.update_link(
            dest,
            now=now,
            in_flight=sum(s.nbytes for s in sends),
            prefill_in_flight=sum(prompts),
            prefill_frames=len(prompts),
        )

    def _acked(self, number: int, dest: str, mark: int) -> Callable[[float], None]:
        def event(now: float) -> None:
            del self._unacked[number]
            self._tell_in_flight(dest, now)
            self.scheduler.acked(dest, mark, now)

        return event

    def _free(self, now: float) -> None:
        start, number, send = self._wire.pop()
        self.scheduler.sent(send, start, now)
        self.result.sends.append((start, now, send))
        if self.link.acks:
            mark = self.scheduler.bytes_sent_to(send.dest)
            self._at(now + 2 * self.link.latency, self._acked(number, send.dest, mark))
        if not send.last:
            return
        self._traces[send.vid].finished = now
        if send.vid in self._steps:
            stream, step = self._steps[send.vid]
            if step < stream.steps:
                self._at(now + self.link.latency + stream.ring_s, self._arrive(stream, step + 1))
