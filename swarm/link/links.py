"""The connections of one uplink: their estimates, and what was sent to each that the link has
not carried yet.

Bytes already sent are not yet on the wire: a home router's buffer (and, here, the relay's) may
hold many of them. Two views of them: what the next hop has not acknowledged (`in_flight`, as
the driver reports it), and a model that drains what this node sent at the estimated bandwidth
(`unsent`), with a mark after each send of when its last byte is through the bottleneck
(`drains`), against which acknowledgements are timed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

MAX_DRAINS = 4096  # sends per connection remembered for the acknowledgement lag


@dataclass
class Link:
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

    def unsent_now(self, bandwidth: float, now: float) -> float:
        """Bytes sent that the link, at `bandwidth`, has not carried by `now`."""
        return max(0.0, self.unsent - bandwidth * max(0.0, now - self.unsent_at))

    @property
    def base_rtt(self) -> float | None:
        """The propagation delay: the minimum RTT, or the smoothed one before there is any."""
        return self.min_rtt or self.rtt


class Links:
    """Every connection of one uplink, by destination."""

    def __init__(self) -> None:
        self._links: dict[str, Link] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self._links)

    def values(self) -> Iterator[Link]:
        return iter(self._links.values())

    def get(self, dest: str) -> Link | None:
        return self._links.get(dest)

    def at(self, dest: str) -> Link:
        """The link to `dest`, known from now on if it was not."""
        return self._links.setdefault(dest, Link())

    def rtt(self, dest: str) -> float | None:
        link = self._links.get(dest)
        return None if link is None else link.rtt

    def bandwidth(self, dest: str) -> float | None:
        link = self._links.get(dest)
        if link is not None and link.bandwidth is not None:
            return link.bandwidth
        # connections of one uplink share its bottleneck: borrow the most cautious estimate
        known = [lk.bandwidth for lk in self._links.values() if lk.bandwidth is not None]
        return min(known) if known else None

    def update(
        self,
        dest: str,
        rtt: float | None = None,
        bandwidth: float | None = None,
        forget_bandwidth: bool = False,
        min_rtt: float | None = None,
        in_flight: int | None = None,
        prefill_in_flight: int | None = None,
        prefill_frames: int | None = None,
    ) -> None:
        """New figures for `dest`; None leaves a figure as it was."""
        link = self.at(dest)
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

    def on_sent(self, dest: str, nbytes: int, started: float) -> None:
        """`nbytes` went to `dest`, the write starting at `started`: the model drains them."""
        link = self.at(dest)
        link.sent_total += nbytes
        bandwidth = self.bandwidth(dest)
        if bandwidth is not None:
            link.unsent = link.unsent_now(bandwidth, started) + nbytes
            link.unsent_at = max(started, link.unsent_at)
            link.drains.append((link.sent_total, link.drained_at(bandwidth)))

    def ack_lag(self, dest: str, through: int, now: float) -> float | None:
        """The next hop has read the sends to `dest` up to the mark `through`: how much later
        than the model's drain time of that send plus the min RTT it says so (None: that send
        was not timed)."""
        link = self._links.get(dest)
        if link is None:
            return None
        while link.drains and link.drains[0][0] < through:
            link.drains.popleft()
        if link.drains and link.drains[0][0] == through:
            drained = link.drains.popleft()[1]
            return max(0.0, now - drained - (link.base_rtt or 0.0))
        return None

    def idle(self, dest: str, since: float, now: float) -> float:
        """Seconds between `since` and `now` in which the link to `dest` had, by the bandwidth
        estimate, carried everything sent to it (0 before anything was sent)."""
        link = self._links.get(dest)
        bandwidth = self.bandwidth(dest)
        if link is None or bandwidth is None or link.sent_total == 0:
            return 0.0
        return max(0.0, now - max(link.drained_at(bandwidth), since))
