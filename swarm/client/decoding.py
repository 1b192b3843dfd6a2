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
    pays where a reply repeats its prompt (rewriting, summarising, code, retrieved text)."""

    def __init__(self, longest: int = 3):
        self.longest = longest

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        seq = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.longest, len(seq) - 1), 0, -1):
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if len(hits):  # the latest occurrence: recent text predicts best
                start = int(hits[-1]) + n
                return seq[start : start + k].tolist()
        return []


@dataclass
class SpeculationStats:
    """What speculation did in one reply: drafts proposed and accepted, rounds checked."""

    proposed: int = 0
    accepted: int = 0
    rounds: int = 0
    steps: int = 0  # plain one-token steps, where no draft was proposed or it did not pay

    @property
    def tokens_per_round(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


class Tuner:
    """How many drafts a round carries and how many rounds fly at once, from the measured
    acceptance (an average over recent rounds) and round times: drafts while their expected
    yield per second beats a plain step's, rounds in flight while the route's latency, not its
    compute, sets the time of a round, and only as many as are likely to be still valid."""

    PROBE_EVERY = 32  # tokens between tries of speculation where it stopped paying

    def __init__(self, acceptance: float = 0.6):
        self.acceptance = acceptance
        self.latency = 0.0  # seconds of a round that do not grow with its tokens
        self.per_token = 0.0  # seconds each token adds to a round
        self.off_since = -1  # token count when speculation switched itself off, -1 if on

    def observe(self, proposed: int, accepted: int, tokens: int, seconds: float) -> None:
        if proposed:
            self.acceptance += 0.25 * (accepted / proposed - self.acceptance)
        if not self.latency:
            self.latency = seconds
        elif tokens == 1:
            self.latency += 0.25 * (seconds - self.latency)
        else:
            extra = max(0.0, seconds - self.latency) / (tokens - 1)
            self.per_token += 0.25 * (extra - self.per_token)

    def drafts(self, produced: int) -> int:
        """Drafts for the next round (0: a plain step)."""
        best, best_rate = 0, 1.0 / max(self.latency, 1e-6)
        for k in range(1, MAX_DRAFTS + 1):
            rate = self._expected(k) / max(self.latency + k * self.per_token, 1e-6)
            if rate > best_rate * 1.05:
                best, best_rate = k, rate
        if best == 0 and self.off_since < 0:
            self.off_since = produced
        if best:
            self.off_since = -1
        elif produced - self.off_since >= self.PROBE_EVERY:  # try again: texts change
            self.off_since, self.acceptance = produced, max(self.acceptance, 0.5)
            return 2
        return best

    def in_flight(self, drafts: int) -> int:
        """Rounds to keep in flight: more while a round's latency exceeds its compute and
        the rounds behind the first are likely to be valid (all before them accepted)."""
        whole = self.acceptance ** (drafts + 1)  # a round accepted to its last token
        compute = max(self.per_token * (drafts + 1), 1e-4)
        n = 1
        while n < MAX_IN_FLIGHT and whole**n >= 0.3 and self.latency > compute * n:
            n += 1
        return n

    def _expected(self, k: int) -> float:
        """Tokens a round of k drafts yields: the accepted run plus the token picked after."""
        a = min(self.acceptance, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)


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
        self.rounds: deque[tuple[Round, float]] = deque()  # in flight, with when each left
        self.plan: list[int] = []  # the drafts in flight, after the decided tokens

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
        if not self.rounds and not self._send_rounds():
            self.stats.steps += 1
            started = time.perf_counter()
            logits = self.session.feed(self.tokens[-1:])
            self.tuner.observe(0, 0, 1, time.perf_counter() - started)
            return [self._pick(logits, len(self.tokens))]
        r, sent = self.rounds.popleft()
        try:
            rows = self.session.round_logits(r)
        except SwarmError as exc:
            self.session.recover(exc)  # raises where no other route helps
            self.rounds.clear()
            self.plan.clear()
            return []
        seconds = time.perf_counter() - sent
        proposed, accepted = self.stats.proposed, self.stats.accepted
        out = self._check(r, rows)
        proposed, accepted = self.stats.proposed - proposed, self.stats.accepted - accepted
        self.tuner.observe(proposed, accepted, len(r.ids), seconds)
        if self.rounds and not self.plan:  # rejected: those behind it are stale
            self.rounds.clear()
        self._send_rounds()
        return out

    def _check(self, r: Round, rows) -> list[int]:
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
        if matched == len(r.ids) and len(self.tokens) < self.end:
            del self.plan[: len(r.ids)]  # all accepted: the next round in flight is valid
        else:
            self.plan.clear()
        return out

    def _send_rounds(self) -> bool:
        """Top up the rounds in flight; False if none is (no drafts proposed, or none pays)."""
        if self.drafter is None:
            return False
        k = self.tuner.drafts(len(self.tokens))
        if k == 0:
            return bool(self.rounds)
        while len(self.rounds) < self.tuner.in_flight(k):
            seq, session_round = self.tokens + self.plan, self.session.round_tokens
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
            self.rounds.append((r, time.perf_counter()))
            self.plan += drafts
        return bool(self.rounds)
