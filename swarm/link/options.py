"""What a link scheduler is told at start: its policy and its tuning, checked once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

POLICIES = ("molink", "fifo")
PREFILL_ORDERS = ("arrival", "shortest")

Policy = Literal["molink", "fifo"]
PrefillOrder = Literal["arrival", "shortest"]


@dataclass(frozen=True)
class LinkOptions:
    """A LinkScheduler's options; the defaults are the bare algorithm (no cap, no pacing).

    policy: "molink", MoLink's Algorithm 1 with just-in-time chunks, or "fifo", whole volumes
        in arrival order (what concurrent socket sends amount to).
    max_wait: N, decode sends that may pass a waiting prefill before it goes whole (MoLink: 30).
    min_chunk_tokens: floor on a chunk, so a prefill advances even when T_a <= 0 and each chunk
        is worth its frame and the downstream step it becomes.
    margin: fraction of bandwidth x T_a to fill; a chunk too small costs one more frame, one too
        large delays a decode step, so err small.
    session_idle_s: a decode session silent for max(this, 4 periods) no longer holds prefill back.
    period_samples: arrival intervals kept per decode session to find its ring period.
    compute_gain: EWMA gain of this node's step times (T_d).
    delay_samples: samples kept of each delay the stats report as percentiles.
    inflight_gain: prefill chunks wait while a connection has more than this many bandwidth x
        min RTT unacknowledged (0: never wait).
    inflight_floor_chunks: ... but a connection may always hold this many prompt chunks (told
        through update_link's prefill_frames; otherwise this many floor-sized chunks' bytes).
        On a paced connection this many floor-sized chunks' bytes come on top of the cap.
    pace_lead_s: pace prefill chunks: one goes only when the bytes already sent to its
        connection would be carried, at the estimated bandwidth, within this many seconds
        (None: no pacing).
    pace_slow_s: pace only connections where a chunk of min_chunk_tokens takes at least this
        long on the link, at its estimated bandwidth (0: every connection). On a fast link a
        chunk is a short wait for a decode volume behind it anyway, and pacing costs prompt
        throughput there (the link idles whenever the driver comes back late).
    ack_slack_s: pacing: how late an acknowledgement may come (the next hop's reading, the
        way back) before it shows the link holding more than the pacing model says.
    min_chunk_s: with a bandwidth estimate, the chunk floor is the tokens the link carries in
        this long, between 1 and min_chunk_tokens (0: min_chunk_tokens).
    prefill_order: which waiting prefill goes next (molink): "shortest", the one whose prompt
        needs the least link time left, less the time it has waited (a prompt waiting longer
        than a newcomer needs goes before it); or "arrival", the oldest.
    """

    policy: Policy = "molink"
    max_wait: int = 30
    min_chunk_tokens: int = 8
    margin: float = 0.8
    session_idle_s: float = 2.0
    period_samples: int = 8
    compute_gain: float = 0.25
    delay_samples: int = 1024
    inflight_gain: float = 0.0
    inflight_floor_chunks: int = 2
    pace_lead_s: float | None = None
    pace_slow_s: float = 0.0
    ack_slack_s: float = 0.02
    min_chunk_s: float = 0.0
    prefill_order: PrefillOrder = "shortest"

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
