"""A few Clients kept open for reuse, one per key; the one least recently used gives way.

A Client holds a DHT process and a loop thread: one pushed out is closed, else they run on
until the process exits. A reply still streaming through it keeps it open until it ends.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

from swarm.client.client import Client


class ClientCache:
    """At most `size` clients; making one (a DHT start) holds up other threads asking."""

    def __init__(self, size: int):
        if size < 1:
            raise ValueError(f"a client cache holds at least 1 client, not {size}")
        self.size = size
        self._clients: OrderedDict[Hashable, Client] = OrderedDict()
        self._users: dict[Client, int] = {}  # replies streaming through each client
        self._lock = threading.Lock()  # one Client per key, whatever the threads

    def get(self, key: Hashable, make: Callable[[], Client]) -> Client:
        """The client for `key`, made by `make()` if there is none."""
        with self.use(key, make) as client:
            return client

    @contextmanager
    def use(self, key: Hashable, make: Callable[[], Client]) -> Iterator[Client]:
        """The client for `key`, left open until the block ends even if it is pushed out."""
        with self._lock:
            client = self._clients.pop(key, None) or make()
            self._clients[key] = client  # now the most recently used
            self._users[client] = self._users.get(client, 0) + 1
            pushed_out = (
                self._clients.popitem(last=False)[1] if len(self._clients) > self.size else None
            )
        if pushed_out is not None:
            self._release(pushed_out, 0)
        try:
            yield client
        finally:
            self._release(client, 1)

    def _release(self, client: Client, users: int) -> None:
        """`users` fewer replies use `client`; close it if it is out of the cache and unused."""
        with self._lock:
            left = self._users.pop(client, 0) - users
            if left:
                self._users[client] = left
            close = not left and client not in self._clients.values()
        if close:
            client.close()

    def close(self) -> None:
        """Close every client held (one still streaming, when its reply ends)."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), OrderedDict()
        for client in clients:
            self._release(client, 0)
