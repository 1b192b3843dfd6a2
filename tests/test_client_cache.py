"""The clients `swarm.client.generate` keeps for reuse: one pushed out of the cache is closed,
once no reply streams through it any more."""

from __future__ import annotations

import swarm.client
from swarm.client import get_client
from swarm.client.cache import ClientCache


class FakeClient:
    """Stands in for a Client (a DHT process and a loop thread): only whether it was closed."""

    def __init__(self, initial_peers=(), model=None, wire_dtype=None):
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_a_client_pushed_out_of_the_process_cache_is_closed(monkeypatch):
    monkeypatch.setattr(swarm.client, "Client", FakeClient)
    first = get_client(["/fake/first"])
    later = [get_client([f"/fake/{i}"]) for i in range(8)]
    assert first.closed
    assert not later[-1].closed and get_client(["/fake/7"]) is later[-1]


def test_a_client_pushed_out_while_a_reply_streams_is_closed_when_the_reply_ends():
    cache = ClientCache(1)
    with cache.use("a", FakeClient) as streaming:
        other = cache.get("b", FakeClient)
        assert not streaming.closed
    assert streaming.closed and not other.closed


def test_closing_the_cache_closes_its_clients():
    cache = ClientCache(2)
    clients = [cache.get(key, FakeClient) for key in "ab"]
    cache.close()
    assert all(c.closed for c in clients)
