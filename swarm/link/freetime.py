"""T_a: how long the link is free before the next decode volume is ready here (MoLink).

Predicted per active decode session:
- case 1/2, a decode step has arrived and is computing since t_s: T_a = t_s + T_d - t_c;
- case 3, none is computing: the step comes back around the pipeline ring, one period after the
  last one. MoLink models that ring (T_o + T_m) from per-server profiles; a node here knows only
  its own, so it measures the ring instead: the period is the minimum of the session's recent
  arrival intervals. The minimum, because an interval stretched by our own prefill chunks would
  otherwise predict a longer gap, allow a bigger chunk, and stretch the next interval further.
  The step also cannot return sooner than half an RTT after its last decode left on this link.
T_d is this node's decode step time (EWMA of `on_compute`), t_c is now. The smallest T_a over
sessions wins. With no decode session active there is nothing to protect (None).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass

from swarm.link.estimator import ewma
from swarm.protocol import DECODE


@dataclass(frozen=True)
class Window:
    """T_a: how long the link is free before the next decode volume is ready to send."""

    t_a: float
    case: int  # MoLink's case: 1 starts now, 2 is computing, 3 is on its way around the ring
    session: str
    t_f: float  # when that decode volume is predicted ready


@dataclass
class DecodeTrack:
    """What this node saw of one session's decode steps, to predict the next one."""

    intervals: deque[float]
    enqueue_intervals: deque[float]
    last_arrival: float | None = None
    last_enqueue: float | None = None
    last_sent: float | None = None
    computing: bool = False  # arrived, its volume not yet queued
    dest: str | None = None

    @property
    def period(self) -> float | None:
        return min(self.intervals) if self.intervals else None

    @property
    def enqueue_period(self) -> float | None:
        return min(self.enqueue_intervals) if self.enqueue_intervals else None


class FreeTime:
    """Decode sessions' steps as this node sees them, and the T_a they leave the link."""

    def __init__(self, session_idle_s: float, period_samples: int, compute_gain: float):
        self._session_idle_s = session_idle_s
        self._period_samples = period_samples
        self._compute_gain = compute_gain
        self._tracks: dict[str, DecodeTrack] = {}
        self._step_s: dict[str, float] = {}  # phase -> EWMA seconds per step

    @property
    def decode_s(self) -> float:
        """T_d: this node's decode step time (0 before it has computed one)."""
        return self._step_s.get(DECODE, 0.0)

    @property
    def tracked(self) -> int:
        """Decode sessions followed right now."""
        return len(self._tracks)

    def on_compute(self, phase: str, seconds: float) -> None:
        self._step_s[phase] = ewma(self._step_s.get(phase), seconds, self._compute_gain)

    def on_arrival(self, session: str, now: float) -> None:
        """A decode step for `session` arrived at this node and will be computed."""
        track = self._track(session)
        if track.last_arrival is not None and now > track.last_arrival:
            track.intervals.append(now - track.last_arrival)
        track.last_arrival = now
        track.computing = True

    def on_enqueue(self, session: str, dest: str, now: float) -> None:
        """The decode volume of `session` is computed and queued for `dest`."""
        track = self._track(session)
        if track.last_enqueue is not None and now > track.last_enqueue:
            track.enqueue_intervals.append(now - track.last_enqueue)
        track.last_enqueue = now
        track.computing = False
        track.dest = dest

    def on_sent(self, session: str, finished: float) -> None:
        """The last of a decode volume of `session` left this node at `finished`."""
        if session in self._tracks:
            self._tracks[session].last_sent = finished

    def forget(self, session: str) -> None:
        self._tracks.pop(session, None)

    def window(
        self, now: float, queued: Container[str], rtt: Callable[[str], float | None]
    ) -> Window | None:
        """T_a until the soonest predicted decode volume, or None if no decode session is active.

        `queued`: sessions with a decode volume queued already (it is not T_a away: it is here);
        `rtt`: the smoothed round trip to a destination, if known."""
        best: Window | None = None
        for session, track in list(self._tracks.items()):
            if session in queued:
                continue
            if not self._active(track, now):
                # it may resume; then it relearns its period, predicting conservatively meanwhile
                del self._tracks[session]
                continue
            window = self._predict(session, track, now, rtt(track.dest or ""))
            if best is None or window.t_a < best.t_a:
                best = window
        return best

    def _predict(self, session: str, track: DecodeTrack, now: float, rtt: float | None) -> Window:
        decode_s = self.decode_s
        if track.computing and track.last_arrival is not None:
            t_s = track.last_arrival
            case = 1 if t_s == now else 2
            t_f = t_s + decode_s
        else:
            # the earliest the step can be back: now, one ring period after the last
            # arrival, half an RTT after its volume left
            t_f = now + decode_s
            if track.last_arrival is not None and track.period is not None:
                t_f = max(t_f, track.last_arrival + track.period + decode_s)
            elif track.last_enqueue is not None and track.enqueue_period is not None:
                t_f = max(t_f, track.last_enqueue + track.enqueue_period)
            if rtt is not None and track.last_sent is not None:
                t_f = max(t_f, track.last_sent + rtt / 2 + decode_s)
            case = 3 if t_f > now + decode_s else 1
        return Window(t_a=t_f - now, case=case, session=session, t_f=t_f)

    def _track(self, session: str) -> DecodeTrack:
        track = self._tracks.get(session)
        if track is None:
            n = self._period_samples
            track = self._tracks[session] = DecodeTrack(deque(maxlen=n), deque(maxlen=n))
        return track

    def _active(self, track: DecodeTrack, now: float) -> bool:
        seen = [t for t in (track.last_arrival, track.last_enqueue) if t is not None]
        if not seen:
            return False
        period = track.period or track.enqueue_period or 0.0
        return now - max(seen) <= max(self._session_idle_s, 4 * period)
