"""A greedy generation's token times: time to first token (TTFT) and per output token (TPOT)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class TokenTimes:
    """When a generation asked (`start`) and when each token came, the first from the prompt
    pass; decode steps are timed from `decode_start` (the first token, unless work between)."""

    start: float
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    decode_start: float = math.nan

    @property
    def ttft(self) -> float:
        return self.times[0] - self.start

    @property
    def decode_s(self) -> float:
        return self.times[-1] - self.decode_start

    @property
    def steps(self) -> int:
        return len(self.times) - 1

    @property
    def tpot(self) -> float | None:
        """Mean seconds a decode step; None with none."""
        return self.decode_s / self.steps if self.steps else None

    @property
    def tokens_per_s(self) -> float:
        return self.steps / self.decode_s if self.steps else 0.0

    def gaps(self, lo: float = -math.inf, hi: float = math.inf) -> list[float]:
        """Seconds between consecutive tokens, of the pairs that lie within [lo, hi]."""
        return [b - a for a, b in zip(self.times, self.times[1:]) if lo <= a and b <= hi]


def greedy(
    feed: Callable[[Sequence[int]], object],
    prompt: Sequence[int],
    steps: int,
    clock: Callable[[], float] = time.perf_counter,
    between: Callable[[int], int] | None = None,
    stop: Callable[[], bool] | None = None,
    out: TokenTimes | None = None,
) -> TokenTimes:
    """The prompt pass then `steps` greedy decode steps, timed. `feed(tokens)` returns the
    logits of the last token (anything with argmax()), or the next token itself.
    `between(first)`, untimed, runs after the first token and returns the token decoding goes
    on from; `stop()` ends decoding early; `out` is filled as it goes (a thread's caller reads
    it even if a step raises)."""
    t = out if out is not None else TokenTimes(clock())
    t.tokens.append(_token(feed(prompt)))
    t.times.append(clock())
    token = t.tokens[-1] if between is None else between(t.tokens[-1])
    t.decode_start = clock() if between is not None else t.times[0]
    for _ in range(steps):
        if stop is not None and stop():
            break
        token = _token(feed([token]))
        t.tokens.append(token)
        t.times.append(clock())
    return t


def session_greedy(
    client, prompt: Sequence[int], steps: int, picks: bool = True, **kw
) -> TokenTimes:
    """`greedy` through a new session of a swarm `Client`, room for every token; `picks`: a
    reply's way, the route's last node picking each token, else the client's head (`feed`)."""
    from swarm.model.sampling import Sampler

    with client.session(len(prompt) + steps + 1) as s:
        if picks:
            s.sampler = Sampler()  # greedy
        return greedy(lambda ids: next_token(s, list(ids)), prompt, steps, **kw)


def next_token(session, ids: list[int]) -> int:
    """The greedy token after `ids` through a swarm session: picked by the route's last node
    where the session has a sampler, else the argmax of the client's logits."""
    return session.pick(ids) if session.sampler is not None else int(session.feed(ids).argmax())


def _token(out) -> int:
    return out if isinstance(out, int) else int(out.argmax())
