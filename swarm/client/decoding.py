"""A reply's tokens through an InferenceSession: one a step, or verified in rounds of drafts
(speculative decoding), several rounds in flight along the route at once.

Exact by construction: every token is the sampler's pick from the served model's logits at its
position (swarm.client.reply.Sampler, a draw fixed by the seed and the position), and a draft is
kept only where it equals that pick. A round carries the last decided token and drafts after
it; the last hop returns every position's hidden state; the client picks token after token and
stops at the first draft that differs. The rounds behind a rejected one are stale: the next
round starts before their positions, which rewinds every hop and drops them where they wait.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from swarm.client.inference import InferenceSession, Round
from swarm.client.reply import Sampler
from swarm.errors import SwarmError
from swarm.protocol import MAX_REWIND, MAX_VERIFY_TOKENS

MAX_DRAFTS = MAX_VERIFY_TOKENS - 1  # a round: the decided token and up to this many drafts
MAX_IN_FLIGHT = 4  # rounds sent ahead of the one whose answer is awaited
assert MAX_IN_FLIGHT * MAX_VERIFY_TOKENS <= MAX_REWIND  # a rejection rewinds all in flight


class Drafter(Protocol):
    """Proposes how a token sequence goes on: up to `k` tokens (none: it has no idea)."""

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


class Tuner:
    """How many drafts a round carries and how many rounds fly at once: the pair with the most
    tokens a second expected from the measured acceptance (drafts accepted of those checked:
    each accepted one, and the first that was not) and round times (a fixed latency and a cost
    a token, fitted to the rounds sent with none ahead of them); a plain step where nothing
    beats it (speculation off, tried again every PROBE_EVERY tokens)."""

    PROBE_EVERY = 32
    DECAY = 0.8  # weight of the past in the averages, a round at a time

    def __init__(self, acceptance: float = 0.6):
        self.prior = acceptance  # of a kind of draft not seen yet
        self._accepted: dict[int, tuple[float, float]] = {}  # kind: decayed (hits, checks)
        self._fit = [0.0] * 5  # decayed sums of 1, n, T, n*n, n*T over (tokens n, seconds T)
        self.latency = 0.0  # seconds of a round that do not grow with its tokens
        self.per_token = 0.0  # seconds each token adds to a round
        # whether per_token was measured: until then one round at a time (a round sent behind
        # another is not timed, and one that goes stale costs the nodes what per_token tells)
        self.fitted = False
        self.step_s: float | None = None  # a plain step's seconds (decayed)
        self.stages = 1  # hops of the route: a round behind another waits for the slowest only
        self.off_since = -1  # token count when speculation switched itself off, -1 if on
        # decayed (tokens, seconds) produced with rounds and with plain steps: what each paid
        self._produced = {True: (0.0, 0.0), False: (0.0, 0.0)}

    def acceptance(self, kind: int = 0) -> float:
        """Of the drafts of `kind` checked, the share accepted (decayed)."""
        hits, checks = self._accepted.get(kind, (self.prior, 1.0))
        return hits / checks

    def observe(self, checked: int, accepted: int, kind: int = 0) -> None:
        """A round's drafts of `kind`: `checked` compared with the picks, `accepted` of them
        equal."""
        if checked:
            hits, checks = self._accepted.get(kind, (self.prior, 1.0))
            self._accepted[kind] = (
                self.DECAY * hits + accepted,
                self.DECAY * checks + checked,
            )

    def timed(self, tokens: int, seconds: float) -> None:
        """A round of `tokens` (a plain step: 1) answered `seconds` after it was sent. The
        line is fitted to rounds only: a round's first token costs more than a plain step's
        (every hop checks its positions and keeps what a rewind needs), which a line through
        both would count as a cost a token."""
        if tokens == 1:
            last = seconds if self.step_s is None else self.step_s
            self.step_s = self.DECAY * last + (1 - self.DECAY) * seconds
            if not self.fitted:
                self.latency = self.step_s
            return
        f = [self.DECAY * x for x in self._fit]
        for i, x in enumerate((1, tokens, seconds, tokens * tokens, tokens * seconds)):
            f[i] += x
        self._fit = f
        one, n, t, nn, nt = f
        spread = nn / one - (n / one) ** 2
        if spread > 0.25:  # rounds of several sizes: a line through them
            self.per_token = max(0.0, (nt / one - n / one * t / one) / spread)
            self.fitted = True
        self.latency = max(1e-4, t / one - self.per_token * (n / one - 1))

    def produced(self, speculating: bool, tokens: int, seconds: float) -> None:
        """`tokens` decided in `seconds` of the reply, by a round or by a plain step."""
        n, t = self._produced[speculating]
        self._produced[speculating] = (self.DECAY * n + tokens, self.DECAY * t + seconds)

    def rounds_pay(self) -> bool:
        """Whether tokens came faster by rounds than by plain steps, as measured (True until
        both were): the model of a round's cost can miss what stale rounds cost the nodes and
        the head the client, where compute, not the round trip, sets the pace."""
        (n1, t1), (n0, t0) = self._produced[True], self._produced[False]
        if n1 < 4 or n0 < 4 or t1 <= 0 or t0 <= 0:
            return True
        return n1 / t1 >= n0 / t0

    def rows_read(self, tokens: int, kind: int = 0) -> int:
        """How many of a round's rows the client may expect to read: one a token while the
        drafts are accepted, and the one after the first that is not."""
        a = min(self.acceptance(kind), 0.999)
        return min(tokens, math.ceil((1 - a**tokens) / (1 - a)))

    def plan(self, produced: int, kind: int = 0) -> tuple[int, int]:
        """(drafts a round, rounds in flight) for the next round, of drafts of `kind`; (0, 1):
        a plain step."""
        a = min(self.acceptance(kind), 0.999)
        step = self.latency if self.step_s is None else self.step_s
        best, best_rate = (0, 1), 1.0 / max(step, 1e-6)
        for k in range(1, MAX_DRAFTS + 1):
            yields = (1 - a ** (k + 1)) / (1 - a)  # the accepted run and the pick after it
            for m in range(1, (MAX_IN_FLIGHT if self.fitted else 1) + 1):
                # round j is valid if every token before it was accepted
                tokens = yields * sum(a ** ((k + 1) * j) for j in range(m))
                # the first round pays its tokens at every hop; each behind it, at the
                # slowest hop only (about 1/stages of them), the hops working at once
                cost = k * self.per_token * (1 + (m - 1) / self.stages)
                rate = tokens / max(self.latency + cost, 1e-6)
                if rate > best_rate * 1.05:
                    best, best_rate = (k, m), rate
        if best[0] and not self.rounds_pay():
            best = (0, 1)  # measured slower than plain steps: off, and probed as below
        if best[0]:
            self.off_since = -1
        elif self.off_since < 0:
            self.off_since = produced
        elif produced - self.off_since >= self.PROBE_EVERY:  # try again: texts change
            self.off_since = produced
            self._accepted[kind] = (max(self.acceptance(kind), 0.5), 1.0)
            self._produced[True] = (0.0, 0.0)  # the rounds from here on tell whether they pay
            return 2, 1
        return best


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
    ):
        self.session, self.sampler, self.drafter = session, sampler, drafter
        self.tokens = list(ids)
        self.end = len(ids) + max_new_tokens  # positions of the reply's tokens end here
        self.tuner = tuner or Tuner()
        self.stats = SpeculationStats()
        # in flight, with when each left if no round was ahead of it (then its time is its own),
        # and the kind of its drafts
        self.rounds: deque[tuple[Round, float | None, int]] = deque()
        self.plan: list[int] = []  # the drafts in flight, after the decided tokens
        self.stale = False  # rounds a rejection made stale went out before the next round
        self._rounds_seen = 0

    def __iter__(self) -> Iterator[int]:
        """The reply's tokens, up to max_new_tokens; the caller stops at its end of text."""
        prompt = len(self.tokens)
        yield self._pick(self.session.feed(self.tokens), prompt)
        while len(self.tokens) < self.end:
            yield from self._next()

    def _pick(self, logits, position: int) -> int:
        token = self.sampler(logits, position)
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
            logits = self.session.feed(self.tokens[-1:])
            if not self.stale:  # else it waited behind the stale rounds: not its own time
                self.tuner.timed(1, time.perf_counter() - started)
            self.stale = False  # they were computed or dropped before it
            return [self._pick(logits, len(self.tokens))]
        r, sent, kind = self.rounds.popleft()
        try:
            rows = self.session.round_logits(r, self.tuner.rows_read(len(r.ids), kind))
        except SwarmError as exc:
            self.session.recover(exc)  # raises where no other route helps
            self.rounds.clear()
            self.plan.clear()
            return []
        if sent is not None:
            self.tuner.timed(len(r.ids), time.perf_counter() - sent)
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
            drafts = self.drafter.propose(seq, want)[:want] if want > 0 else []
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
            self.rounds.append((r, time.perf_counter() if alone else None, kind))
            self.stale = False
            self.plan += drafts
        return bool(self.rounds)
