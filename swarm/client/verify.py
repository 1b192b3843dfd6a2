"""Checking the nodes' work: a session's last step recomputed on other routes, the odd one out
left out.

A node can return wrong activations (a bug, a broken quantization, or on purpose), and nothing
in the protocol shows it: the client sees only the last hop's final hidden state. So a client
may recompute its last step on a route without one of its hops (chosen at random), replaying
the session's tokens there, and compare the final hidden states. If they differ, a third route
using neither side's own nodes decides: the nodes of the route it disagrees with are suspects,
left out from then on, and reported in the DHT (`Reports`) for the health page to show. Neither
Petals, exo nor Parallax checks its nodes' work.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from swarm.dht import publish_reports
from swarm.errors import RouteUnavailable, SwarmError
from swarm.protocol import Hop
from swarm.records import MAX_REPORTED, MAX_TTL_S, Report

log = logging.getLogger("swarm.client")

# relative difference of final hidden states that two honest routes stay within: a decode step
# against a prompt pass over the same tokens, and formats that may differ from node to node
TOLERANCE = 0.05


class Client(Protocol):
    """What a check uses of swarm.client.Client."""

    loop: Any  # runs a session's coroutines

    def route(self, exclude: set[str] = ...) -> list[Hop]: ...

    def remote_session(self, route: list[Hop], max_length: int) -> Any: ...

    def head(self, route: list[Hop]) -> Any: ...


@dataclass(frozen=True)
class Verdict:
    """What a check found: `agreed` (None: no other route to ask), and the nodes outvoted
    (`suspects`, their hops in the route they computed on: `outvoted`)."""

    agreed: bool | None
    outvoted: tuple[Hop, ...] = ()

    @property
    def suspects(self) -> frozenset[str]:
        return frozenset(h.peer for h in self.outvoted)


class Reports:
    """The reports a client keeps in the DHT: one value signed by its key under the model's
    reports key, holding its last MAX_REPORTED reports of the last MAX_TTL_S seconds (a new
    report replaces the value, so it carries the older ones on)."""

    def __init__(self) -> None:
        self.kept: list[Report] = []

    def publish(self, dht, model: str, outvoted: tuple[Hop, ...]) -> None:
        from hivemind.utils import get_dht_time

        now = get_dht_time()
        named = {h.peer for h in outvoted}
        kept = [r for r in self.kept if r.at > now - MAX_TTL_S and r.peer not in named]
        self.kept = (kept + [Report(h.peer, h.start, h.end, now) for h in outvoted])[-MAX_REPORTED:]
        try:
            publish_reports(dht, model, self.kept)
        except SwarmError as exc:  # the check's verdict stands; only the page misses it
            log.warning(
                "could not report %s in the DHT: %s", ", ".join(h.peer for h in outvoted), exc
            )


def agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.float().flatten(), b.float().flatten()
    return bool((a - b).norm() <= TOLERANCE * a.norm().clamp_min(1e-6))


def recompute(
    client: Client, exclude: set[str], history: list[int]
) -> tuple[list[Hop], torch.Tensor] | None:
    """The last token's final hidden state after `history`, through a route avoiding
    `exclude`; None if there is no such route or it failed."""
    try:
        route = client.route(exclude)
    except RouteUnavailable:
        return None
    remote = client.remote_session(route, len(history))
    try:
        client.loop.run(remote.open)
        hidden = None if remote.embeds else client.head(route).embed_tokens(history)
        return route, client.loop.run(remote.step, hidden, history)
    except SwarmError as exc:
        log.info("a check's route failed (%s); the check is left undecided", exc)
        return None
    finally:
        client.loop.run(remote.aclose)


def check_last_step(
    client: Client,
    route: list[Hop],
    history: list[int],
    hidden: torch.Tensor,
    rng: random.Random | None = None,
    excluded: set[str] = frozenset(),
) -> Verdict:
    """Compare `hidden`, what `route` gave for the last token of `history`, with other routes
    (none through `excluded`)."""
    suspect = (rng or random).choice(route).peer
    other = recompute(client, {suspect, *excluded}, history)
    if other is None:
        return Verdict(None)
    other_route, other_hidden = other
    if agree(hidden, other_hidden):
        return Verdict(True)
    mine, theirs = {h.peer for h in route}, {h.peer for h in other_route}
    third = recompute(client, (mine ^ theirs) | excluded, history)  # neither side's own nodes
    if third is None:
        log.warning("routes disagree and no third route can settle it: %s vs %s", mine, theirs)
        return Verdict(False)
    _, third_hidden = third
    if agree(third_hidden, hidden):
        return Verdict(False, tuple(h for h in other_route if h.peer not in mine))
    if agree(third_hidden, other_hidden):
        return Verdict(False, tuple(h for h in route if h.peer not in theirs))
    return Verdict(False)
