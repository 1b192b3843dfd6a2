"""Sans-IO outbound link scheduler: what goes next on a node's uplink, and how many tokens of it.

One per node uplink. The driver feeds it volumes (activations to send) and observations (decode
steps arriving, compute times, link estimates, acknowledgements), each with the time on its own
clock; it asks `next_send(now)` what goes next. No sockets, no clock reads: the node's uplink
drives it in production, and devtools/sim.py drives the very same object in virtual time.

Its parts, each in its own module:
- queues.py: the decode and prefill FIFOs, each session's bytes in order;
- policy.py: which volume goes next and how much of it (MoLink's Algorithm 1, or fifo), chosen
  once at start from LinkOptions (options.py);
- freetime.py: T_a, the time until the next decode volume is ready here;
- flight.py: the in-flight cap, pacing, and the chunk floor;
- links.py: each connection's estimates and the model of what it has not carried yet;
- stats.py: the counters, and the snapshot a node publishes.
"""

from __future__ import annotations

from swarm.link.flight import Flight
from swarm.link.freetime import FreeTime, Window
from swarm.link.links import Links
from swarm.link.options import LinkOptions
from swarm.link.policy import FifoPolicy, Go, Hold, MolinkPolicy, Policy
from swarm.link.queues import Queued, Queues, Send, Volume
from swarm.link.stats import LinkCounters, LinkStats
from swarm.protocol import DECODE, PHASES, PREFILL

__all__ = ["LinkOptions", "LinkScheduler", "LinkStats", "Send", "Volume", "Window"]


