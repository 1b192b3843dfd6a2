"""The session table: KV caches, their owners, and the limits that keep a node's memory bounded."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import trio

from swarm.errors import CacheFull, NodeBusy, SessionNotFound
from swarm.model.blocks import KVCache
from swarm.protocol import Hop


@dataclass(eq=False)
class Session:
    sid: str
    hop: int
    route: tuple[Hop, ...]
    start: int  # blocks this session runs here, a sub-range of the node's span
    end: int
    wire_dtype: str
    max_length: int
    sink_token: str
    owner: object  # the inbound connection that opened it; only it may send steps
    cache: KVCache
    next_pos: int = 0  # position the next accepted step must start at
    sink: object | None = None  # the client's connection, on the last hop
    downstream: str | None = None  # "host:port" of the next hop
    opened: trio.Event = field(default_factory=trio.Event)
    open_error: Exception | None = None
    last_active: float = 0.0
    closed: bool = False
    pending: list = field(default_factory=list)  # prefill (Step, hidden) not yet computed
    prefill_queued: bool = False  # a compute job will take from `pending`
    pending_since: float = 0.0  # when the oldest piece in `pending` arrived (monotonic)
    prompt_end: int = -1  # the phase end of the latest prompt pieces, to tell a new prompt
    prompt_since: float = 0.0  # when that prompt's first piece arrived (monotonic)
    gather: trio.CancelScope | None = None  # a pass waiting for more pieces, until it runs
    compute_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def is_last(self) -> bool:
        return self.hop == len(self.route) - 1


class SessionTable:
    def __init__(self, max_sessions: int, max_cache_tokens: int, max_session_tokens: int):
        self.max_sessions = max_sessions
        self.max_cache_tokens = max_cache_tokens
        self.max_session_tokens = max_session_tokens
        self._sessions: dict[str, Session] = {}
        self.accepting = True

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self):
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

    def remove(self, sid: str) -> Session | None:
        s = self._sessions.pop(sid, None)
        if s is not None:
            s.closed = True
            s.cache.keys.clear()  # let the tensors go even if a job still holds the session
            s.cache.values.clear()
        return s
