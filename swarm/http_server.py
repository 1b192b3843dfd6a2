"""The HTTP servers (the API, the health page) under a cap on open connections.

hypercorn has no such cap: each connection it accepts holds a file descriptor until its client
finishes the headers or the idle timeout passes, so a stranger opening connections faster than
they time out could take every descriptor of the process (its DHT and its connections to nodes
need them too). Here an accept loop of our own hands each connection to hypercorn's
per-connection server (`TCPServer`, what `hypercorn.trio.serve` runs for each one) and counts
connections by source address, as a node does (swarm/node/admission.py): at most `total` open,
at most `per_caller` from one address (an IPv6 /64 counts as one). At a cap, the longest idle
connection (no request under way: headers still arriving, or kept alive between requests; idle
for `grace_s` at least) of the address holding the most makes room. A newcomer finding none
waits up to `wait_s` for a place, then gets a 503 naming the cap. While WAITING newcomers wait,
accepting waits: the kernel's backlog holds the rest without costing a descriptor.
"""

from __future__ import annotations

import errno
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from swarm.address import source_host

log = logging.getLogger(__name__)

WAITING = 16  # connections waiting for a place or being refused, on top of the cap
REFUSAL_LINGER_S = 1.0  # how long a refused client may take to read its 503
REPORT_EVERY_S = 60.0  # refusals and evictions are logged at most this often
# accept() failing for want of resources: wait and retry, as trio.serve_listeners does
CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


@dataclass(frozen=True)
class ConnectionLimits:
    total: int = 512
    per_caller: int = 64
    # a connection idle for less than this is not closed to make room: a client's headers
    # follow its connect within a round trip, and a burst's newest ones must get to send them
    grace_s: float = 2.0
    wait_s: float = 5.0  # a newcomer finding no room waits this long for one, then gets 503


class TooManyConnections(Exception):
    """No room for a connection now; `retry_at` (time.monotonic) when a connection in its
    way will have idled long enough to give its place, if one is idle at all."""

    def __init__(self, reason: str, retry_at: float | None = None):
        super().__init__(reason)
        self.retry_at = retry_at


@dataclass(eq=False)
class Connection:
    peer: tuple[str, int]
    host: str  # what it is counted under (swarm.address.source_host)
    idle_since: float  # time.monotonic: admitted, or its last request done
    requests: int = 0  # under way; a connection without one may be closed to make room
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


class ConnectionTable:
    """Open connections by peer (host, port), and who makes room for a newcomer."""

    def __init__(self, limits: ConnectionLimits, clock: Callable[[], float] = time.monotonic):
        if limits.total < 1 or limits.per_caller < 1:
            raise ValueError(f"need room for at least one connection, got {limits}")
        self.limits, self.clock = limits, clock
        self.total, self.per_caller = limits.total, min(limits.per_caller, limits.total)
        self.open: dict[tuple[str, int], Connection] = {}
        self.held: Counter[str] = Counter()
        self.freed = trio.Event()  # set (and replaced) whenever a place comes free
        self.refused = self.evicted = 0  # since the last report

    def admit(self, peer: tuple[str, int]) -> tuple[Connection, Connection | None]:
        """A place for a connection from `peer`, and the connection taken out to make it
        (its owner must close it); TooManyConnections if there is no room now."""
        host, now = source_host(peer), self.clock()
        victim = None
        if self.held[host] >= self.per_caller:
            victim, retry_at = self._idlest({host}, now)
            if victim is None:
                raise TooManyConnections(
                    f"{host} holds {self.held[host]} connections here, and one address may"
                    f" hold {self.per_caller}; close one",
                    retry_at,
                )
        elif len(self.open) >= self.total:
            victim, retry_at = self._idlest(set(self.held), now)
            if victim is None:
                raise TooManyConnections(
                    f"this server holds {len(self.open)} connections, each with a request"
                    " under way or just opened; retry shortly",
                    retry_at,
                )
        if victim is not None:
            self.evicted += 1
            self.drop(victim)
        conn = self.open[peer] = Connection(peer, host, now)
        self.held[host] += 1
        return conn, victim

    def _idlest(self, hosts: set[str], now: float) -> tuple[Connection | None, float | None]:
        """The longest idle connection (for grace_s at least) of whichever of `hosts` holds the
        most connections and has one; else None and when the first idle one's grace ends."""
        idlest: dict[str, Connection] = {}
        retry_at = None
        for conn in self.open.values():
            if conn.requests or conn.host not in hosts:
                continue
            if now - conn.idle_since < self.limits.grace_s:
                ready = conn.idle_since + self.limits.grace_s
                retry_at = ready if retry_at is None else min(retry_at, ready)
            elif conn.host not in idlest or conn.idle_since < idlest[conn.host].idle_since:
                idlest[conn.host] = conn
        if not idlest:
            return None, retry_at
        return max(idlest.values(), key=lambda c: self.held[c.host]), None

    def drop(self, conn: Connection) -> None:
        if self.open.get(conn.peer) is not conn:
            return  # taken out already to make room
        del self.open[conn.peer]
        self.held[conn.host] -= 1
        if self.held[conn.host] <= 0:
            del self.held[conn.host]
        self.freed.set()
        self.freed = trio.Event()

    @contextmanager
    def request(self, peer: tuple[str, int]) -> Iterator[None]:
        """A request under way on `peer`'s connection for the block: it is not closed meanwhile."""
        conn = self.open.get(peer)
        if conn is not None:
            conn.requests += 1
        try:
            yield
        finally:
            if conn is not None:
                conn.requests -= 1
                conn.idle_since = self.clock()
                self.freed.set()  # it may make room once its grace is over
                self.freed = trio.Event()