class LinkScheduler:
    """One per node uplink. Feed it volumes and observations; ask it what to send next.

    Its policy and tuning come once, as LinkOptions (swarm/link/options.py says what each does).
    """

    def __init__(self, options: LinkOptions | None = None):
        # the pacing mode folded into the figures the flight reads (swarm.link.options)
        self.options = options = (options or LinkOptions()).effective()
        self.counters = LinkCounters(options.delay_samples)
        self.holding = False  # the last next_send held a prefill back (acknowledgements, pacing)
        self.hold_until: float | None = None  # ... and when pacing lets it go, if it knows
        self._queues = Queues()
        self._links = Links()
        self._free = FreeTime(options.session_idle_s, options.period_samples, options.compute_gain)
        self._flight = Flight(options, self._links, self.available_time)
        self._policy: Policy
        if options.policy == "fifo":
            self._policy = FifoPolicy(self._queues)
        else:
            self._policy = MolinkPolicy(
                options, self._queues, self._links, self._flight, self.available_time, self.counters
            )

    @property
    def waiting_weight(self) -> int:
        return self._policy.waiting_weight

    @property
    def queued(self) -> int:
        """Volumes not yet completely handed out."""
        return len(self._queues)

    # --- what the driver tells it ------------------------------------------------------------

    def enqueue(self, volume: Volume, now: float) -> int:
        """Queue a volume; returns its id, which every Send cut from it carries."""
        queued = self._queues.add(volume, now)
        if volume.phase == PREFILL:
            self._links.at(volume.dest).bytes_per_token = volume.bytes_per_token
        if volume.phase == DECODE:
            self._free.on_enqueue(volume.session, volume.dest, now)
        return queued.vid

    def sent(
        self, send: Send, started: float, finished: float, wire_bytes: int | None = None
    ) -> None:
        """The driver finished writing `send` (started and finished on the same clock as now).

        `wire_bytes`: what the send put on the link, framing and any acknowledgement request
        included (default: the tensor's `send.nbytes`). The link model drains these: ~1.6% of
        framing left out of an 8-token chunk puts the model ~75 ms ahead of the link after
        5 s of prompt, and every acknowledgement would look that late."""
        self.counters.count_sent(send.phase, send.nbytes)
        self._links.on_sent(send.dest, send.nbytes if wire_bytes is None else wire_bytes, started)
        if send.phase == DECODE and send.last:
            self._free.on_sent(send.session, finished)

    def bytes_sent_to(self, dest: str) -> int:
        """Bytes of all sends to `dest` reported through `sent`: a mark for `acked`."""
        link = self._links.get(dest)
        return link.sent_total if link is not None else 0

    def acked(self, dest: str, through: int, now: float) -> None:
        """The next hop on `dest` has read the sends up to the mark `through` (bytes_sent_to).

        When pacing, that catches the model of what the link still holds up with it
        (Flight.catch_up). Whether pacing or not, it also counts the acknowledgement's lag: how
        much later than the model's drain time of the acknowledged send plus the min RTT it
        came (the next hop reading late, the way back queueing; `ack_lag_p50_s`). An in-flight
        cap must cover it to keep the link busy."""
        if self._links.get(dest) is None:
            return
        lag = self._links.ack_lag(dest, through, now)
        if lag is not None:
            self.counters.ack_lags.append(lag)
        if self._flight.catch_up(dest, through, now):
            self.counters.pace_corrections += 1

    def observe_decode_arrival(self, session: str, now: float) -> None:
        """A decode step for `session` arrived at this node and will be computed."""
        self._free.on_arrival(session, now)

    def observe_compute(self, phase: str, tokens: int, seconds: float) -> None:
        """This node's compute time for one step of `phase` (T_d for decode)."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        self._free.on_compute(phase, seconds)

    def update_link(self, dest: str, now: float | None = None, **figures) -> None:
        """Latest estimates for the connection to `dest`, the keywords of `Links.update`: rtt,
        min_rtt (seconds), bandwidth (bytes per second), in_flight, prefill_in_flight, ...

        `in_flight`: bytes sent and not yet acknowledged; `prefill_in_flight`: the prompt bytes
        among them, which the in-flight cap counts (a driver that does not tell: all of them);
        `prefill_frames`: how many prompt chunks those are, which its floor counts (a driver
        that does not tell: the floor is floor-sized chunks' bytes).
        None leaves a figure as it was; `forget_bandwidth` drops an estimate found to be wrong.
        """
        self._links.update(dest, **figures)  # `now`: events carry their time; figures need none

    def end_session(self, session: str) -> int:
        """Forget a session: drop its queued volumes (returns how many) and its decode history."""
        self._free.forget(session)
        return self._queues.drop_session(session)

    # --- what it answers ---------------------------------------------------------------------

    def next_send(self, now: float) -> Send | None:
        """Decide the next send on the uplink, or None if nothing may go now (`holding` tells
        whether something waits for acknowledgements)."""
        if self.hold_until is not None and now >= self.hold_until:
            self.counters.pace_late.append(now - self.hold_until)  # the driver came back late
        self.holding = False
        self.hold_until = None
        decision = self._policy.decide(now)
        if isinstance(decision, Hold):
            self.holding = True
            self.hold_until = decision.until
            return None
        if isinstance(decision, Go):
            return self._hand_out(decision.item, decision.tokens, now)
        return None

    def available_time(self, now: float) -> Window | None:
        """T_a until the soonest predicted decode volume, or None if no decode session is active."""
        queued = {q.volume.session for q in self._queues.waiting(DECODE)}
        return self._free.window(now, queued, self._links.rtt)

    def floor_tokens(self, volume: Volume) -> int:
        """The smallest chunk of `volume` (Flight.floor_tokens)."""
        return self._flight.floor_tokens(volume)

    def backlog(self, dest: str, now: float | None = None) -> float:
        """Seconds of sent bytes queued ahead of a send to `dest` now (Flight.backlog)."""
        return self._flight.backlog(dest, now)

    def pacing(self, dest: str) -> bool:
        """Whether prefill chunks to `dest` are paced (Flight.pacing)."""
        return self._flight.pacing(dest)

    def snapshot(self) -> LinkStats:
        """The counters and gauges now, typed."""
        links = list(self._links.values())
        bandwidths = [lk.bandwidth for lk in links if lk.bandwidth is not None]
        rtts = [lk.rtt for lk in links if lk.rtt is not None]
        min_rtts = [lk.min_rtt for lk in links if lk.min_rtt is not None]
        window = self._policy.last_window
        queued: dict[str, float] = {}
        for phase in PHASES:
            fifo = self._queues.waiting(phase)
            queued[f"{phase}_queued_volumes"] = float(len(fifo))
            queued[f"{phase}_queued_bytes"] = float(sum(q.left_bytes for q in fifo))
        return LinkStats.from_counters(
            self.counters,
            waiting_weight=float(self._policy.waiting_weight),
            paced_links=float(sum(self.pacing(dest) for dest in self._links)),
            in_flight_bytes=float(sum(lk.in_flight for lk in links)),
            bandwidth_Bps=min(bandwidths) if bandwidths else 0.0,
            rtt_s=max(rtts) if rtts else 0.0,
            min_rtt_s=max(min_rtts) if min_rtts else 0.0,
            decode_compute_s=self._free.decode_s,
            decode_sessions_tracked=float(self._free.tracked),
            last_t_a_s=window.t_a if window else 0.0,
            last_t_a_case=float(window.case) if window else 0.0,
            **queued,
        )

    def stats(self) -> dict[str, float]:
        """Flat numeric counters and gauges for logs, the DHT record and the health page."""
        return self.snapshot().as_dict()

    def _hand_out(self, q: Queued, tokens: int, now: float) -> Send:
        if q.sent == 0 and q.volume.phase == DECODE:
            self.counters.decode_delays.append(now - q.enqueued)
        return self._queues.take(q, tokens)
