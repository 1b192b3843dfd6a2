"""Is the peer at the other end of a connection still there? A data-plane heartbeat, sans IO.

A stopped (SIGSTOP) or wedged node keeps its connections open, and its kernel even acknowledges
what is sent to it, so only the application can tell. Whoever waits on a peer pings it every
INTERVAL_S and calls it hung once a ping has gone unanswered (no frame at all back) for
TIMEOUT_S. The clock runs only while this host's send queue to the peer is empty (its kernel
has acknowledged everything sent before the ping): a slow link still carrying a prompt is busy,
not hung. A peer whose kernel stops acknowledging (a dead host, a full receive window) is left
to the step timeout.
"""

from __future__ import annotations

import math

from swarm.link.tcpinfo import read_tcp_info

INTERVAL_S = 0.25
TIMEOUT_S = 1.5


class Heartbeat:
    def __init__(self, timeout: float = TIMEOUT_S):
        self.timeout = timeout
        self._ping_at: float | None = None  # first ping since the peer was last heard
        self._busy_at = -math.inf  # last time bytes to the peer were still queued here

    def pinged(self, now: float) -> None:
        if self._ping_at is None:
            self._ping_at = now

    def heard(self) -> None:
        """A frame came from the peer: it is alive, whatever it was."""
        self._ping_at = None

    def queued(self, now: float, busy: bool) -> None:
        """Whether bytes to the peer were still queued in this host at `now`."""
        if busy:
            self._busy_at = now

    def silent_for(self, now: float) -> float:
        """Seconds the peer has owed an answer with nothing queued in the way (0: none)."""
        if self._ping_at is None:
            return 0.0
        return max(0.0, now - max(self._ping_at, self._busy_at))

    def hung(self, now: float) -> bool:
        return self.silent_for(now) >= self.timeout


def send_queue_busy(sock) -> bool:
    """Whether `sock` holds bytes its peer's kernel has not acknowledged (False if unknown)."""
    info = read_tcp_info(sock) if sock is not None else None
    if info is None:
        return False
    return info.unacked > 0 or bool(info.notsent_bytes)
