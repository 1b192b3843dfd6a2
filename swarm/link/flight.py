"""How much prompt may be on its way: the in-flight cap, pacing, and the chunk floor.

A decode volume sent now waits behind every byte already sent and not yet through the
bottleneck. The driver reports the bytes sent to each connection and not yet acknowledged by
the next hop (`in_flight`). About bandwidth x min RTT of those are simply on their way; the rest
is a backlog of (in_flight / bandwidth - min_rtt) seconds, which comes off T_a. And while the
prompt bytes among them (`prefill_in_flight`) exceed `inflight_gain` x bandwidth x min RTT and
they are at least the floor's chunks (`prefill_frames`: `inflight_floor_chunks`, or one more
than a round trip carries), no prefill chunk goes to that connection: the prefill waits here,
where the next decode volume can still pass it, instead of in a buffer where it cannot. (BBR
caps its own flight at 2 x BDP for the same reason.) Decode frames do not count: they are what
the cap protects. Without a bandwidth or RTT estimate there is no cap. The default gain is 2
(`--link-inflight-gain`; 0: no cap), which needs a bandwidth estimate that does not read low: the
next hop's arrival spreads give it one.

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
"""

from __future__ import annotations

import math
from collections.abc import Callable

from swarm.link.freetime import Window
from swarm.link.links import Links
from swarm.link.options import LinkOptions
from swarm.link.queues import Queued, Volume


class Flight:
    """The in-flight cap and pacing of one uplink's prefill chunks.

    `free_time(now)`: T_a, or None when no decode session is active: with nothing to protect,
    nothing is held or paced."""

    def __init__(
        self, options: LinkOptions, links: Links, free_time: Callable[[float], Window | None]
    ):
        self._options = options
        self._links = links
        self._free_time = free_time

    def floor_tokens(self, volume: Volume) -> int:
        """The smallest chunk of `volume`: min_chunk_tokens, or the tokens its link carries in
        min_chunk_s if fewer (at least 1)."""
        o = self._options
        bandwidth = self._links.bandwidth(volume.dest)
        if o.min_chunk_s == 0 or bandwidth is None:
            return o.min_chunk_tokens
        fit = whole_tokens(bandwidth * o.min_chunk_s, volume.bytes_per_token)
        return max(1, min(o.min_chunk_tokens, fit))

    def pacing(self, dest: str) -> bool:
        """Whether prefill chunks to `dest` are paced: pacing is on (pace_lead_s), and the link is
        slow enough for it (pace_slow_s), by its bandwidth estimate now."""
        o = self._options
        if o.pace_lead_s is None:
            return False
        if o.pace_slow_s == 0:
            return True
        link = self._links.get(dest)
        bandwidth = self._links.bandwidth(dest)
        if link is None or bandwidth is None or link.bytes_per_token is None:
            return False
        return o.min_chunk_tokens * link.bytes_per_token >= o.pace_slow_s * bandwidth

    def backlog(self, dest: str, now: float | None = None) -> float:
        """Seconds of sent bytes queued ahead of a send to `dest` now (0 if unknown).

        When pacing (and given `now`): what this node sent that the link has not carried yet, at
        the estimated bandwidth. Otherwise from acknowledgements: what is unacknowledged beyond
        bandwidth x min RTT. That reads high by up to a frame, as a frame is acknowledged only
        once all of it has arrived: fine for sizing a chunk, but pacing on it would leave the
        link idle for a round trip after every chunk."""
        link = self._links.get(dest)
        bandwidth = self._links.bandwidth(dest)
        if link is None or bandwidth is None:
            return 0.0
        if now is not None and self.pacing(dest):
            return link.unsent_now(bandwidth, now) / bandwidth
        return max(0.0, link.in_flight / bandwidth - (link.base_rtt or 0.0))

    def pace_wait(self, dest: str, now: float) -> float:
        """Seconds a prefill chunk to `dest` should wait for the link to carry what it has."""
        lead = self._options.pace_lead_s
        if not self.pacing(dest) or lead is None or self._free_time(now) is None:
            return 0.0  # not pacing, or no decode session to protect
        return self.backlog(dest, now) - lead

    def must_hold(self, prefill: Queued, now: float) -> bool:
        """Whether the connection already holds enough unacknowledged prompt bytes to wait for
        some. Decode frames do not count: they are what the cap protects, and counting them
        would leave a small floor room for one chunk beside them, the link idle while its
        acknowledgement comes back."""
        o = self._options
        dest = prefill.volume.dest
        link = self._links.get(dest)
        bandwidth = self._links.bandwidth(dest)
        if o.inflight_gain == 0 or link is None or bandwidth is None:
            return False
        held = link.in_flight if link.prefill_in_flight is None else link.prefill_in_flight
        rtt = link.base_rtt
        if not held or rtt is None:
            return False
        if self._free_time(now) is None:
            return False  # no decode session to protect
        chunk = self.floor_tokens(prefill.volume) * prefill.volume.bytes_per_token
        cap = o.inflight_gain * bandwidth * rtt
        if self.pacing(dest):
            # pacing keeps the bottleneck short itself; the cap only catches an estimate reading
            # high, so the floor's chunks come on top of it: small paced chunks under the cap
            # alone wait a round trip for acknowledgements while the link idles
            return held + chunk > cap + o.inflight_floor_chunks * chunk
        floor = self.floor_chunks(chunk, bandwidth, rtt)
        if link.prefill_frames is not None:
            # the floor in chunks, whatever their size: chunks the free time makes a little
            # bigger than the smallest would otherwise fill a floor counted in bytes alone
            return link.prefill_frames >= floor and held + chunk > cap
        return held + chunk > max(cap, floor * chunk)

    def floor_chunks(self, chunk: int, bandwidth: float, rtt: float) -> int:
        """How many `chunk`-byte prompt chunks an unpaced connection may always hold
        unacknowledged: inflight_floor_chunks, or one more than a round trip carries if that is
        more. A chunk is acknowledged a round trip after its last byte, so a floor of fewer
        leaves the link idle until the acknowledgement comes whenever a chunk takes about a
        round trip: 8 tokens at 8 KiB on 20 Mbps (26 ms) against 30 ms, where 2 chunks left
        the link idle 5% of a round while a prompt waited."""
        pipe = math.ceil(bandwidth * rtt / chunk - 1e-9)
        return max(self._options.inflight_floor_chunks, 1 + pipe)

    def catch_up(self, dest: str, through: int, now: float) -> bool:
        """The next hop has read the sends to `dest` up to the mark `through`. The last of those
        left the bottleneck about a min RTT ago, so what was sent after them has had at most that
        long (and ack_slack_s) to drain. When pacing, that bounds what the link still holds from
        below: an estimate reading high makes the model drain too fast, and this catches it up.
        True if it did."""
        link = self._links.get(dest)
        bandwidth = self._links.bandwidth(dest)
        if link is None or bandwidth is None or not self.pacing(dest):
            return False
        window = (link.base_rtt or 0.0) + self._options.ack_slack_s
        behind = link.sent_total - through - bandwidth * window
        if behind > link.unsent_now(bandwidth, now):
            link.unsent, link.unsent_at = behind, now
            return True
        return False


def whole_tokens(nbytes: float, bytes_per_token: int) -> int:
    """Whole tokens in `nbytes`; the epsilon keeps 24.0 from flooring to 23 after rounding."""
    return math.floor(nbytes / bytes_per_token + 1e-9)
