"""Sans-IO estimate of one outbound connection's bandwidth and round-trip time.

Bandwidth: the `quantile` (0.8) of the delivery-rate samples of the last `window_s` seconds.
Delivery rate reads low whenever the sender had nothing to send, so the truth is near the top of
the samples: that is why BBR keeps a windowed max (quantile 1.0 here). A max also keeps any
spike (ACK compression, a write that landed in a buffer) for a whole window, and an estimate
too high is the costly error for the scheduler: its chunks then overrun the gap before the next
decode step. The 0.8 quantile ignores spikes as long as they are under a fifth of the window's
samples, and low samples as long as they are under four fifths. It follows a faster link once a
fifth of the window's samples are new, and a slower one within `window_s` while samples flow.
Without samples the estimate holds: an idle link has not become slower.

Samples that carry no bandwidth information are refused at the door:
- TCP_INFO delivery rates flagged app-limited (the kernel says the sender ran dry);
- timed writes that are small, or that did not start right after a previous blocking write. With
  TCP_NOTSENT_LOWAT a write returns once its bytes are nearly out of the host, so a chain of
  back-to-back blocking writes drains at link rate; the first write after an idle spell fills
  the empty socket buffer and congestion window at memory speed and would read as a fast link.

Delivery acknowledgements: the driver follows each activation frame with a ping; the next hop
answers it once it has read the frame, so the pong says "delivered". Like TCP's own rate
estimate, a frame sent while at least a quarter of `min_delivery_bytes` was still
unacknowledged yields the bytes delivered since the last acknowledgement before it was sent
over the time since then. Frames sent into an (almost) empty pipe yield nothing: the interval
would include idle time and read low. This is the one measurement
that sees the whole path whatever sits in it.

Arrival spreads: the next hop times how each large frame came in (bytes after the first read of
it, over the time to its last byte) and tells the sender in the acknowledging pong. A frame is
written at once, so it crosses the narrowest link back to back whatever the sender did before:
unlike acknowledgements, this reads the link's rate even when the sender is mostly idle, which a
scheduler that sends small chunks between decode steps always is. While the window holds at least
`min_arrivals` of them, the estimate is their median alone. The receiver's own scheduling
delays move a spread's ends by a millisecond or so either way, hence the floors on its bytes
and duration.

TCP_INFO sees only the TCP connection, which ends at the first proxy: through a relay or a
split-TCP middlebox it reports the hop to the proxy (loopback-fast here). When the kernel's RTT
is under half the lowest application ping, TCP_INFO is taken to be blind to the path and its
samples are dropped, past and future.

RTT: an EWMA of kernel smoothed RTTs and application pings, plus a windowed minimum (the
propagation delay; the difference is queueing). A busy link queues every ping, and a prompt can
keep it busy longer than the window, so the minimum takes only samples that did not queue: pings
sent with nothing unacknowledged ahead of them (once there has been one), and the kernel's own
minimum RTT where TCP_INFO gives it. Without such a sample the minimum holds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from swarm.link.stats import percentile

TCP = "tcp"
APP = "app"  # timed writes and delivery acknowledgements
RX = "rx"  # arrival spreads measured by the next hop
BLIND_RTT_RATIO = 0.5  # kernel RTT under this share of the lowest ping: TCP_INFO is blind


@dataclass(frozen=True)
class SentFrame:
    """What the estimator needs, at acknowledgement time, about a frame when it was sent."""

    nbytes: int
    delivered: int  # bytes acknowledged before it was sent
    delivered_at: float | None  # when the last of those was acknowledged
    pipe_busy: bool  # earlier bytes were still unacknowledged


class LinkEstimator:
    """Bandwidth (bytes/s) and RTT (s) of one connection, from samples fed with their time."""

    def __init__(
        self,
        *,
        window_s: float = 1.0,
        quantile: float = 0.8,
        max_window_samples: int = 512,
        rtt_gain: float = 0.25,
        min_rtt_window_s: float = 10.0,
        min_delivery_bytes: int = 64 * 1024,
        min_delivery_s: float = 0.002,
        max_gap_s: float = 0.002,
        min_arrival_bytes: int = 4096,
        min_arrival_s: float = 0.001,
        min_arrivals: int = 3,
    ):
        if window_s <= 0 or not 0 < quantile <= 1:
            raise ValueError(f"need window_s > 0 and 0 < quantile <= 1, got {window_s}, {quantile}")
        self.window_s = window_s
        self.quantile = quantile
        self.rtt_gain = rtt_gain
        self.min_rtt_window_s = min_rtt_window_s
        self.min_delivery_bytes = min_delivery_bytes
        self.min_delivery_s = min_delivery_s
        self.max_gap_s = max_gap_s
        self.min_arrival_bytes = min_arrival_bytes
        self.min_arrival_s = min_arrival_s
        self.min_arrivals = min_arrivals
        self.rtt: float | None = None
        self.samples = 0  # accepted samples of either kind
        self.bandwidth_samples = 0
        self.rtt_samples = 0
        # (time, B/s, source)
        self._rates: deque[tuple[float, float, str]] = deque(maxlen=max_window_samples)
        self._bandwidth: float | None = None
        self._min_rtts: deque[tuple[float, float]] = deque()  # (time, rtt), increasing rtt
        self._last_write_end: float | None = None
        self._last_write_blocked = False
        self._delivered = 0
        self._delivered_at: float | None = None
        self._in_flight = 0
        self._min_ping: float | None = None
        self._clear_pinged = False  # a ping has gone with nothing unacknowledged ahead of it
        self._min_tcp_rtt: float | None = None
        self.tcp_blind = False
        self.ack_samples = 0
        self.arrival_samples = 0

    @property
    def bandwidth(self) -> float | None:
        """Bytes per second the link carries, or None before the first usable sample."""
        return self._bandwidth

    @property
    def in_flight(self) -> int:
        """Bytes of acknowledged-to-be frames sent and not yet acknowledged."""
        return self._in_flight

    @property
    def min_rtt(self) -> float | None:
        """Lowest RTT seen within `min_rtt_window_s` of the latest sample that did not queue."""
        return self._min_rtts[0][1] if self._min_rtts else None

    def on_tcp_info(
        self,
        rtt_s: float | None,
        delivery_rate_Bps: float | None,
        now: float,
        app_limited: bool = False,
        min_rtt_s: float | None = None,
    ) -> None:
        """A TCP_INFO reading: the kernel's smoothed RTT and latest per-ACK delivery rate, and
        its minimum RTT (over minutes of per-ACK samples) if it gives one."""
        if rtt_s is not None and rtt_s > 0:
            if self._min_tcp_rtt is None or rtt_s < self._min_tcp_rtt:
                self._min_tcp_rtt = rtt_s
            self._check_blind(now)
            if not self.tcp_blind:
                kernel_min = min_rtt_s is not None and min_rtt_s > 0
                self._add_rtt(rtt_s, now, to_min=not kernel_min)
                if kernel_min:
                    self._add_min_rtt(min_rtt_s, now)
        if self.tcp_blind:
            return
        if delivery_rate_Bps and delivery_rate_Bps > 0 and not app_limited:
            self._add_rate(float(delivery_rate_Bps), now, TCP)

    def on_ping(self, rtt_s: float, now: float, queued: bool = False) -> None:
        """An application-level round trip. `queued`: the ping went while bytes sent before it
        were unacknowledged, so it may have waited behind them; it then moves the smoothed RTT
        but not the minimum (unless no ping has gone clear yet)."""
        if rtt_s > 0:
            if self._min_ping is None or rtt_s < self._min_ping:
                self._min_ping = rtt_s
            self._check_blind(now)
            self._add_rtt(rtt_s, now, to_min=not (queued and self._clear_pinged))
            self._clear_pinged = self._clear_pinged or not queued

    def on_frame_sent(self, nbytes: int) -> SentFrame:
        """A frame went out and an acknowledgement will follow; keep the result for on_acked."""
        # a lone decode frame ahead does not keep the path busy: the interval would hold idle time
        busy = self._in_flight >= self.min_delivery_bytes // 4
        frame = SentFrame(nbytes, self._delivered, self._delivered_at, busy)
        self._in_flight += nbytes
        return frame

    def on_acked(self, frame: SentFrame, now: float) -> bool:
        """The next hop has read `frame`. True if this made a bandwidth sample."""
        self._in_flight = max(0, self._in_flight - frame.nbytes)
        self._delivered += frame.nbytes
        self._delivered_at = now
        if not frame.pipe_busy or frame.delivered_at is None:
            return False
        interval = now - frame.delivered_at
        delivered = self._delivered - frame.delivered
        if interval < self.min_delivery_s or delivered < self.min_delivery_bytes // 4:
            return False
        self._add_rate(delivered / interval, now, APP)
        self.ack_samples += 1
        return True

    def on_arrival(self, nbytes: int, seconds: float, now: float) -> bool:
        """The next hop saw `nbytes` of a frame arrive over `seconds`. True if it was a sample."""
        if nbytes < self.min_arrival_bytes or seconds < self.min_arrival_s:
            return False  # too short to time against the receiver's scheduling jitter
        self._add_rate(nbytes / seconds, now, RX)
        self.arrival_samples += 1
        return True

    def on_ack_lost(self, frame: SentFrame) -> None:
        """No acknowledgement will come (the connection went away): forget the frame."""
        self._in_flight = max(0, self._in_flight - frame.nbytes)

    def _check_blind(self, now: float) -> None:
        if (
            not self.tcp_blind
            and self._min_ping is not None
            and self._min_tcp_rtt is not None
            and self._min_tcp_rtt < BLIND_RTT_RATIO * self._min_ping
        ):
            self.tcp_blind = True
            self.rtt = self._min_ping  # restart the RTT figures from the pings alone
            self._min_rtts = deque([(now, self._min_ping)])
            kept = [r for r in self._rates if r[2] != TCP]
            self._rates.clear()
            self._rates.extend(kept)
            if kept:
                self._recompute()
            else:
                self._bandwidth = None  # everything known came from the blind kernel figures

    def on_delivery(self, nbytes: int, started: float, finished: float, now: float) -> bool:
        """A timed write of `nbytes`. True if it counted as a bandwidth sample."""
        duration = finished - started
        back_to_back = (
            self._last_write_end is not None
            and self._last_write_blocked
            and started - self._last_write_end <= self.max_gap_s
        )
        blocked = duration >= self.min_delivery_s
        self._last_write_end = finished
        self._last_write_blocked = blocked
        if nbytes < self.min_delivery_bytes or not blocked or not back_to_back:
            return False
        self._add_rate(nbytes / duration, now, APP)
        return True

    def _add_rate(self, rate: float, now: float, source: str) -> None:
        rates = self._rates
        rates.append((now, rate, source))
        while rates[0][0] < now - self.window_s:
            rates.popleft()
        self._recompute()
        self.samples += 1
        self.bandwidth_samples += 1

    def _recompute(self) -> None:
        """The quantile of the window's samples (its arrival spreads alone, if it holds enough
        of them); with none left the estimate holds."""
        arrivals = [r for _, r, src in self._rates if src == RX]
        quantile = self.quantile
        if len(arrivals) >= self.min_arrivals:
            ordered = sorted(arrivals)
            quantile = 0.5  # not biased low by idle time: the middle is the rate
        else:
            ordered = sorted(r for _, r, _ in self._rates)
        if ordered:
            self._bandwidth = percentile(ordered, quantile)

    def _add_rtt(self, rtt: float, now: float, to_min: bool = True) -> None:
        self.rtt = ewma(self.rtt, rtt, self.rtt_gain)
        if to_min:
            self._add_min_rtt(rtt, now)
        self.samples += 1
        self.rtt_samples += 1

    def _add_min_rtt(self, rtt: float, now: float) -> None:
        # monotonic deque: the front is the minimum of the window
        while self._min_rtts and self._min_rtts[-1][1] >= rtt:
            self._min_rtts.pop()
        self._min_rtts.append((now, rtt))
        while self._min_rtts[0][0] < now - self.min_rtt_window_s:
            self._min_rtts.popleft()


def ewma(old: float | None, sample: float, gain: float) -> float:
    """An exponentially weighted mean moved `gain` of the way to `sample`; the sample if none."""
    return sample if old is None else old + gain * (sample - old)
