"""Summaries of samples, with the rank rule the node itself uses (swarm/link/stats.py)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

from swarm.link.stats import percentile as _sorted_percentile


def percentile(values: Iterable[float], q: float) -> float:
    """The `q` quantile (0..1) of `values`, interpolated linearly; nan for none."""
    ordered = sorted(values)
    return _sorted_percentile(ordered, q) if ordered else math.nan


def summary(values: Iterable[float]) -> tuple[float, float, float]:
    """Mean, p50 and p99 of `values`; nan for none."""
    values = list(values)
    if not values:
        return (math.nan,) * 3
    return statistics.fmean(values), percentile(values, 0.5), percentile(values, 0.99)


def p50_p99_ms(values: Iterable[float]) -> str:
    """ "p50 X ms, p99 Y ms" of values in seconds."""
    values = list(values)
    return (
        f"p50 {percentile(values, 0.5) * 1e3:.0f} ms, p99 {percentile(values, 0.99) * 1e3:.0f} ms"
    )
