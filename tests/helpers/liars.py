"""Honest nodes of the tiny model and a lying one beside them (devtools/liar_node.py)."""

from __future__ import annotations

from devtools.launch import NodeProcess, start_node, stop_all
from devtools.liar_node import start_liar


def honest_and_liar(
    model: str,
    honest: list[tuple[int, int]],
    liar: tuple[int, int],
    flags: list[str],
    wait_for_liar: bool = True,
    **lie,
) -> list[NodeProcess]:
    """The honest nodes serving `honest` spans (the first is every other's DHT peer), then the
    liar on `liar` with its `lie` settings last; all serving, the liar only if `wait_for_liar`."""
    first = start_node(honest[0], model=model, extra=flags)
    started = [first]
    try:
        first.wait_serving()
        peers = first.maddrs[:1]
        started += [start_node(span, peers, model=model, extra=flags) for span in honest[1:]]
        started.append(start_liar(liar, peers, model, flags, **lie))
        for node in started[1:] if wait_for_liar else started[1:-1]:
            node.wait_serving()
    except BaseException:
        stop_all(started)
        raise
    return started