async def find_place(table: ConnectionTable, peer: tuple[str, int]):
    """table.admit, waiting up to the limits' wait_s for room; TooManyConnections after."""
    deadline = time.monotonic() + table.limits.wait_s
    while True:
        try:
            return table.admit(peer)
        except TooManyConnections as exc:
            now = time.monotonic()
            if now >= deadline:
                table.refused += 1
                raise
            until = deadline if exc.retry_at is None else min(deadline, exc.retry_at)
            with trio.move_on_after(max(0.0, until - now)):
                await table.freed.wait()


def counting_requests(app: Any, table: ConnectionTable) -> Any:
    """`app` (ASGI), telling `table` which connections have a request under way."""

    async def counted(scope, receive, send) -> None:
        client = scope.get("client")
        if scope["type"] == "lifespan" or not client:
            return await app(scope, receive, send)
        with table.request((client[0], client[1])):
            await app(scope, receive, send)

    return counted


async def serve(
    app: Any,
    config: Any,
    limits: ConnectionLimits,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI `app` on `config.bind` (a hypercorn Config, plain HTTP) within `limits`;
    starts with the URLs bound. ASGI lifespan events are not sent: our apps keep no state
    between startup and shutdown."""
    from hypercorn.trio.tcp_server import TCPServer
    from hypercorn.trio.worker_context import WorkerContext
    from hypercorn.utils import repr_socket_addr, wrap_app

    if config.ssl_enabled:
        raise ValueError("swarm.http_server serves plain HTTP; put TLS in front of it")
    table = ConnectionTable(limits)
    wrapped = wrap_app(counting_requests(app, table), config.wsgi_max_body_size, "asgi")
    context = WorkerContext(None)
    # every connection task holds one: admitted, waiting for a place, refused, being closed
    room = trio.Semaphore(limits.total + WAITING)

    async def handle(stream: trio.SocketStream) -> None:
        try:
            peer = stream.socket.getpeername()
            try:
                conn, victim = await find_place(table, (peer[0], peer[1]))
            except TooManyConnections as exc:
                await refuse(stream, str(exc))
                return
            if victim is not None:
                victim.scope.cancel()
            try:
                with conn.scope:
                    await TCPServer(wrapped, config, context, {}, stream)
            finally:
                table.drop(conn)
        except OSError:
            pass  # the client left before we looked
        finally:
            await trio.aclose_forcefully(stream)
            room.release()

    sockets = config.create_sockets().insecure_sockets
    binds = []
    async with trio.open_nursery() as nursery:
        for sock in sockets:
            sock.listen(config.backlog)
            listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
            nursery.start_soon(accept_loop, listener, room, nursery, handle)
            binds.append("http://" + repr_socket_addr(sock.family, sock.getsockname()))
        nursery.start_soon(report, table)
        task_status.started(binds)


async def accept_loop(listener, room: trio.Semaphore, nursery, handle) -> None:
    while True:
        await room.acquire()  # while full, connections wait in the kernel's backlog
        try:
            stream = await listener.accept()
        except OSError as exc:
            room.release()
            if exc.errno not in CAPACITY_ERRNOS:
                raise
            log.warning("cannot accept a connection (%s); retrying in 0.1 s", exc)
            await trio.sleep(0.1)
            continue
        nursery.start_soon(handle, stream)


async def refuse(stream: trio.SocketStream, reason: str) -> None:
    """A 503 saying `reason` (an OpenAI-style error body), then close."""
    body = json.dumps(
        {
            "error": {
                "message": reason,
                "type": "server_busy",
                "param": None,
                "code": "too_many_connections",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
    ).encode()
    with trio.move_on_after(REFUSAL_LINGER_S):
        try:
            await stream.send_all(head + body)
            await stream.send_eof()
            # closing with the request unread would reset the connection, and a reset can
            # reach the client before it has read the 503: read until it closes
            while await stream.receive_some(1 << 16):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass


async def report(table: ConnectionTable) -> None:
    while True:
        await trio.sleep(REPORT_EVERY_S)
        if table.refused or table.evicted:
            log.warning(
                "connections: %d refused, %d without a request closed to make room in %.0f s"
                " (%d open of %d; one address may hold %d)",
                table.refused,
                table.evicted,
                REPORT_EVERY_S,
                len(table.open),
                table.total,
                table.per_caller,
            )
            table.refused = table.evicted = 0
