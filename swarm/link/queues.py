"""What waits to leave on the uplink: volumes in two FIFOs, and the sends cut from them.

Decode volumes queue in one FIFO, prefill volumes in another. Whatever the policy, each
session's bytes stay in order: a volume is eligible only once every earlier volume of its
session has gone, so a decode step never overtakes its own session's prefill.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from swarm.protocol import DECODE, PHASES, PREFILL


@dataclass(frozen=True)
class Volume:
    """An activation waiting to leave: enough to order it and cut it on token boundaries."""

    session: str
    dest: str
    phase: str
    tokens: int
    bytes_per_token: int
    phase_left: int = 0  # tokens from this volume's first to its phase's end; 0: just its own

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ValueError(f"volume phase must be one of {PHASES}, got {self.phase!r}")
        if self.tokens < 1 or self.bytes_per_token < 1:
            raise ValueError(
                f"volume needs tokens >= 1 and bytes_per_token >= 1, got {self.tokens} and"
                f" {self.bytes_per_token}"
            )
        if self.phase_left and self.phase_left < self.tokens:
            raise ValueError(
                f"volume's phase_left ({self.phase_left}) is less than its tokens ({self.tokens})"
            )

    @property
    def nbytes(self) -> int:
        return self.tokens * self.bytes_per_token


@dataclass(frozen=True)
class Send:
    """Tokens [offset, offset + tokens) of volume `vid`; `last` when that finishes the volume."""

    vid: int
    session: str
    dest: str
    phase: str
    offset: int
    tokens: int
    nbytes: int
    last: bool


@dataclass
class Queued:
    """A queued volume and how much of it has been handed out."""

    vid: int
    volume: Volume
    enqueued: float
    sent: int = 0  # tokens already handed out

    @property
    def left(self) -> int:
        return self.volume.tokens - self.sent

    @property
    def left_bytes(self) -> int:
        return self.left * self.volume.bytes_per_token

    @property
    def phase_left(self) -> int:
        """Tokens of its phase still to send, this volume's and the later ones'."""
        return max(self.volume.phase_left, self.volume.tokens) - self.sent


class Queues:
    """The decode and prefill FIFOs, with each session's unfinished volumes in order."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._fifos: dict[str, list[Queued]] = {DECODE: [], PREFILL: []}
        self._chains: dict[str, deque[int]] = {}  # session -> unfinished vids, oldest first

    def __len__(self) -> int:
        """Volumes not yet completely handed out."""
        return len(self._fifos[DECODE]) + len(self._fifos[PREFILL])

    def waiting(self, phase: str) -> list[Queued]:
        """Queued volumes of `phase`, oldest first (do not change the list)."""
        return self._fifos[phase]

    def add(self, volume: Volume, now: float) -> Queued:
        queued = Queued(next(self._ids), volume, now)
        self._fifos[volume.phase].append(queued)
        self._chains.setdefault(volume.session, deque()).append(queued.vid)
        return queued

    def eligible(self, phase: str) -> Iterator[Queued]:
        """Queued volumes of `phase` whose session has nothing older left to send, oldest first."""
        return (q for q in self._fifos[phase] if self._chains[q.volume.session][0] == q.vid)

    def first_eligible(self, phase: str) -> Queued | None:
        return next(self.eligible(phase), None)

    def take(self, q: Queued, tokens: int) -> Send:
        """Hand out the next `tokens` of `q`; a volume handed out completely leaves the queue."""
        v = q.volume
        send = Send(
            vid=q.vid,
            session=v.session,
            dest=v.dest,
            phase=v.phase,
            offset=q.sent,
            tokens=tokens,
            nbytes=tokens * v.bytes_per_token,
            last=tokens == q.left,
        )
        q.sent += tokens
        if q.left == 0:
            self._fifos[v.phase].remove(q)
            chain = self._chains[v.session]
            chain.popleft()
            if not chain:
                del self._chains[v.session]
        return send

    def drop_session(self, session: str) -> int:
        """Drop a session's queued volumes; returns how many there were."""
        dropped = 0
        for phase, fifo in self._fifos.items():
            kept = [q for q in fifo if q.volume.session != session]
            dropped += len(fifo) - len(kept)
            self._fifos[phase] = kept
        self._chains.pop(session, None)
        return dropped
