"""Who gets in: a node's connections shared fairly between source addresses, and the record of
whom it turned away, for the log.

A source address stands for a host (IPv6: its /64, which one subscriber usually holds whole);
until the data plane authenticates peers it is the only identity a node can count by. Each
address may hold a bounded share of the node; when the node is full, a newcomer from an address
holding less than its share may take the place of a connection that does nothing (no session)
from the address holding the most. The session table (session_table.py) applies the same idea to
sessions and cache tokens.

A session forwarded by the previous node of its route comes from that node's address, whoever
the user is; counted as that address's own, a busy upstream node would fill its share with many
users' sessions and be refused. So a connection from the address the route names for the
previous hop counts as forwarding: each of its sessions counts in the share of the user's host
(`origin`, as the first node saw it) behind that node, and all it forwards together in a larger
share of its own (`--max-forwarded-sessions`), which bounds what anyone claiming to forward can
take.

A session a node hands over here (a leaving node's, or a prefill node's handing on) arrives
from that node's address too: counted as its own, one drain or one prefill node's handoffs
would be refused past a single address's share. So it counts as forwarded, in its user's share
and in what the sender may forward together (`share_of(..., handed=True)`), until whoever owns
it on the route claims it here; from then on it counts as that owner's open would.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from swarm.address import source_host
from swarm.errors import NodeBusy
from swarm.protocol import Open

log = logging.getLogger("swarm.node")

THROTTLE_LOG_S = 60.0  # at most one warning per address per this many seconds
MAX_HOSTS = 4096  # addresses remembered for that
RECENT_S = 60.0  # the DHT record counts refusals and evictions over this window
RECENT_MAX = 100_000  # at most this many of them remembered


def peer_host(stream) -> str:
    """`source_host` of a FramedStream's peer; "?" once its socket has closed."""
    try:
        return source_host(stream.socket.getpeername())
    except (OSError, AttributeError):
        return "?"


@dataclass(frozen=True)
class Share:
    """Whose shares a session counts in: `host`'s, and `via`'s if a node forwards it ("" if
    not); `origin`, the user's host, goes on to the next hop."""

    host: str
    via: str
    origin: str


def share_of(source: str, msg: Open, handed: bool = False) -> Share:
    """The shares of a session `msg` opens on a connection from `source`; `handed`: a node
    at `source` hands it over here with its cache (it counts as forwarded by that node)."""
    if msg.origin and (handed or _from_previous_hop(source, msg)):
        return Share(f"{msg.origin} via {source}", source, msg.origin)
    # a first hop, not from the node the route names, or a sender not saying whose it is
    return Share(source, "", source)


def _from_previous_hop(source: str, msg: Open) -> bool:
    if msg.hop == 0:
        return False
    prev = msg.route[msg.hop - 1]
    return source == source_host((prev.host, 0))


@dataclass(eq=False)
class Inbound:
    """One inbound connection as admission sees it: `close` ends its task, `idle` says whether
    it holds no session (so closing it costs nobody a session)."""

    host: str
    opened: float
    close: Callable[[], None]
    idle: Callable[[], bool]


@dataclass
class ConnectionTable:
    max_connections: int
    max_host_connections: int
    _conns: list[Inbound] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self._conns)

    def count(self, host: str) -> int:
        return sum(1 for c in self._conns if c.host == host)

    def admit(self, conn: Inbound) -> Inbound | None:
        """Take `conn` in; the connection to close to make room for it, if one must go.
        Raises NodeBusy if its address holds its share or the node is full of busy ones."""
        mine = self.count(conn.host)
        if mine >= self.max_host_connections:
            raise NodeBusy(
                f"{self.max_host_connections} connections from {conn.host} already; close one"
            )
        victim = None
        if len(self._conns) >= self.max_connections:
            victim = self._victim(conn.host, mine)
            if victim is None:
                raise NodeBusy(f"node holds its maximum of {self.max_connections} connections")
            self._conns.remove(victim)
        self._conns.append(conn)
        return victim

    def remove(self, conn: Inbound) -> None:
        if conn in self._conns:
            self._conns.remove(conn)

    def _victim(self, host: str, mine: int) -> Inbound | None:
        """The oldest connection without a session from the address holding the most, if that
        address holds more than the newcomer's would."""
        counts = Counter(c.host for c in self._conns)
        for other, n in counts.most_common():
            if n <= mine + 1:
                return None
            idle = [c for c in self._conns if c.host == other and c.idle()]
            if idle:
                return min(idle, key=lambda c: c.opened)
        return None


@dataclass
class Throttle:
    """What the node turned away or evicted: counted for the status line, and a warning in the
    log at most once a minute per address."""

    refused: int = 0  # opens and connections refused for want of room or share
    evicted: int = 0  # sessions that gave their place to a newcomer
    hosts: set[str] = field(default_factory=set)  # addresses turned away (at most MAX_HOSTS)
    _logged: dict[str, float] = field(default_factory=dict)
    _times: deque = field(default_factory=lambda: deque(maxlen=RECENT_MAX))  # of either

    def refuse(self, host: str, what: str, why: str, now: float) -> None:
        self.refused += 1
        self._times.append(now)
        self._warn(host, f"refused {what} from {host}: {why}", now)

    def evict(self, host: str, why: str, now: float) -> None:
        self.evicted += 1
        self._times.append(now)
        self._warn(host, f"evicted a session of {host}: {why}", now)

    def recent(self, now: float, window: float = RECENT_S) -> int:
        """Refusals and evictions in the last `window` seconds (what the DHT record carries)."""
        while self._times and self._times[0] < now - window:
            self._times.popleft()
        return len(self._times)

    def _warn(self, host: str, text: str, now: float) -> None:
        if len(self.hosts) < MAX_HOSTS:
            self.hosts.add(host)
        last = self._logged.get(host)
        if last is not None and now - last < THROTTLE_LOG_S:
            return
        if len(self._logged) >= MAX_HOSTS:  # many addresses: forget who was warned about when
            self._logged.clear()
        self._logged[host] = now
        log.warning("throttling: %s (more from this address in the next minute unlogged)", text)
