"""Sans-IO outbound link scheduler: what goes next on a node's uplink, and how many tokens of it.

Policy "molink" is MoLink's Algorithm 1 (seeds/DIGEST.md, section 000). Decode volumes queue in
one FIFO, prefill volumes in another; a waiting weight W counts decisions at which both held
work. While W < max_wait a decode volume goes whole; otherwise a prefill volume goes, whole if
W >= max_wait (so prefill cannot starve), else as a chunk sized just in time, and W resets.

A chunk is as many tokens as the link carries (at `margin` of its estimated bandwidth) in T_a,
the time until the next decode volume is ready here, predicted per active decode session:
- case 1/2, a decode step has arrived and is computing since t_s: T_a = t_s + T_d - t_c;
- case 3, none is computing: the step comes back around the pipeline ring, one period after the
  last one. MoLink models that ring (T_o + T_m) from per-server profiles; a node here knows only
  its own, so it measures the ring instead: the period is the minimum of the session's recent
  arrival intervals. The minimum, because an interval stretched by our own prefill chunks would
  otherwise predict a longer gap, allow a bigger chunk, and stretch the next interval further.
  The step also cannot return sooner than half an RTT after its last decode left on this link.
T_d is this node's decode step time (EWMA of `observe_compute`), t_c is now. The smallest T_a over
sessions wins. With no decode session active a prefill goes whole: there is nothing to protect.

Bytes already sent are not yet on the wire: a home router's buffer (and, here, the relay's) may
hold many of them, and a decode volume sent now waits behind them all. The driver reports the
bytes sent to each connection and not yet acknowledged by the next hop (`in_flight`). About
bandwidth x min RTT of those are simply on their way; the rest is a backlog of
(in_flight / bandwidth - min_rtt) seconds, which comes off T_a. And while the prompt bytes
among them (`prefill_in_flight`) exceed `inflight_gain` x bandwidth x min RTT and they are at
least `inflight_floor_chunks` chunks (`prefill_frames`), no prefill chunk goes to that
connection: the prefill waits here, where the next decode volume can still pass it, instead of
in a buffer where it cannot. (BBR caps its own flight at 2 x BDP for the same reason.) Decode
frames do not count: they are what the cap protects. Without a bandwidth or RTT estimate there
is no cap. This object's default is gain 0 (no cap); a node asks for gain 2
(`--link-inflight-gain`), which needs a bandwidth estimate that does not read low: the next
hop's arrival spreads give it one.

Acknowledgements are coarse, though: a frame is acknowledged a round trip after its last byte,
so the cap must allow a few chunks to keep the link busy, and a decode volume waits behind them.
Pacing (`pace_lead_s`) keeps the bottleneck nearly empty instead: the scheduler counts what it
has sent to each connection and drains that at the estimated bandwidth, and the next chunk goes
only when less than `pace_lead_s` of it is left. The link stays busy, and a decode volume waits
at most one chunk and the lead. The chunk floor can then shrink with the link (`min_chunk_s`):
on a slow link a chunk of 8 tokens is itself a long wait for a decode volume behind it. The cap
stays as the safety net for a bandwidth estimate that reads high, with the floor's chunks on top
of it: under a cap of 2 x bandwidth x min RTT alone, chunks of a few tokens wait a round trip
for acknowledgements while the link idles.

Which waiting prefill goes next is not Algorithm 1's concern (it takes the head of one queue).
Here, by default, it is the one whose prompt needs the least link time left, less the time its
oldest unsent bytes have waited here (`prefill_order="shortest"`): shortest-remaining-first
lowers the mean time to first token when prompts overlap, and the credit for waiting means a
long prompt goes before any newcomer that needs less time than it has waited, so it cannot
starve. `prefill_order="arrival"` takes the oldest.

Policy "fifo" sends whole volumes in arrival order: what concurrent socket sends amount to.

Both keep each session's bytes in order: a volume is eligible only once every earlier volume of
its session has gone, so a decode step never overtakes its own session's prefill.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from swarm.link.estimator import ewma, percentile
from swarm.link.options import LinkOptions
from swarm.protocol import DECODE, PHASES, PREFILL

MAX_DRAINS = 4096  # sends per connection remembered for the acknowledgement lag


@dataclass(frozen=True)
class Volume:
    """An activation waiting to leave: enough to order it and cut it on token boundaries."""

    session: str
    dest: str
    phase: str
    tokens: int
    bytes_per_token: int
    phase_left: int = 0  # tokens from this volume's first to its phase's end; 0: just its own

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"volume phase must be one of {PHASES}, got {self.phase!r}")
        if self.tokens < 1 or self.bytes_per_token < 1:
            raise ValueError(
                f"volume needs tokens >= 1 and bytes_per_token >= 1, got {self.tokens} and"
                f" {self.bytes_per_token}"
            )
        if self.phase_left and self.phase_left < self.tokens:
            raise ValueError(
                f"volume's phase_left ({self.phase_left}) is less than its tokens ({self.tokens})"
            )

    @property
    def nbytes(self) -> int:
        return self.tokens * self.bytes_per_token


@dataclass(frozen=True)
class Send:
    """Tokens [offset, offset + tokens) of volume `vid`; `last` when that finishes the volume."""

    vid: int
    session: str
    dest: str
    phase: str
    offset: int
    tokens: int
    nbytes: int
    last: bool


@dataclass(frozen=True)
class Window:
    """T_a: how long the link is free before the next decode volume is ready to send."""

    t_a: float
    case: int  # MoLink's case: 1 starts now, 2 is computing, 3 is on its way around the ring
    session: str
    t_f: float  # when that decode volume is predicted ready


@dataclass
class _Queued:
    vid: int
    volume: Volume
    enqueued: float
    sent: int = 0  # tokens already handed out

    @property
    def left(self) -> int:
        return self.volume.tokens - self.sent

    @property
    def phase_left(self) -> int:
        """Tokens of its phase still to send, this volume's and the later ones'."""
        return max(self.volume.phase_left, self.volume.tokens) - self.sent


@dataclass
class _DecodeTrack:
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


@dataclass
class _Link:
    rtt: float | None = None
    min_rtt: float | None = None
    bandwidth: float | None = None
    in_flight: int = 0  # bytes sent and not yet acknowledged by the next hop
    prefill_in_flight: int | None = None  # of those, prompt bytes (None: not told; in_flight)
    prefill_frames: int | None = None  # prompt frames unacknowledged (None: not told)
    unsent: float = 0.0  # bytes sent that the link has not carried yet, by the bandwidth estimate
    unsent_at: float = 0.0  # when `unsent` was last brought up to date
    sent_total: int = 0  # bytes handed to the transport for this connection, ever
    bytes_per_token: int | None = None  # of the last prompt queued for this connection
    # (mark after a send, when the model has its last byte through the bottleneck), oldest first
    drains: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=MAX_DRAINS))

    def drained_at(self, bandwidth: float) -> float:
        """When the link, at `bandwidth`, has carried everything sent to it so far."""
        return self.unsent_at + self.unsent / bandwidth

    @property
    def base_rtt(self) -> float | None:
        """The propagation delay: the minimum RTT, or the smoothed one before there is any."""
        return self.min_rtt or self.rtt


class LinkScheduler:
    """One per node uplink. Feed it volumes and observations; ask it what to send next.

    Its policy and tuning come once, as LinkOptions (swarm/link/options.py says what each does).
    """

    def __init__(self, options: LinkOptions | None = None):
        self.options = options = options or LinkOptions()
        self._ids = itertools.count()
        self._queues: dict[str, list[_Queued]] = {DECODE: [], PREFILL: []}
        self._chains: dict[str, deque[int]] = {}  # session -> unfinished vids, oldest first
        self._tracks: dict[str, _DecodeTrack] = {}
        self._links: dict[str, _Link] = {}
        self._compute: dict[str, float] = {}  # phase -> EWMA seconds per step
        self._w = 0
        self.holding = False  # the last next_send held a prefill back (acknowledgements, pacing)
        self.hold_until: float | None = None  # ... and when pacing lets it go, if it knows
        self._last_window: Window | None = None
        self._decode_delays: deque[float] = deque(maxlen=options.delay_samples)
        self._pace_late: deque[float] = deque(maxlen=options.delay_samples)
        self._ack_lags: deque[float] = deque(maxlen=options.delay_samples)
        self._prefill_idle_s = 0.0
        self._counts = {
            "sends": 0,
            "chunks_sent": 0,
            "chunk_tokens_total": 0,
            "chunk_tokens_last": 0,
            "w_resets": 0,
            "prefill_whole_idle": 0,
            "prefill_held": 0,
            "prefill_paced": 0,
            "pace_corrections": 0,
            "bytes_sent_decode": 0,
            "bytes_sent_prefill": 0,
        }

    @property
    def waiting_weight(self) -> int:
        return self._w

    @property
    def queued(self) -> int:
        """Volumes not yet completely handed out."""
        return len(self._queues[DECODE]) + len(self._queues[PREFILL])

    def enqueue(self, volume: Volume, now: float) -> int:
        """Queue a volume; returns its id, which every Send cut from it carries."""
        vid = next(self._ids)
        self._queues[volume.phase].append(_Queued(vid, volume, now))
        self._chains.setdefault(volume.session, deque()).append(vid)
        if volume.phase == PREFILL:
            self._links.setdefault(volume.dest, _Link()).bytes_per_token = volume.bytes_per_token
        if volume.phase == DECODE:
            track = self._track(volume.session)
            if track.last_enqueue is not None and now > track.last_enqueue:
                track.enqueue_intervals.append(now - track.last_enqueue)
            track.last_enqueue = now
            track.computing = False
            track.dest = volume.dest
        return vid

    def next_send(self, now: float) -> Send | None:
        """Decide the next send on the uplink, or None if nothing may go now (`holding` tells
        whether something waits for acknowledgements)."""
        if self.hold_until is not None and now >= self.hold_until:
            self._pace_late.append(now - self.hold_until)  # how late the driver came back
        self.holding = False
        self.hold_until = None
        decode = self._first_eligible(DECODE)
        prefill = self._first_eligible(PREFILL)
        if self.options.policy == "fifo":
            pick = min((q for q in (decode, prefill) if q), key=lambda q: q.vid, default=None)
            return None if pick is None else self._hand_out(pick, pick.left, now)
        if decode and prefill:
            self._w += 1
        if decode and self._w < self.options.max_wait:
            return self._hand_out(decode, decode.left, now)
        if prefill is None:
            return None
        if self.options.prefill_order == "shortest":
            prefill = self._shortest_prefill(now)
        if decode:  # W reached N: the prefill has waited long enough
            tokens = prefill.left
            self._counts["w_resets"] += 1
        else:
            if self._must_hold(prefill, now):
                self.holding = True
                self._counts["prefill_held"] += 1
                return None
            wait = self._pace_wait(prefill.volume.dest, now)
            if wait > 0:
                self.holding = True
                self.hold_until = now + wait
                self._counts["prefill_paced"] += 1
                return None
            tokens = self._chunk_tokens(prefill, now)
        self._w = 0
        self._note_idle(prefill.volume.dest, now)
        return self._hand_out(prefill, tokens, now)

    def sent(
        self, send: Send, started: float, finished: float, wire_bytes: int | None = None
    ) -> None:
        """The driver finished writing `send` (started and finished on the same clock as now).

        `wire_bytes`: what the send put on the link, framing and any acknowledgement request
        included (default: the tensor's `send.nbytes`). The link model drains these: ~1.6% of
        framing left out of an 8-token chunk puts the model ~75 ms ahead of the link after
        5 s of prompt, and every acknowledgement would look that late."""
        self._counts["sends"] += 1
        self._counts[f"bytes_sent_{send.phase}"] += send.nbytes
        nbytes = send.nbytes if wire_bytes is None else wire_bytes
        link = self._links.setdefault(send.dest, _Link())
        link.sent_total += nbytes
        bandwidth = self._bandwidth(send.dest)
        if bandwidth is not None:
            link.unsent = self._unsent(link, bandwidth, started) + nbytes
            link.unsent_at = max(started, link.unsent_at)
            link.drains.append((link.sent_total, link.drained_at(bandwidth)))
        if send.phase == DECODE and send.last and send.session in self._tracks:
            self._tracks[send.session].last_sent = finished

    def bytes_sent_to(self, dest: str) -> int:
        """Bytes of all sends to `dest` reported through `sent`: a mark for `acked`."""
        link = self._links.get(dest)
        return link.sent_total if link is not None else 0

    def acked(self, dest: str, through: int, now: float) -> None:
        """The next hop on `dest` has read the sends up to the mark `through` (bytes_sent_to).

        The last of those left the bottleneck about a min RTT ago, so what was sent after them
        has had at most that long (and ack_slack_s) to drain. When pacing, that bounds what the
        link still holds from below: an estimate reading high makes the model drain too fast, and
        this catches it up.

        Whether pacing or not, it also counts the acknowledgement's lag: how much later than
        the model's drain time of the acknowledged send plus the min RTT it came (the next hop
        reading late, the way back queueing; `ack_lag_p50_s`). An in-flight cap must cover
        it to keep the link busy."""
        link = self._links.get(dest)
        if link is None:
            return
        while link.drains and link.drains[0][0] < through:
            link.drains.popleft()
        if link.drains and link.drains[0][0] == through:
            drained = link.drains.popleft()[1]
            self._ack_lags.append(max(0.0, now - drained - (link.base_rtt or 0.0)))
        bandwidth = self._bandwidth(dest)
        if bandwidth is None or not self.pacing(dest):
            return
        window = (link.base_rtt or 0.0) + self.options.ack_slack_s
        behind = link.sent_total - through - bandwidth * window
        if behind > self._unsent(link, bandwidth, now):
            link.unsent, link.unsent_at = behind, now
            self._counts["pace_corrections"] += 1

    def observe_decode_arrival(self, session: str, now: float) -> None:
        """A decode step for `session` arrived at this node and will be computed."""
        track = self._track(session)
        if track.last_arrival is not None and now > track.last_arrival:
            track.intervals.append(now - track.last_arrival)
        track.last_arrival = now
        track.computing = True

    def observe_compute(self, phase: str, tokens: int, seconds: float) -> None:
        """This node's compute time for one step of `phase` (T_d for decode)."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self._compute[phase] = ewma(self._compute.get(phase), seconds, self.options.compute_gain)

    def update_link(
        self,
        dest: str,
        rtt: float | None = None,
        bandwidth: float | None = None,
        now: float | None = None,
        forget_bandwidth: bool = False,
        min_rtt: float | None = None,
        in_flight: int | None = None,
        prefill_in_flight: int | None = None,
        prefill_frames: int | None = None,
    ) -> None:
        """Latest estimates for the connection to `dest` (bandwidth in bytes per second).

        `in_flight`: bytes sent and not yet acknowledged; `prefill_in_flight`: the prompt bytes
        among them, which the in-flight cap counts (a driver that does not tell: all of them);
        `prefill_frames`: how many prompt chunks those are, which its floor counts (a driver
        that does not tell: the floor is floor-sized chunks' bytes).
        None leaves a figure as it was; `forget_bandwidth` drops an estimate found to be wrong.
        """
        link = self._links.setdefault(dest, _Link())
        if rtt is not None and rtt > 0:
            link.rtt = rtt
        if min_rtt is not None and min_rtt > 0:
            link.min_rtt = min_rtt
        if in_flight is not None:
            link.in_flight = max(0, int(in_flight))
        if prefill_in_flight is not None:
            link.prefill_in_flight = max(0, int(prefill_in_flight))
        if prefill_frames is not None:
            link.prefill_frames = max(0, int(prefill_frames))
        if forget_bandwidth:
            link.bandwidth = None
        if bandwidth is not None and bandwidth > 0:
            link.bandwidth = bandwidth

    def end_session(self, session: str) -> int:
        """Forget a session: drop its queued volumes (returns how many) and its decode history."""
        dropped = 0
        for phase, queue in self._queues.items():
            kept = [q for q in queue if q.volume.session != session]
            dropped += len(queue) - len(kept)
            self._queues[phase] = kept
        self._chains.pop(session, None)
        self._tracks.pop(session, None)
        return dropped

    def available_time(self, now: float) -> Window | None:
        """T_a until the soonest predicted decode volume, or None if no decode session is active."""
        decode_s = self._compute.get(DECODE, 0.0)
        queued_decode = {q.volume.session for q in self._queues[DECODE]}
        best: Window | None = None
        for session, track in list(self._tracks.items()):
            if session in queued_decode:
                continue
            if not self._active(track, now):
                # it may resume; then it relearns its period, predicting conservatively meanwhile
                del self._tracks[session]
                continue
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
                rtt = self._links.get(track.dest or "", _Link()).rtt
                if rtt is not None and track.last_sent is not None:
                    t_f = max(t_f, track.last_sent + rtt / 2 + decode_s)
                case = 3 if t_f > now + decode_s else 1
            window = Window(t_a=t_f - now, case=case, session=session, t_f=t_f)
            if best is None or window.t_a < best.t_a:
                best = window
        return best

    def chunk_tokens(self, volume: Volume, left: int, now: float) -> int:
        """How many of the `left` tokens of a prefill `volume` to send now (molink, W < N)."""
        window = self.available_time(now)
        self._last_window = window
        if window is None:
            return left
        bandwidth = self._bandwidth(volume.dest)
        tokens = 0
        t_a = window.t_a - self.backlog(volume.dest, now)
        if bandwidth is not None and t_a > 0:
            tokens = _whole_tokens(self.options.margin * bandwidth * t_a, volume.bytes_per_token)
        return min(left, max(self.floor_tokens(volume), tokens))

    def floor_tokens(self, volume: Volume) -> int:
        """The smallest chunk of `volume`: min_chunk_tokens, or the tokens its link carries in
        min_chunk_s if fewer (at least 1)."""
        bandwidth = self._bandwidth(volume.dest)
        if self.options.min_chunk_s == 0 or bandwidth is None:
            return self.options.min_chunk_tokens
        fit = _whole_tokens(bandwidth * self.options.min_chunk_s, volume.bytes_per_token)
        return max(1, min(self.options.min_chunk_tokens, fit))

    def backlog(self, dest: str, now: float | None = None) -> float:
        """Seconds of sent bytes queued ahead of a send to `dest` now (0 if unknown).

        When pacing (and given `now`): what this node sent that the link has not carried yet, at
        the estimated bandwidth. Otherwise from acknowledgements: what is unacknowledged beyond
        bandwidth x min RTT. That reads high by up to a frame, as a frame is acknowledged only
        once all of it has arrived: fine for sizing a chunk, but pacing on it would leave the
        link idle for a round trip after every chunk."""
        link = self._links.get(dest)
        bandwidth = self._bandwidth(dest)
        if link is None or bandwidth is None:
            return 0.0
        if now is not None and self.pacing(dest):
            return self._unsent(link, bandwidth, now) / bandwidth
        return max(0.0, link.in_flight / bandwidth - (link.base_rtt or 0.0))

    def _unsent(self, link: _Link, bandwidth: float, now: float) -> float:
        return max(0.0, link.unsent - bandwidth * max(0.0, now - link.unsent_at))

    def _pace_wait(self, dest: str, now: float) -> float:
        """Seconds a prefill chunk to `dest` should wait for the link to carry what it has."""
        if (
            not self.pacing(dest)
            or self.options.pace_lead_s is None
            or self.available_time(now) is None
        ):
            return 0.0  # not pacing, or no decode session to protect
        return self.backlog(dest, now) - self.options.pace_lead_s

    def pacing(self, dest: str) -> bool:
        """Whether prefill chunks to `dest` are paced: pacing is on (pace_lead_s), and the link is
        slow enough for it (pace_slow_s), by its bandwidth estimate now."""
        if self.options.pace_lead_s is None:
            return False
        if self.options.pace_slow_s == 0:
            return True
        link = self._links.get(dest)
        bandwidth = self._bandwidth(dest)
        if link is None or bandwidth is None or link.bytes_per_token is None:
            return False
        return (
            self.options.min_chunk_tokens * link.bytes_per_token
            >= self.options.pace_slow_s * bandwidth
        )

    def _note_idle(self, dest: str, now: float) -> None:
        """A prefill goes to `dest` now: add how long the link, by the bandwidth estimate, had
        carried everything sent to it while a prefill waited here (time a prompt lost to the
        cap, to pacing, or to a driver slow to come back)."""
        link = self._links.get(dest)
        bandwidth = self._bandwidth(dest)
        if link is None or bandwidth is None or link.sent_total == 0:
            return
        drained = link.drained_at(bandwidth)
        waiting_since = self._queues[PREFILL][0].enqueued  # the oldest prefill here
        self._prefill_idle_s += max(0.0, now - max(drained, waiting_since))

    def _must_hold(self, prefill: _Queued, now: float) -> bool:
        """Whether the connection already holds enough unacknowledged prompt bytes to wait for
        some. Decode frames do not count: they are what the cap protects, and counting them
        would leave a small floor room for one chunk beside them, the link idle while its
        acknowledgement comes back."""
        dest = prefill.volume.dest
        link = self._links.get(dest)
        bandwidth = self._bandwidth(dest)
        if self.options.inflight_gain == 0 or link is None or bandwidth is None:
            return False
        held = link.in_flight if link.prefill_in_flight is None else link.prefill_in_flight
        rtt = link.base_rtt
        if not held or rtt is None:
            return False
        if self.available_time(now) is None:
            return False  # no decode session to protect
        chunk = self.floor_tokens(prefill.volume) * prefill.volume.bytes_per_token
        cap = self.options.inflight_gain * bandwidth * rtt
        if self.pacing(dest):
            # pacing keeps the bottleneck short itself; the cap only catches an estimate reading
            # high, so the floor's chunks come on top of it: small paced chunks under the cap
            # alone wait a round trip for acknowledgements while the link idles
            return held + chunk > cap + self.options.inflight_floor_chunks * chunk
        if link.prefill_frames is not None:
            # the floor in chunks, whatever their size: chunks the free time makes a little
            # bigger than the smallest would otherwise fill a floor counted in bytes alone
            return link.prefill_frames >= self.options.inflight_floor_chunks and held + chunk > cap
        return held + chunk > max(cap, self.options.inflight_floor_chunks * chunk)

    def stats(self) -> dict[str, float]:
        """Flat numeric counters and gauges for logs and the health page."""
        c = self._counts
        delays = sorted(self._decode_delays)
        late = sorted(self._pace_late)
        lags = sorted(self._ack_lags)
        bandwidths = [lk.bandwidth for lk in self._links.values() if lk.bandwidth is not None]
        rtts = [lk.rtt for lk in self._links.values() if lk.rtt is not None]
        min_rtts = [lk.min_rtt for lk in self._links.values() if lk.min_rtt is not None]
        window = self._last_window
        out: dict[str, float] = {
            "waiting_weight": float(self._w),
            "sends": float(c["sends"]),
            "chunks_sent": float(c["chunks_sent"]),
            "chunk_tokens_mean": c["chunk_tokens_total"] / c["chunks_sent"]
            if c["chunks_sent"]
            else 0.0,
            "chunk_tokens_last": float(c["chunk_tokens_last"]),
            "w_resets": float(c["w_resets"]),
            "prefill_whole_idle": float(c["prefill_whole_idle"]),
            "prefill_held": float(c["prefill_held"]),
            "prefill_paced": float(c["prefill_paced"]),
            "pace_corrections": float(c["pace_corrections"]),
            "paced_links": float(sum(self.pacing(dest) for dest in self._links)),
            "pace_late_p50_s": percentile(late, 0.50),
            "pace_late_p99_s": percentile(late, 0.99),
            "ack_lag_p50_s": percentile(lags, 0.50),
            "ack_lag_p99_s": percentile(lags, 0.99),
            "prefill_idle_s": self._prefill_idle_s,
            "in_flight_bytes": float(sum(lk.in_flight for lk in self._links.values())),
            "bytes_sent_decode": float(c["bytes_sent_decode"]),
            "bytes_sent_prefill": float(c["bytes_sent_prefill"]),
            "decode_delay_p50_s": percentile(delays, 0.50),
            "decode_delay_p99_s": percentile(delays, 0.99),
            "decode_delay_max_s": delays[-1] if delays else 0.0,
            "bandwidth_Bps": min(bandwidths) if bandwidths else 0.0,
            "rtt_s": max(rtts) if rtts else 0.0,
            "min_rtt_s": max(min_rtts) if min_rtts else 0.0,
            "decode_compute_s": self._compute.get(DECODE, 0.0),
            "decode_sessions_tracked": float(len(self._tracks)),
            "last_t_a_s": window.t_a if window else 0.0,
            "last_t_a_case": float(window.case) if window else 0.0,
        }
        for phase in PHASES:
            queue = self._queues[phase]
            out[f"{phase}_queued_volumes"] = float(len(queue))
            out[f"{phase}_queued_bytes"] = float(
                sum(q.left * q.volume.bytes_per_token for q in queue)
            )
        return out

    def _track(self, session: str) -> _DecodeTrack:
        track = self._tracks.get(session)
        if track is None:
            n = self.options.period_samples
            track = self._tracks[session] = _DecodeTrack(deque(maxlen=n), deque(maxlen=n))
        return track

    def _active(self, track: _DecodeTrack, now: float) -> bool:
        seen = [t for t in (track.last_arrival, track.last_enqueue) if t is not None]
        if not seen:
            return False
        period = track.period or track.enqueue_period or 0.0
        return now - max(seen) <= max(self.options.session_idle_s, 4 * period)

    def _eligible(self, phase: str) -> Iterator[_Queued]:
        """Queued volumes of `phase` whose session has nothing older left to send, oldest first."""
        return (q for q in self._queues[phase] if self._chains[q.volume.session][0] == q.vid)

    def _first_eligible(self, phase: str) -> _Queued | None:
        return next(self._eligible(phase), None)

    def _shortest_prefill(self, now: float) -> _Queued | None:
        """The eligible prefill volume whose prompt would be done first: the fewest seconds of
        its phase left to send, less how long its oldest unsent bytes have waited here (so a
        long prompt cannot starve behind a stream of short ones); the earliest queued among
        equals. Without a bandwidth estimate, the fewest tokens left."""

        def key(q: _Queued) -> tuple[float, int]:
            bandwidth = self._bandwidth(q.volume.dest)
            if bandwidth is None:
                return float(q.phase_left), q.vid
            left_s = q.phase_left * q.volume.bytes_per_token / bandwidth
            return left_s - (now - q.enqueued), q.vid

        return min(self._eligible(PREFILL), key=key, default=None)

    def _chunk_tokens(self, prefill: _Queued, now: float) -> int:
        tokens = self.chunk_tokens(prefill.volume, prefill.left, now)
        if self._last_window is None:
            self._counts["prefill_whole_idle"] += 1
        else:
            self._counts["chunks_sent"] += 1
            self._counts["chunk_tokens_total"] += tokens
            self._counts["chunk_tokens_last"] = tokens
        return tokens

    def _bandwidth(self, dest: str) -> float | None:
        link = self._links.get(dest)
        if link is not None and link.bandwidth is not None:
            return link.bandwidth
        # connections of one uplink share its bottleneck: borrow the most cautious estimate
        known = [lk.bandwidth for lk in self._links.values() if lk.bandwidth is not None]
        return min(known) if known else None

    def _hand_out(self, q: _Queued, tokens: int, now: float) -> Send:
        v = q.volume
        if q.sent == 0 and v.phase == DECODE:
            self._decode_delays.append(now - q.enqueued)
        send = Send(
            vid=q.vid,
            session=v.session,
            dest=v.dest,
            phase=v.phase,
            offset=q.sent,
            tokens=tokens,
            nbytes=tokens * v.bytes_per_token,
            last=tokens == q.left,
        )
        q.sent += tokens
        if q.left == 0:
            self._queues[v.phase].remove(q)
            chain = self._chains[v.session]
            chain.popleft()
            if not chain:
                del self._chains[v.session]
        return send


def _whole_tokens(nbytes: float, bytes_per_token: int) -> int:
    """Whole tokens in `nbytes`; the epsilon keeps 24.0 from flooring to 23 after rounding."""
    return math.floor(nbytes / bytes_per_token + 1e-9)
