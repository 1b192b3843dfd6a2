"""A reply's tokens through an InferenceSession: one a step, or verified in rounds of drafts
(speculative decoding), several rounds in flight along the route at once.

Exact by construction: every token is the sampler's pick from the served model's logits at its
position (swarm.client.reply.Sampler, a draw fixed by the seed and the position), and a draft is
kept only where it equals that pick. A round carries the last decided token and drafts after
it; the last hop returns every position's hidden state, or the token it picks after each (where
it holds the head: InferenceSession.sampler); the client takes token after token and stops at
the first draft that differs. The rounds behind a rejected one are stale: the next
round starts before their positions, which rewinds every hop and drops them where they wait.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from swarm.client.inference import InferenceSession, Round
from swarm.client.reply import Sampler
from swarm.client.tuner import Tuner, TunerPool
from swarm.errors import SwarmError


class Drafter(Protocol):
    """Proposes how a token sequence goes on: up to `k` tokens (none: it has no idea). One
    with a `warm(tokens)` method is given each prompt while the route computes it."""

    def propose(self, tokens: Sequence[int], k: int) -> list[int]: ...


class PromptLookup:
    """Drafts from the session's own tokens: where the sequence's last n tokens (n from
    `longest` down to 1) occurred before, the tokens that followed them there. No model: it
    pays where a reply repeats its prompt (rewriting, summarising, code, retrieved text).
    Its drafts are of a kind, the length of the match they come from: a reply copying its
    prompt matches `longest` tokens and goes on as the prompt did; a match of one common token
    seldom does, and the tuner learns each kind's acceptance apart."""

    def __init__(self, longest: int = 3):
        self.longest = longest

    def _match(self, tokens: Sequence[int]) -> tuple[int, int]:
        """(n, where what followed the latest match of the last n tokens starts); n = 0: none."""
        seq = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.longest, len(seq) - 1), 0, -1):
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if len(hits):  # the latest occurrence: recent text predicts best
                return n, int(hits[-1]) + n
        return 0, 0

    def kind(self, tokens: Sequence[int]) -> int:
        return self._match(tokens)[0]

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        n, start = self._match(tokens)
        return [int(t) for t in tokens[start : start + k]] if n else []


@dataclass
class SpeculationStats:
    """What speculation did in one reply: drafts proposed and accepted, rounds checked."""

    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    steps: int = 0  # plain one-token steps, where no draft was proposed or it did not pay


