"""The session table: who holds which session, and the limits that keep a node's memory bounded
and shared fairly between source addresses.

Each address may hold `max_host_sessions` sessions and `max_host_cache_tokens` cache tokens.
When the node (or an address's share) is full, a newcomer takes the place of sessions that do
nothing: idle for `evict_idle_s`, or opened that long ago and never used. Failing that, an
address holding less than an equal share of the node's sessions may take the least active
session of the address holding the most, if that one holds more than an equal share. Only then
is the newcomer refused.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from swarm.errors import CacheFull, NodeBusy, SessionNotFound
from swarm.node.signal import Signal

if TYPE_CHECKING:
    from swarm.node.config import Limits
    from swarm.node.session_state import SessionState


class Seated(Protocol):
    """A session as the table weighs it (swarm.node.session.Session is one)."""

    sid: str
    host: str  # whose share it counts in
    via: str  # the node forwarding it here, if one does
    max_length: int  # the tokens it may hold in all
    local_tokens: int  # the cache tokens it reserves here (fewer than its length if it borrows)
    state: SessionState  # how long it idled, whether anyone used it
    owner: object  # the connections holding it
    sink: object | None

    @property
    def pieces(self) -> object: ...  # truthy while prompt pieces wait


Session = TypeVar("Session", bound=Seated)


class SessionTable(Generic[Session]):
    def __init__(self, limits: Limits):
        self.limits = limits
        self._sessions: dict[str, Session] = {}
        self.accepting = True
        self._left = Signal()  # a session gave its place up

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    @property
    def max_sessions(self) -> int:
        return self.limits.max_sessions

    @property
    def reserved_tokens(self) -> int:
        return sum(s.local_tokens for s in self._sessions.values())

    @property
    def free_cache_tokens(self) -> int:
        """Cache tokens a newcomer could reserve now (what the DHT record announces): the free
        ones and those of sessions that would give their place up; 0 without a place."""
        if not self.accepting:
            return 0
        now = time.monotonic()
        busy = [s for s in self._sessions.values() if not self._idle(s, now)]
        if len(busy) >= self.limits.max_sessions:
            return 0
        return max(0, self.limits.max_cache_tokens - sum(s.local_tokens for s in busy))

    def prompt_rank(self, session: Session, rank: float, cost: float) -> float:
        """The prompt lane's rank for `session`'s next pass: `rank` as the lane gives it, put
        back by the passes its address has waiting besides it, each `cost` seconds, times the
        addresses with prompts waiting: about where it would come if the lane took the
        addresses in turns. A lone prompt keeps the lane's rank; an address pushing many at
        once cannot fill the lane ahead of everyone else's."""
        waiting = [s for s in self._sessions.values() if s.pieces or s is session]
        others = sum(1 for s in waiting if s.host == session.host and s is not session)
        return rank + others * len({s.host for s in waiting}) * cost

    def make_room(self, session: Session, now: float) -> list[Session]:
        """The sessions that must give their place for `session` to be admitted (none if it
        fits). Raises the NodeBusy or CacheFull the newcomer gets if it cannot be."""
        lim = self.limits
        host, want = session.host, session.local_tokens
        if not self.accepting:
            raise NodeBusy("node is shutting down and accepts no new sessions")
        if session.sid in self._sessions:
            raise NodeBusy("session id already in use here")  # never reveal whose
        if session.max_length > lim.max_session_tokens:
            raise CacheFull(
                f"session wants {session.max_length} tokens, this node allows"
                f" {lim.max_session_tokens} per session"
            )
        if want > lim.max_cache_tokens:  # no eviction makes room: another node may have it
            raise NodeBusy(
                f"session wants {want} cache tokens, more than this node's whole cache of"
                f" {lim.max_cache_tokens}"
            )
        left = list(self._sessions.values())
        gone: list[Session] = []

        def take(victim: Session) -> None:
            left.remove(victim)
            gone.append(victim)

        shares = [  # the address's own share, and that of the node forwarding it here
            (lambda s: s.host == host, lim.max_host_sessions, lim.max_host_cache_tokens, host),
        ]
        if session.via:
            via = session.via
            shares.append(
                (
                    lambda s: s.via == via,
                    lim.max_forwarded_sessions,
                    lim.max_forwarded_cache_tokens,
                    f"{via} (forwarding its users' sessions)",
                )
            )
        for mine, max_count, max_tokens, who in shares:
            self._fit(left, take, now, want, mine, max_count, max_tokens, who)
        while len(left) >= lim.max_sessions or sum(s.local_tokens for s in left) + want > (
            lim.max_cache_tokens
        ):
            victim = self._victim(left, host, now)
            if victim is None:
                if len(left) >= lim.max_sessions:
                    raise NodeBusy(f"node serves its maximum of {lim.max_sessions} sessions")
                free = lim.max_cache_tokens - sum(s.local_tokens for s in left)
                raise NodeBusy(f"node has {free} free cache tokens, session wants {want}")
            take(victim)
        return gone

    def _fit(self, left, take, now, want, mine, max_count, max_tokens, who) -> None:
        """Within one share (sessions `mine` picks): its own idle sessions go first, longest
        idle first, until the newcomer fits; NodeBusy if it cannot."""
        while True:
            held = [s for s in left if mine(s)]
            count, tokens = len(held), sum(s.local_tokens for s in held)
            if count < max_count and tokens + want <= max_tokens:
                return
            idle = [s for s in held if self._idle(s, now)]
            if not idle:
                raise NodeBusy(
                    f"{who} holds {count} sessions and {tokens} cache tokens here, its share"
                    f" is {max_count} and {max_tokens}; close one"
                )
            take(max(idle, key=lambda s: s.state.idle_for(now)))

    def _idle(self, s: Session, now: float) -> bool:
        return s.state.idle_for(now) >= self.limits.evict_idle_s

    def _victim(self, left: list[Session], host: str, now: float) -> Session | None:
        if not left:
            return None
        counts = Counter(s.host for s in left)
        idle = [s for s in left if self._idle(s, now)]
        if idle:  # the address holding the most first; never used, then longest idle
            return max(
                idle, key=lambda s: (counts[s.host], not s.state.used, s.state.idle_for(now))
            )
        share = self.limits.max_sessions / len(set(counts) | {host})
        if counts[host] + 1 > share:
            return None  # the newcomer's address holds its equal share already
        big, n = counts.most_common(1)[0]
        if big == host or n <= share or n <= counts[host] + 1:
            return None
        return max((s for s in left if s.host == big), key=lambda s: s.state.idle_for(now))

    def add(self, session: Session) -> None:
        if self.make_room(session, time.monotonic()):
            raise NodeBusy(f"node serves its maximum of {self.limits.max_sessions} sessions")
        self._sessions[session.sid] = session

    def get(self, sid: str, conn: object) -> Session:
        """The session `sid` if `conn` owns it; otherwise the same error as for an unknown id."""
        s = self._sessions.get(sid)
        if s is None or (s.owner is not conn and s.sink is not conn):
            raise SessionNotFound(f"no session {sid[:8]}... on this connection")
        return s

    def lookup(self, sid: str) -> Session | None:
        return self._sessions.get(sid)

    def remove(self, session: Session) -> bool:
        """Free `session`'s place; False if it held none (already removed)."""
        if self._sessions.get(session.sid) is not session:
            return False
        del self._sessions[session.sid]
        self._left.fire()
        return True

    async def until_empty(self) -> None:
        await self._left.until(lambda: not self._sessions)
