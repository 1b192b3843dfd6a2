"""A session through the swarm that survives node failures: token ids in, logits out, by
single steps (`feed`) or by verification rounds of drafts (`send_round`, speculative decoding).
A reply's session (`sampler` set) asks the route's last node to pick the tokens (`pick`): it
sends token ids back instead of hidden states, where it holds the model's head."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarm.client.probe import round_trips
from swarm.client.session import RemoteSession
from swarm.client.verify import Verdict, check_last_step
from swarm.errors import (
    CacheFull,
    FingerprintMismatch,
    LenderFailed,
    LendRefused,
    ProtocolError,
    RewindRefused,
    RouteUnavailable,
    SessionNotFound,
    SpanError,
    SwarmError,
)
from swarm.model.blocks import ring_slots
from swarm.model.sampling import Sampler
from swarm.protocol import MAX_VERIFY_TOKENS, Hop, Picking

log = logging.getLogger("swarm.client")
SHUN_S = 600.0  # how long a node that answered as no honest one would stays out of routes


@dataclass(frozen=True)
class Round:
    """A verification round in flight: tokens `ids` at positions [pos, pos + len(ids)), the
    first a token the client decided, the rest drafts after it."""

    spec: int
    pos: int
    ids: tuple[int, ...]


class RoundRows(Sequence):
    """A round's logits, a row for the token after each of its tokens, computed a chunk at a
    time as they are read: the client reads up to the first rejected draft, and the LM head is
    the largest matrix it holds (a row of the default model's costs about as much as its
    whole share of a decode step). Rows are computed alike in any chunks (the head takes rows
    one by one), so a pick is the same as from a plain step's logits."""

    def __init__(self, head: Any, hidden: torch.Tensor, first: int):
        self._head, self._hidden = head, hidden
        self._rows: list[torch.Tensor] = []
        self._chunk = max(1, first)

    def __len__(self) -> int:
        return self._hidden.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} of a round of {n}")
        i %= n
        while i >= len(self._rows):
            done = len(self._rows)
            self._rows.extend(self._head.logits_rows(self._hidden[done : done + self._chunk]))
            self._chunk *= 2  # read past the first chunk: the drafts are going well
        return self._rows[i]

    @property
    def computed(self) -> int:
        """How many rows went through the head so far."""
        return len(self._rows)


