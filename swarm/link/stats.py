"""A link scheduler's figures: running counters, and the snapshot a node publishes.

`LinkCounters` is what the scheduler's parts count as they go. `LinkStats` is one reading of
them with the gauges beside them; `as_dict()` is the flat mapping the node puts in its DHT
record (`link`) and the health page shows, and `from_dict()` reads such a mapping back.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field, fields

from swarm.protocol import DECODE


@dataclass
class LinkCounters:
    """Counts since start, and the latest samples of the delays reported as percentiles."""

    delay_samples: int = 1024
    sends: int = 0
    chunks_sent: int = 0
    chunk_tokens_total: int = 0
    chunk_tokens_last: int = 0
    w_resets: int = 0  # prefills sent whole because W reached max_wait
    prefill_whole_idle: int = 0  # prefills sent whole, no decode session to protect
    prefill_held: int = 0  # decisions the in-flight cap held a prefill back
    prefill_paced: int = 0  # decisions pacing held a prefill back
    pace_corrections: int = 0  # acknowledgements that caught the pacing model up
    bytes_sent_decode: int = 0
    bytes_sent_prefill: int = 0
    prefill_idle_s: float = 0.0  # link time idle while a prefill waited here
    decode_delays: deque[float] = field(init=False)  # queued to first handed out, seconds
    pace_late: deque[float] = field(init=False)  # how late the driver came back to a pace hold
    ack_lags: deque[float] = field(init=False)  # acknowledgements later than the model's drain

    def __post_init__(self) -> None:
        self.decode_delays = deque(maxlen=self.delay_samples)
        self.pace_late = deque(maxlen=self.delay_samples)
        self.ack_lags = deque(maxlen=self.delay_samples)

    def count_chunk(self, tokens: int) -> None:
        self.chunks_sent += 1
        self.chunk_tokens_total += tokens
        self.chunk_tokens_last = tokens

    def count_sent(self, phase: str, nbytes: int) -> None:
        self.sends += 1
        if phase == DECODE:
            self.bytes_sent_decode += nbytes
        else:
            self.bytes_sent_prefill += nbytes


@dataclass(frozen=True)
class LinkStats:
    """One reading of a link scheduler: counters, delays, link estimates and queues.

    Units are in the names' suffixes (_s seconds, _Bps bytes per second); a 0 delay or estimate
    means none measured yet."""

    waiting_weight: float = 0.0
    sends: float = 0.0
    chunks_sent: float = 0.0
    chunk_tokens_mean: float = 0.0
    chunk_tokens_last: float = 0.0
    w_resets: float = 0.0
    prefill_whole_idle: float = 0.0
    prefill_held: float = 0.0
    prefill_paced: float = 0.0
    pace_corrections: float = 0.0
    paced_links: float = 0.0
    pace_late_p50_s: float = 0.0
    pace_late_p99_s: float = 0.0
    ack_lag_p50_s: float = 0.0
    ack_lag_p99_s: float = 0.0
    prefill_idle_s: float = 0.0
    in_flight_bytes: float = 0.0
    bytes_sent_decode: float = 0.0
    bytes_sent_prefill: float = 0.0
    decode_delay_p50_s: float = 0.0
    decode_delay_p99_s: float = 0.0
    decode_delay_max_s: float = 0.0
    bandwidth_Bps: float = 0.0
    rtt_s: float = 0.0
    min_rtt_s: float = 0.0
    decode_compute_s: float = 0.0
    decode_sessions_tracked: float = 0.0
    last_t_a_s: float = 0.0
    last_t_a_case: float = 0.0
    prefill_queued_volumes: float = 0.0
    prefill_queued_bytes: float = 0.0
    decode_queued_volumes: float = 0.0
    decode_queued_bytes: float = 0.0

    @classmethod
    def from_counters(cls, c: LinkCounters, **gauges: float) -> LinkStats:
        """The counters' figures, with `gauges` (the fields counters cannot give) beside them."""
        delays = sorted(c.decode_delays)
        late = sorted(c.pace_late)
        lags = sorted(c.ack_lags)
        return cls(
            sends=float(c.sends),
            chunks_sent=float(c.chunks_sent),
            chunk_tokens_mean=c.chunk_tokens_total / c.chunks_sent if c.chunks_sent else 0.0,
            chunk_tokens_last=float(c.chunk_tokens_last),
            w_resets=float(c.w_resets),
            prefill_whole_idle=float(c.prefill_whole_idle),
            prefill_held=float(c.prefill_held),
            prefill_paced=float(c.prefill_paced),
            pace_corrections=float(c.pace_corrections),
            pace_late_p50_s=percentile(late, 0.50),
            pace_late_p99_s=percentile(late, 0.99),
            ack_lag_p50_s=percentile(lags, 0.50),
            ack_lag_p99_s=percentile(lags, 0.99),
            prefill_idle_s=c.prefill_idle_s,
            bytes_sent_decode=float(c.bytes_sent_decode),
            bytes_sent_prefill=float(c.bytes_sent_prefill),
            decode_delay_p50_s=percentile(delays, 0.50),
            decode_delay_p99_s=percentile(delays, 0.99),
            decode_delay_max_s=delays[-1] if delays else 0.0,
            **gauges,
        )

    def as_dict(self) -> dict[str, float]:
        """The flat mapping of the DHT record's `link` and the health page."""
        return asdict(self)

    @classmethod
    def from_dict(cls, figures: dict[str, float]) -> LinkStats:
        """Read a published mapping back: unknown keys are left out, missing ones are 0."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: float(v) for k, v in figures.items() if k in names})


def percentile(sorted_values: list[float], p: float) -> float:
    """The `p` quantile (0..1) of ascending values, interpolated linearly; 0 for none.

    The project's one rank rule: the link estimator, the node's published delays and every
    benchmark (scripts/bench/stats.py) use it.
    """
    if not sorted_values:
        return 0.0
    rank = p * (len(sorted_values) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (rank - lo)