class Decoding:
    """A reply's tokens, iterated: the prompt goes first, then each token is the sampler's
    pick; with a drafter, several tokens a round where drafts are accepted."""

    def __init__(
        self,
        session: InferenceSession,
        ids: list[int],
        max_new_tokens: int,
        sampler: Sampler,
        drafter: Drafter | None = None,
        tuner: Tuner | None = None,
        pool: TunerPool | None = None,
    ):
        """`tuner`: how rounds are sized (a new one if None); or `pool`: where the last reply
        on the same route with the same drafter left its Tuner, taken once the route is open
        and given back at the reply's end."""
        self.session, self.sampler, self.drafter = session, sampler, drafter
        session.sampler = sampler  # the route's last node picks with it where it can
        self.tokens = list(ids)
        self.end = len(ids) + max_new_tokens  # positions of the reply's tokens end here
        self.tuner = tuner or Tuner()
        self.pool = pool if tuner is None and drafter is not None else None
        self.stats = SpeculationStats()
        # in flight, with when each left, whether no round was ahead of it (then its time is
        # its own), and the kind of its drafts
        self.rounds: deque[tuple[Round, float, bool, int]] = deque()
        self._answered: float | None = None  # when the last round's answer came
        self.plan: list[int] = []  # the drafts in flight, after the decided tokens
        self.stale = False  # rounds a rejection made stale went out before the next round
        self._rounds_seen = 0
        self._warming: threading.Thread | None = None

    def __iter__(self) -> Iterator[int]:
        """The reply's tokens, up to max_new_tokens; the caller stops at its end of text."""
        prompt = len(self.tokens)
        warm = getattr(self.drafter, "warm", None)
        if warm is not None:  # the drafter reads the prompt while the route does
            self._warming = threading.Thread(
                target=warm, args=(list(self.tokens),), name="draft-warm", daemon=True
            )
            self._warming.start()
        first = self.session.pick(self.tokens)
        key = self._pool_key()
        if key is not None:
            self.tuner = self.pool.take(key)
        try:
            yield self._pick(first, prompt)
            while len(self.tokens) < self.end:
                yield from self._next()
        finally:
            if key is not None:
                self.pool.give(key, self.tuner)

    def _pool_key(self) -> tuple | None:
        """The route's peers and the drafter: what a Tuner measured holds for."""
        remote = getattr(self.session, "remote", None)
        if self.pool is None or remote is None:
            return None
        drafter = getattr(self.drafter, "label", None) or type(self.drafter).__name__
        return (drafter, *(h.peer for h in remote.route))

    def _pick(self, row, position: int) -> int:
        """The token at `position`: `row` if the last hop picked it, else from its logits."""
        token = row if isinstance(row, int) else self.sampler(row, position)
        self.tokens.append(token)
        return token

    def _next(self) -> list[int]:
        """The next tokens decided: one by a plain step, or those of the next round."""
        started = time.perf_counter()
        out = self._next_tokens()
        self.tuner.produced(
            self.stats.rounds > self._rounds_seen, len(out), time.perf_counter() - started
        )
        self._rounds_seen = self.stats.rounds
        return out

    def _next_tokens(self) -> list[int]:
        remote = getattr(self.session, "remote", None)
        if remote is not None:
            self.tuner.stages = len(remote.route)
        if not self.rounds and not self._send_rounds():
            self.stats.steps += 1
            started = time.perf_counter()
            token = self.session.pick(self.tokens[-1:])
            if not self.stale:  # else it waited behind the stale rounds: not its own time
                self.tuner.timed(1, time.perf_counter() - started)
            self.stale = False  # they were computed or dropped before it
            return [self._pick(token, len(self.tokens))]
        r, sent, alone, kind = self.rounds.popleft()
        try:
            rows = self.session.round_logits(r, self.tuner.rows_read(len(r.ids), kind))
        except SwarmError as exc:
            self.session.recover(exc)  # raises where no other route helps
            self.rounds.clear()
            self.plan.clear()
            return []
        answered, last = time.perf_counter(), self._answered
        if alone:
            self.tuner.timed(len(r.ids), answered - sent)
        elif last is not None and sent < last:  # it went out behind the last answer's round
            # alone, it would have come by then (give or take a round trip's jitter): so it
            # came later only for the hops' work on the rounds ahead
            alone_s = self.tuner.alone(len(r.ids))
            queued = sent + alone_s <= last + 0.25 * alone_s
            self.tuner.spaced(len(r.ids), answered - last, queued)
        self._answered = answered
        out = self._check(r, rows, kind)
        if self.rounds and not self.plan:  # rejected: those behind it are stale
            self.rounds.clear()
            # and may still hold the nodes up: the next round's time is not its own
            self.stale = True
        self._send_rounds()
        return out

    def _check(self, r: Round, rows, kind: int) -> list[int]:
        """Pick the token after each of round r's tokens until one differs from the plan
        (the drafts; the last row's pick checks the next round's first token); the route
        keeps r's tokens up to there."""
        planned = self.plan[: len(r.ids)]
        out: list[int] = []
        for i, row in enumerate(rows):
            out.append(self._pick(row, r.pos + i + 1))
            if i >= len(planned) or out[i] != planned[i] or len(self.tokens) >= self.end:
                break
        matched = next((i for i, (a, b) in enumerate(zip(out, planned)) if a != b), None)
        matched = min(len(out), len(planned)) if matched is None else matched
        self.session.keep(r, len(out))
        self.stats.rounds += 1
        self.stats.proposed += len(planned)
        self.stats.accepted += matched
        missed = matched < len(out) and matched < len(planned)  # not cut short by the end
        self.tuner.observe(matched + missed, matched, kind)
        if matched == len(r.ids) and len(self.tokens) < self.end:
            del self.plan[: len(r.ids)]  # all accepted: the next round in flight is valid
        else:
            self.plan.clear()
        return out

    def _send_rounds(self) -> bool:
        """Top up the rounds in flight; False if none is (no drafts proposed, or none pays)."""
        if self.drafter is None:
            return False
        kind_of = getattr(self.drafter, "kind", None)
        while True:
            seq, session_round = self.tokens + self.plan, self.session.round_tokens
            kind = kind_of(seq) if kind_of is not None else 0
            k, in_flight = self.tuner.plan(len(self.tokens), kind)
            if k == 0 or len(self.rounds) >= in_flight:
                break
            room = self.end - 1 - len(seq)  # the reply's last token is never fed
            first = not self.rounds
            want = min(k if first else k + 1, room, session_round - first)
            if self._warming is not None:  # its catch-up is the prompt's, not a draft's cost
                self._warming.join()
                self._warming = None
            drafting = time.perf_counter()
            drafts = self.drafter.propose(seq, want)[:want] if want > 0 else []
            self.tuner.drafted(len(drafts), time.perf_counter() - drafting)
            if not drafts:
                break
            ids = [self.tokens[-1], *drafts] if first else drafts
            pos = len(seq) - 1 if first else len(seq)
            try:
                r = self.session.send_round(ids, pos)
            except SwarmError as exc:
                self.session.recover(exc)
                self.rounds.clear()
                self.plan.clear()
                return False
            alone = not self.rounds and not self.stale
            self.rounds.append((r, time.perf_counter(), alone, kind))
            self.stale = False
            self.plan += drafts
        return bool(self.rounds)
