"""The flags of a node whose tokens match the unsplit reference exactly."""

from __future__ import annotations


def exact_flags(*, ttl: float | None = None, threads: int | None = None) -> list[str]:
    """float32 weights and float32 activations on the wire, so a swarm computes bit for bit what
    one process does; `ttl` the node's --announce-ttl, `threads` its --threads."""
    flags = ["--weights", "float32", "--wire-dtype", "float32"]
    if ttl is not None:
        flags += ["--announce-ttl", str(ttl)]
    if threads is not None:
        flags += ["--threads", str(threads)]
    return flags
