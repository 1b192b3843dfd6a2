"""What a link scheduler is told at start: its policy and its tuning, each declared once.

The defaults are a node's, the measured best (docs/benchmarks.md): molink with the in-flight
cap, pacing links slow enough for it. The node's `--link-*` flags are derived from the fields
that name one (swarm/node/config.py). The bare algorithm, as the simulator compares it, is
`inflight_gain=0, pace_lead_s=None`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from swarm.options import non_negative_float, option, positive_int

POLICIES = ("molink", "fifo")
PREFILL_ORDERS = ("arrival", "shortest")
PACING_MODES = ("off", "on", "auto")

Policy = Literal["molink", "fifo"]
PrefillOrder = Literal["arrival", "shortest"]
Pacing = Literal["off", "on", "auto"]


@dataclass(frozen=True)
class LinkOptions:
    """A LinkScheduler's options. The scheduler reads pacing from `pace_lead_s` (None: none) and
    `pace_slow_s` (0: every link); `effective()` folds the `pacing` mode into those two."""

    policy: Policy = option(
        "molink",
        "molink (MoLink's Algorithm 1): decode first, prefill in just-in-time chunks; fifo: whole"
        " volumes in arrival order (what concurrent socket sends amount to)",
        flag="--link-policy",
        choices=list(POLICIES),
    )
    max_wait: int = option(
        30,
        "molink's N: a prefill passed over by this many decode sends goes whole",
        flag="--link-max-wait",
        type=positive_int,
    )
    prefill_order: PrefillOrder = option(
        "shortest",
        "molink: which waiting prompt crosses the link first: the one needing the least link"
        " time, less the time it has waited (lower mean time to first token; a long prompt may"
        " wait longer), or the oldest",
        flag="--link-prefill-order",
        choices=list(PREFILL_ORDERS),
    )
    inflight_gain: float = option(
        2.0,
        "molink: prefill chunks wait while a connection holds more than this many bandwidth x"
        " min RTT unacknowledged (0: never)",
        flag="--link-inflight-gain",
        type=non_negative_float,
    )
    # prompt chunks count through update_link's prefill_frames, else as floor-sized chunks'
    # bytes; on a paced connection these chunks' bytes come on top of the cap
    inflight_floor_chunks: int = option(
        2,
        "with --link-inflight-gain: a connection may always hold this many smallest prompt"
        " chunks unacknowledged, or one more than a round trip carries if that is more (decode"
        " frames do not count)",
        flag="--link-inflight-floor-chunks",
        type=positive_int,
    )
    pacing: Pacing = option(
        "auto",
        "molink: a prefill chunk goes only when the link, at its estimated bandwidth, is about"
        " to have carried what was sent before it (keeps the router's buffer nearly empty;"
        " costs prompt throughput). auto (the default): only on links where 8 prompt tokens"
        " take --link-pace-slow-ms or longer; the flag alone: on every link",
        flag="--link-pacing",
        nargs="?",
        const="on",
        choices=PACING_MODES,
    )
    # on a fast link a chunk is a short wait for a decode volume behind it anyway, and pacing
    # costs prompt throughput there (the link idles whenever the driver comes back late)
    pace_slow_s: float = option(
        0.030,
        "with --link-pacing auto: pace links where the smallest prompt chunk takes this long or"
        " longer (30 ms: 8 tokens of the default model under about 2.4 Mbps)",
        flag="--link-pace-slow-ms",
        ms=True,
    )
    pace_lead_s: float | None = option(
        0.010,
        "with --link-pacing: send the next chunk this long before the link runs dry",
        flag="--link-pace-lead-ms",
        ms=True,
    )
    min_chunk_s: float = option(
        0.0,
        "molink: the smallest chunk is what the link carries in this long, if under 8 tokens"
        " (0: always 8 tokens)",
        flag="--link-min-chunk-ms",
        ms=True,
    )
    # a floor on a chunk, so a prefill advances even when T_a <= 0 and each chunk is worth its
    # frame and the downstream step it becomes
    min_chunk_tokens: int = 8
    # fraction of bandwidth x T_a to fill: a chunk too small costs one more frame, one too
    # large delays a decode step, so err small
    margin: float = 0.8
    # a decode session silent for max(this, 4 periods) no longer holds prefill back
    session_idle_s: float = 2.0
    period_samples: int = 8  # arrival intervals kept per decode session to find its ring period
    compute_gain: float = 0.25  # EWMA gain of this node's step times (T_d)
    delay_samples: int = 1024  # samples kept of each delay the stats report as percentiles
    # pacing: how late an acknowledgement may come (the next hop's reading, the way back)
    # before it shows the link holding more than the pacing model says
    ack_slack_s: float = 0.02

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown link policy {self.policy!r}; choose from {POLICIES}")
        if self.max_wait < 1:
            raise ValueError(f"max_wait must be at least 1, got {self.max_wait}")
        if self.min_chunk_tokens < 1:
            raise ValueError(f"min_chunk_tokens must be at least 1, got {self.min_chunk_tokens}")
        if not 0 < self.margin <= 1:
            raise ValueError(f"margin must be in (0, 1], got {self.margin}")
        if self.inflight_gain < 0 or self.inflight_floor_chunks < 1:
            raise ValueError(
                f"need inflight_gain >= 0 and inflight_floor_chunks >= 1, got"
                f" {self.inflight_gain} and {self.inflight_floor_chunks}"
            )
        if self.pacing not in PACING_MODES:
            raise ValueError(f"unknown pacing {self.pacing!r}; choose from {PACING_MODES}")
        if self.pace_lead_s is not None and self.pace_lead_s < 0:
            raise ValueError(f"pace_lead_s must be >= 0 or None, got {self.pace_lead_s}")
        if self.pace_slow_s < 0:
            raise ValueError(f"pace_slow_s must be >= 0, got {self.pace_slow_s}")
        if self.min_chunk_s < 0:
            raise ValueError(f"min_chunk_s must be >= 0, got {self.min_chunk_s}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(
                f"unknown prefill order {self.prefill_order!r}; choose from {PREFILL_ORDERS}"
            )

    def effective(self) -> LinkOptions:
        """These options as the scheduler reads them: pacing off clears the pace lead, pacing
        on paces every link whatever its speed; auto leaves both as they are."""
        if self.pacing == "off":
            return replace(self, pace_lead_s=None)
        if self.pacing == "on":
            return replace(self, pace_slow_s=0.0)
        return self