class InferenceSession:
    """Token ids in, next-token logits out. Survives node failures by rerouting and replaying."""

    def __init__(self, client: Any, max_length: int, drafter: Any = None):
        """`client`: the swarm.client.Client whose routes, head and runtime it uses;
        `drafter`: what proposes drafts for a Decoding of it (swarm.client.decoding)."""
        if max_length > client.config.max_position:
            raise ValueError(
                f"{max_length} tokens exceed the model's context of {client.config.max_position}"
            )
        self.client = client
        self.max_length = max_length
        self.drafter = drafter
        self.history: list[int] = []
        self.remote: RemoteSession | None = None
        self.excluded: set[str] = set()
        self.recoveries: list[float] = []  # seconds each failure took to recover from
        self.last_hidden: torch.Tensor | None = None  # the final hidden state of the last token
        # picks a reply's tokens (`pick`), on the route's last node where it holds the head
        self.sampler: Sampler | None = None
        self._held = 0.0  # the router's token for our session on the current route
        self._route: list[Hop] = []  # as held, whatever hops were handed over since
        self._spec = 0  # the last verification round's id
        self._sent_to = 0  # where the positions the route may hold end: history, rounds sent
        self._rows: tuple[Round, torch.Tensor] | None = None  # its final hidden states
        self._attempt = 0  # failed tries of the step or round under way
        self._failed_at: float | None = None
        self._too_long: CacheFull | None = None  # a node's refusal of a session this long
        # set by close(final=True), maybe from another thread than a step's (an async
        # reply's): that step then opens no route again
        self.closed = False

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, final: bool = False) -> None:
        """Leave the route: a next step opens another and replays the history there; or
        (`final`) for good, a step under way on another thread included."""
        self.closed = self.closed or final
        self._leave()

    def _leave(self) -> None:
        """Leave the route: the next step, if any, opens another."""
        remote, self.remote = self.remote, None
        if remote is not None:
            self.client.release_route(self._route, self._held)
            self.client.loop.run(remote.aclose)

    def _open(self, tokens: int) -> None:
        """Open a session on a new route for a first step of `tokens`: a long prompt may go
        to a prefill node, which hands the session on to the route's last hop (P/D)."""
        if self.closed:
            raise SessionNotFound("the session was closed")
        # counted on its nodes at once: load their records do not show yet, which sessions
        # routed at the same moment must see
        route, self._held = self.client.hold_route(self.excluded, self.max_length)
        self._route = list(route)
        handoff = None
        prefill = self.client.prefill_hop(route[-1], tokens, self.max_length, self.excluded)
        if prefill is not None:
            if self.max_length - tokens >= self.client.options.handoff_min_new:
                handoff, route = route[-1], [*route[:-1], prefill]
            else:  # a short answer: the session stays where its prompt is computed
                self.client.release_route(route, self._held)
                route = self._route = [*route[:-1], prefill]
                self._held = self.client.router.opened(route)
        picking = None
        if self.sampler is not None and self.client.options.last_hop_picks:
            picking = Picking.of(self.sampler)
        remote = self.client.remote_session(route, self.max_length, handoff, picking)
        try:
            self.client.loop.run(remote.open)
            if self.closed:  # meanwhile, from another thread: nobody will close this one
                raise SessionNotFound("the session was closed while it opened")
        except BaseException:
            self.client.release_route(route, self._held)
            self.client.loop.run(remote.aclose)
            raise
        self.remote = remote
        log.info(
            "route: %s%s",
            " -> ".join(f"{h.addr}[{h.start}:{h.end}]" for h in route),
            f", then {handoff.addr} once the prompt is in" if handoff else "",
        )

    def feed(self, ids: list[int]) -> torch.Tensor:
        """Append tokens; return logits [vocab] for the next one."""
        if self.sampler is not None:
            raise ValueError("a reply's session picks its tokens: use pick(), not feed()")
        return self._fed(ids)

    def pick(self, ids: list[int]) -> int:
        """Append tokens; return the token after them, as `sampler` picks it: on the route's
        last node where it does, else here from the logits."""
        out = self._fed(ids)
        return out if isinstance(out, int) else self.sampler(out, len(self.history))

    def _fed(self, ids: list[int]) -> torch.Tensor | int:
        while True:
            try:
                out = self._step(ids)
            except SwarmError as exc:
                self.recover(exc)
                continue
            self._recovered()
            return out

    def recover(self, exc: SwarmError) -> None:
        """After `exc` in a step or a round: leave the route (the next step or round opens
        another and replays the history there), or raise `exc` where another route cannot
        help or the retries are spent; a node's `CacheFull` if no route is left without the
        nodes refusing a session this long."""
        give_up = self._attempt == self.client.options.max_retries or self.closed
        if isinstance(exc, RouteUnavailable) and self._too_long is not None:
            # the nodes left out allow shorter sessions: the caller's fix is a shorter one
            exc, give_up = self._too_long, True
        if give_up or not _route_may_help(exc):
            self._attempt, self._failed_at, self._too_long = 0, None, None
            raise exc
        self._failed_at = self._failed_at or time.monotonic()
        self._reroute(exc, self._attempt)
        self._attempt += 1

    def _recovered(self) -> None:
        if self._failed_at is not None:
            self.recoveries.append(time.monotonic() - self._failed_at)
        self._attempt, self._failed_at, self._too_long = 0, None, None

    def send_round(self, ids: list[int], pos: int) -> Round:
        """Send `ids` (a decided token, then drafts) for positions [pos, pos + len(ids)); `pos`
        at most where the rounds in flight end, at least len(history). A new route first
        rebuilds its caches from the history. Answered by `round_logits`, in order."""
        if self.remote is None:
            self._open(pos + len(ids))
            replay = self.history[:pos]
            self.client.loop.run(self.remote.step, self._activations(replay), replay)
        self._spec += 1
        r = Round(self._spec, pos, tuple(ids))
        self._sent_to = pos + len(ids)
        hidden = self._activations(list(ids))
        self.client.loop.run(self.remote.send_round, hidden, pos, r.spec, r.ids)
        return r

    def round_logits(self, r: Round, first: int = MAX_VERIFY_TOKENS) -> Sequence:
        """Logits [len(r.ids), vocab]: row i for the token after r.ids[i]; the first `first`
        rows computed at once, the rest when they are read. Where the last hop picks the
        tokens, the token after each instead (ints)."""
        started = time.perf_counter()
        out = self.client.loop.run(self.remote.round_result, r.spec, r.pos, len(r.ids))
        if len(r.ids) == 1:  # as a decode step: the route's cost a token
            self.client.observe_step(self.remote.route, time.perf_counter() - started)
        if isinstance(out, tuple):
            self._rows = (r, None)
            return self._checked(out)
        self._rows = (r, out)
        return RoundRows(self._head(), out, first)

    def keep(self, r: Round, n: int) -> None:
        """The route's caches hold r.ids[:n] after the history: the tokens the client accepted
        of round `r` (the last whose logits it read)."""
        assert self._rows is not None and self._rows[0] == r and r.pos == len(self.history)
        self.history += r.ids[:n]
        hidden = self._rows[1]
        self.last_hidden = None if hidden is None else hidden[n - 1 : n]
        self._recovered()

    @property
    def round_tokens(self) -> int:
        """The most tokens a round may carry: no more than a sliding window's ring holds, so
        that a rewind into it can restore the ring (swarm.model.blocks.ring_slots)."""
        config = self.client.config
        return min(MAX_VERIFY_TOKENS, ring_slots(config, 0, config.num_layers, self.max_length))

    def _head(self):
        return self.client.head(self.remote.route)

    def _activations(self, ids: list[int]) -> torch.Tensor | None:
        """What a step of `ids` carries: nothing but the ids where the route's first hop embeds
        them, else their embeddings."""
        return None if self.remote.embeds else self._head().embed_tokens(ids)

    def _checked(self, picks: tuple[int, ...]) -> tuple[int, ...]:
        """The last hop's picks, each a token of the model's vocabulary (ProtocolError else)."""
        config, route = self.client.config, self.remote.route
        if any(t >= config.vocab for t in picks):
            err = ProtocolError(f"a picked token beyond the vocabulary of {config.name}")
            err.hop, err.peer = len(route) - 1, route[-1].peer  # type: ignore[attr-defined]
            raise err
        return picks

    def _step(self, ids: list[int]) -> torch.Tensor | int:
        """One try at feeding `ids`: the logits after them, or the token the last hop picked;
        on a new route, the tokens so far go first."""
        if self.remote is not None and self._sent_to > len(self.history):
            # verification rounds went past the history: only a round may rewind the route
            r = self.send_round(ids, len(self.history))
            logits = self.round_logits(r)
            self.keep(r, len(ids))
            return logits[-1]
        replay = []
        if self.remote is None:
            self._open(len(self.history) + len(ids))
            replay = self.history  # a new route: rebuild its caches from the tokens so far
        hidden = self._activations(replay + ids)
        started = time.perf_counter()
        out = self.client.loop.run(self.remote.step, hidden, replay + ids)
        if len(replay) + len(ids) == 1:  # a decode step: its time is the route's cost a token
            self.client.observe_step(self.remote.route, time.perf_counter() - started)
        self.history += ids
        self._sent_to = len(self.history)
        if isinstance(out, tuple):
            self.last_hidden = None
            return self._checked(out)[0]
        self.last_hidden = out
        return self.client.logits.logits(self._head(), out)

    def verify(self, rng: random.Random | None = None) -> Verdict:
        """Recompute the last step on other routes (see swarm.client.verify); nodes found
        computing wrongly go into client.suspects, which every route of the client leaves out,
        and are reported in the DHT, where the health page shows them."""
        if self.remote is None or self.last_hidden is None:
            raise ValueError(
                "nothing to verify yet: feed the session first (a reply whose last hop picked"
                " its tokens holds no hidden state to check)"
            )
        route = self.remote.route
        verdict = check_last_step(
            self.client, route, self.history, self.last_hidden, rng, self.excluded
        )
        if verdict.suspects:  # every route of the client leaves them out from now on
            log.warning("nodes computing wrongly, left out: %s", ", ".join(verdict.suspects))
            self.client.suspects |= verdict.suspects
            self.client.reports.publish(self.client.dht, self.client.config.name, verdict.outvoted)
            self._leave()  # the next step routes anew, replaying
        return verdict

    def _reroute(self, exc: SwarmError, attempt: int) -> None:
        """Leave the route that failed, blaming whom `exc` names (or the hops that went quiet),
        and back off before the next try."""
        self._blame(exc)
        log.warning("route failed (%s); rerouting, attempt %d", exc, attempt + 1)
        self._leave()
        time.sleep(min(0.25 * 2**attempt, 4.0))

    def _blame(self, exc: SwarmError) -> None:
        if isinstance(exc, (RewindRefused, LenderFailed, LendRefused)):
            # an honest node, short of history or of the lender it borrowed from (gone, or
            # refusing more blocks): the replay (there too) rebuilds it, borrowing anew
            return
        peer = getattr(exc, "peer", None)
        if peer and isinstance(exc, CacheFull):
            # its --max-session-tokens is below this session's length: other sessions may
            # use it, and another node may allow this one
            self._too_long = exc
            self.excluded.add(peer)
            return
        if peer:
            self.excluded.add(peer)
            self.client.router.failed(peer)  # the client's other sessions wait for a pong too
            if _misbehaved(exc) and not _about_our_message(exc):
                # every session of this client leaves it out for a while
                self.client.shunned[peer] = time.monotonic() + SHUN_S
            return
        if self.remote is None:
            return
        # nobody named: a hop hung. Ping each; exclude the silent ones.
        hops = {h.peer: h for h in self.remote.route}
        alive = self.client.loop.run(round_trips, hops, 2.0)
        for peer in hops.keys() - alive.keys():
            self.excluded.add(peer)
            self.client.router.failed(peer)


def _misbehaved(exc: SwarmError) -> bool:
    """A hop named by `exc` answered as no honest node of this model would: blocks it announced
    but does not serve, other weights, a broken message."""
    liar = isinstance(exc, (SpanError, FingerprintMismatch, ProtocolError))
    return liar and bool(getattr(exc, "peer", None))


def _about_our_message(exc: SwarmError) -> bool:
    """Whether the first hop reported a broken message: the one it parsed is the client's own
    (a bug of ours, or a round its state refuses), no reason to leave an honest node out of
    every session for SHUN_S; this session still leaves it and replays."""
    reported = getattr(exc, "reported", False) and getattr(exc, "hop", None) == 0
    return reported and isinstance(exc, ProtocolError)


def _route_may_help(exc: SwarmError) -> bool:
    """Whether another route may succeed: the error says so (a busy or dead peer), or leaving
    out a hop that misbehaved, or one allowing shorter sessions (`CacheFull`), may."""
    too_long = isinstance(exc, CacheFull) and bool(getattr(exc, "peer", None))
    return exc.retry_elsewhere or _misbehaved(exc) or too_long
