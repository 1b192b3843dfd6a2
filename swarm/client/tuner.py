"""How speculative decoding sizes its rounds: a Tuner per reply, fitted to what the route's
rounds cost and what the drafts' acceptance is, and a pool that carries a route's Tuner from one
reply to the next, so a client's second reply starts from what its first measured."""

from __future__ import annotations

import copy
import math
import threading
from collections import OrderedDict
from collections.abc import Hashable

from swarm.protocol import MAX_REWIND, MAX_VERIFY_TOKENS

MAX_DRAFTS = MAX_VERIFY_TOKENS - 1  # a round: the decided token and up to this many drafts
MAX_IN_FLIGHT = 4  # rounds sent ahead of the one whose answer is awaited
GUESS_TOKEN = 1 / 32  # of a round's latency, a token's cost until measured
assert MAX_IN_FLIGHT * MAX_VERIFY_TOKENS <= MAX_REWIND  # a rejection rewinds all in flight


class Tuner:
    """How many drafts a round carries and how many rounds fly at once: the pair with the most
    tokens a second expected from the measured acceptance (drafts accepted of those checked:
    each accepted one, and the first that was not) and round times (a fixed latency and a cost
    a token, fitted to the rounds sent with none ahead of them); a plain step where nothing
    beats it (speculation off, tried again every PROBE_EVERY tokens)."""

    PROBE_EVERY = 32
    PROBE_MOST = 128  # tokens between probes after failed ones (each doubles the wait)
    DECAY = 0.8  # weight of the past in the averages, a round at a time
    SHRINK = 2.0  # tokens^2 of spread at no cost a token, in the fit of a round's cost

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
        self.draft_s = 0.0  # the drafter's seconds a draft (decayed): a draft model's compute
        self.stages = 1  # hops of the route: a round behind another waits for the slowest only
        # decayed (weight, tokens, seconds) of the rounds answered behind another: how long
        # after the answer ahead of them theirs came, what a round in flight adds to a cycle
        self._spacing = (0.0, 0.0, 0.0)
        self._explored = 0  # rounds planned before the cost a token was fitted
        self.off_since = -1  # token count when speculation switched itself off, -1 if on
        # speculation off and tried again: "out" while the probe round's answer is awaited
        # (sent when `_probe_at` tokens were decided), then whether a draft of it was accepted
        self._probe: str | bool | None = None
        self._probe_at = 0
        # tokens off before the next probe: each failed probe doubles it (a draft model whose
        # drafts never pass costs its compute and a longer round at every probe; loopback,
        # 47-token replies, 2-3 probes a reply cost 2-10%), one with a draft accepted resets it
        self.probe_every = self.PROBE_EVERY
        self._before_probe: tuple[int, tuple[float, float] | None] = (0, None)  # kind, theirs
        # decayed (tokens, seconds) produced with rounds and with plain steps: what each paid
        self._produced = {True: (0.0, 0.0), False: (0.0, 0.0)}

    def acceptance(self, kind: int = 0) -> float:
        """Of the drafts of `kind` checked, the share accepted (decayed)."""
        hits, checks = self._accepted.get(kind, (self.prior, 1.0))
        return hits / checks

    def observe(self, checked: int, accepted: int, kind: int = 0) -> None:
        """A round's drafts of `kind`: `checked` compared with the picks, `accepted` of them
        equal."""
        if self._probe == "out":
            self._probe = accepted > 0
            if accepted:
                self.probe_every = self.PROBE_EVERY
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
        sxx = nn - n * n / one  # the spread of the sizes, times the rounds
        self.fitted = self.fitted or sxx > 0.25 * one  # rounds of several sizes were timed
        if self.fitted:
            # a line through them, its slope shrunk towards 0 as if SHRINK more were flat: a
            # cost fitted from a few noisy rounds (a round trip's jitter is worth several
            # tokens' cost at 40 ms a hop) fades while rounds of one size follow it, where a
            # plain fit would stay as it was and keep rounds at that size
            self.per_token = max(0.0, (nt - n * t / one) / (sxx + self.SHRINK))
        self.latency = max(1e-4, t / one - self.per_token * (n / one - 1))

    def drafted(self, drafts: int, seconds: float) -> None:
        """The drafter proposed `drafts` in `seconds` (before the round could leave)."""
        if drafts:
            self.draft_s = self.DECAY * self.draft_s + (1 - self.DECAY) * seconds / drafts

    def alone(self, tokens: int) -> float:
        """Seconds a round of `tokens` takes with none ahead of it, as fitted."""
        return self.latency + (tokens - 1) * self.per_token

    def spaced(self, tokens: int, seconds: float, queued: bool) -> None:
        """A round of `tokens`, sent before the answer ahead of it came, answered `seconds`
        after that answer; `queued`: alone, it would have come by then, so that `seconds` is
        what the hops' work on it added behind the round ahead (where their compute, not the
        wire, sets a round's time, as on a loopback route on shared cores, nearly its own
        time). Else `seconds` only bounds that from above: its own round trip may explain it."""
        w, n, t = self._spacing
        if not queued:
            if w < 1.0 or t / w <= seconds:
                return
            t = w * seconds  # an estimate above a bound: down to it
            n = w * tokens
        self._spacing = (self.DECAY * w + 1, self.DECAY * n + tokens, self.DECAY * t + seconds)

    def behind(self, tokens: int) -> float:
        """Seconds a round of `tokens` adds to a cycle sent behind another: as measured by
        spacing where it was (adjusted to its size), else the slowest hop's share of its
        cost."""
        share = tokens * self.per_token / self.stages
        w, n, t = self._spacing
        if w < 1.0:
            return share
        return max(share, t / w + (tokens - n / w) * self.per_token / self.stages)

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
        if self._probe == "out":
            if produced == self._probe_at:
                return 0, 1  # no round beside the probe: its answer decides
            self._probe = None  # it failed and was not checked: as if never sent
        a = min(self.acceptance(kind), 0.999)
        step = self.latency if self.step_s is None else self.step_s
        # rounds must beat plain steps by 5% (the model's error), then the best of them
        best, best_rate = (0, 1), 1.05 / max(step, 1e-6)
        # a token's cost unmeasured: a guess (taken as none, every round would carry the most
        # drafts, and 16 rows of an 8B model cost 50 ms a 20 Mbit/s link)
        per_token = self.per_token if self.fitted else self.latency * GUESS_TOKEN
        for k in range(1, MAX_DRAFTS + 1):
            yields = (1 - a ** (k + 1)) / (1 - a)  # the accepted run and the pick after it
            held = a ** (k + 1)  # a round's drafts all accepted: the one behind it is read
            # what a round behind another adds where it is read: what such rounds were
            # measured to add (the slowest hop's share of its tokens until then: the hops
            # working at once)
            behind = self.behind(k + 1)
            drafting = (k + 1) * self.draft_s  # before each round leaves, read or not
            for m in range(1, (MAX_IN_FLIGHT if self.fitted else 1) + 1):
                reach = [held**j for j in range(m)]  # round j is read if all before it held
                tokens = yields * sum(reach)
                # the first round pays its tokens at every hop; each behind it its drafts, and
                # `behind` where it is read, and where a rejection ends the cycle before it,
                # what its stale work delays the next cycle's first round
                stale = sum(
                    r * (1 - held) * self._stale(m - 1 - j, behind) for j, r in enumerate(reach)
                )
                cost = k * (per_token + self.draft_s) + (m - 1) * drafting
                cost += behind * sum(reach[1:]) + stale
                rate = tokens / max(self.latency + cost, 1e-6)
                if rate > best_rate:
                    best, best_rate = (k, m), rate
        if not self.fitted and best[0]:  # rounds of two sizes in turn measure it
            self._explored += 1
            k = best[0] if self._explored % 2 else max(1, best[0] // 2)
            timed = self._fit[0] > 0 or self.step_s is not None
            best = (k if timed else min(k, 2), 1)  # nothing timed yet: not even the latency
        if best[0] and not self.rounds_pay():
            best = (0, 1)  # measured slower than plain steps: off, and probed as below
        if self._probe is False:
            # the probe's drafts were all rejected: off again at once, with the acceptance
            # measured before it, rather than after the rounds it takes the probe's hopeful
            # one to decay below what pays (each slower than a plain step: 0.8-0.9x where the
            # drafts are never right)
            best, self.off_since = (0, 1), produced
            self.probe_every = min(2 * self.probe_every, self.PROBE_MOST)
            probed, before = self._before_probe
            if before is not None:
                self._accepted[probed] = before
        self._probe = None
        if best[0]:
            self.off_since = -1
        elif self.off_since < 0:
            self.off_since = produced
        elif produced - self.off_since >= self.probe_every:  # try again: texts change
            self.off_since = produced
            self._before_probe = (kind, self._accepted.get(kind))
            self._accepted[kind] = (max(self.acceptance(kind), 0.5), 1.0)
            self._produced[True] = (0.0, 0.0)  # the rounds from here on tell whether they pay
            self._probe, self._probe_at = "out", produced
            return 2, 1
        return best

    def _stale(self, rounds: int, behind: float) -> float:
        """What `rounds` gone stale behind a rejected one delay the next cycle's first round:
        their work at the last hop, `behind` apart, less what the new round's way there covers
        in the wire's share of a round trip (the hops' work, `behind` each, on shared cores
        or not, may be theirs to do before it)."""
        wire = max(0.0, self.latency - self.stages * behind)
        return max(0.0, rounds * behind - wire * self.stages / (self.stages + 1))

    def for_next_reply(self) -> Tuner:
        """A copy for another reply on the same route: what it measured of the route and the
        drafts, not whether rounds paid in this reply's text."""
        out = copy.deepcopy(self)
        out.off_since = -1
        out._produced = {True: (0.0, 0.0), False: (0.0, 0.0)}
        return out


class TunerPool:
    """The last Tuner of each (route, drafter) a client used, for its next reply there: a reply
    of 64 tokens is too short to learn a route's round cost from nothing. Each reply gets its
    own copy (replies at once on one route do not share one)."""

    MOST = 64  # routes remembered, the least recently used forgotten

    def __init__(self):
        self._last: OrderedDict[Hashable, Tuner] = OrderedDict()
        self._lock = threading.Lock()  # one client, many sessions' threads

    def keys(self) -> list[Hashable]:
        """(drafter, peer of each hop) of the routes remembered, least recently used first."""
        with self._lock:
            return list(self._last)

    def take(self, key: Hashable) -> Tuner:
        with self._lock:
            last = self._last.get(key)
        return Tuner() if last is None else last.for_next_reply()

    def give(self, key: Hashable, tuner: Tuner) -> None:
        with self._lock:
            self._last[key] = tuner
            self._last.move_to_end(key)
            while len(self._last) > self.MOST:
                self._last.popitem(last=False)
