"""The session table: who holds which session, and the limits that keep a node's memory bounded."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from swarm.errors import CacheFull, NodeBusy, SessionNotFound

if TYPE_CHECKING:
    from swarm.node.session import Session


class SessionTable:
    def __init__(self, max_sessions: int, max_cache_tokens: int, max_session_tokens: int):
        self.max_sessions = max_sessions
        self.max_cache_tokens = max_cache_tokens
        self.max_session_tokens = max_session_tokens
        self._sessions: dict[str, Session] = {}
        self.accepting = True

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    @property
    def reserved_tokens(self) -> int:
        return sum(s.max_length for s in self._sessions.values())

    @property
    def free_cache_tokens(self) -> int:
        return max(0, self.max_cache_tokens - self.reserved_tokens)

    def check_admission(self, sid: str, max_length: int) -> None:
        if not self.accepting:
            raise NodeBusy("node is shutting down and accepts no new sessions")
        if sid in self._sessions:
            raise NodeBusy("session id already in use here")  # never reveal whose
        if max_length > self.max_session_tokens:
            raise CacheFull(
                f"session wants {max_length} tokens, this node allows {self.max_session_tokens}"
                " per session"
            )
        if len(self._sessions) >= self.max_sessions:
            raise NodeBusy(f"node serves its maximum of {self.max_sessions} sessions")
        if max_length > self.free_cache_tokens:
            raise NodeBusy(
                f"node has {self.free_cache_tokens} free cache tokens, session wants {max_length}"
            )

    def add(self, session: Session) -> None:
        self.check_admission(session.sid, session.max_length)
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
        return True
