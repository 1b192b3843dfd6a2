"""A crowd of synthetic nodes, for tests and benchmarks of routing in a large swarm on one
machine: records of many nodes, each signed by a key of its own (the swarm's validators accept
them), each naming an address of its own on loopback (127.0.0.2, 127.0.0.3, ...), where a
forwarder counts connections and passes them to a real node serving the same span. A ping to
any of them gets a real node's pong over TLS with that node's key, which the record names."""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import trio
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from devtools.stranger import new_key, stranger_dht
from swarm.dht import run_in_dht
from swarm.records import NodeRecord, block_key

BATCH = 8  # records a request to the DHT process carries (it must stay under 16 KiB)


class ManyKeys(RSASignatureValidator):
    """Signs each value with the key its subkey names: one DHT peer writing as many nodes."""

    def __init__(self, keys):
        super().__init__(keys[0])
        self._keys = {RSASignatureValidator(k).local_public_key: k for k in keys}

    def sign_value(self, record) -> bytes:
        found = self._PUBLIC_KEY_RE.search(record.subkey or b"")  # the subkey arrives serialized
        key = found and self._keys.get(found.group(0))
        if key is None:
            return record.value
        signature = key.sign(self._serialize_record(record))
        return record.value + self.SIGNATURE_FORMAT.replace(b"_value_", signature)


async def _store(_dht, node, items, expiration):
    keys = [k for ks, _, _ in items for k in ks]
    values = [v for ks, v, _ in items for _ in ks]
    subkeys = [s for ks, _, s in items for _ in ks]
    found = await node.store_many(keys, values, expiration_time=expiration, subkeys=subkeys)
    return sum(bool(v) for v in found.values())


class Forwarders:
    """Listeners at (127.0.0.k, port) that count who connects and pass the bytes on to a real
    node; run on a trio loop of their own in a thread."""

    def __init__(self) -> None:
        self.accepted: Counter[str] = Counter()  # "host:port" -> connections
        self._token: trio.lowlevel.TrioToken | None = None
        self._cancel: trio.CancelScope | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)
        self._thread.start()
        self._ready.wait()

    @property
    def total(self) -> int:
        return sum(self.accepted.values())

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            with trio.CancelScope() as self._cancel:
                self._ready.set()
                await trio.sleep_forever()
            nursery.cancel_scope.cancel()

    def add(self, host: str, target: tuple[str, int]) -> str:
        """A listener on `host` forwarding to `target`; returns its "host:port"."""
        return trio.from_thread.run(self._add, host, target, trio_token=self._token)

    async def _add(self, host: str, target: tuple[str, int]) -> str:
        listeners = await trio.open_tcp_listeners(0, host=host)
        addr = f"{host}:{listeners[0].socket.getsockname()[1]}"

        async def forward(client: trio.SocketStream) -> None:
            self.accepted[addr] += 1
            try:
                server = await trio.open_tcp_stream(*target)
            except OSError:
                return await client.aclose()
            async with client, server, trio.open_nursery() as pipes:
                pipes.start_soon(_pipe, client, server, pipes.cancel_scope)
                pipes.start_soon(_pipe, server, client, pipes.cancel_scope)

        self._nursery.start_soon(trio.serve_listeners, forward, listeners)
        return addr

    def close(self) -> None:
        if self._thread.is_alive():
            trio.from_thread.run_sync(self._cancel.cancel, trio_token=self._token)
            self._thread.join(5)


async def _pipe(src: trio.SocketStream, dst: trio.SocketStream, scope: trio.CancelScope) -> None:
    try:
        async for data in src:
            await dst.send_all(data)
    except trio.BrokenResourceError:
        pass
    scope.cancel()  # either side closing ends the connection


class Crowd:
    """`count` synthetic nodes copying the records of `real` (in turn), announced by one
    stranger DHT peer joined to `peers`; close() takes them down."""

    def __init__(self, peers: Sequence[str], real: Sequence[NodeRecord], count: int, ttl=240.0):
        self.forwarders = Forwarders()
        keys = [new_key() for _ in range(count)]
        self.dht = stranger_dht(list(peers), validators=[ManyKeys([k for k, _, _ in keys])])
        self.records: list[tuple[NodeRecord, bytes]] = []
        for i, (_key, marker, peer) in enumerate(keys):
            model = real[i % len(real)]
            host = f"127.0.{2 + i // 250}.{2 + i % 250}"
            addr = self.forwarders.add(host, model.host_port)
            rec = replace(model, peer=peer, addr=addr, updated=get_dht_time(), relay="")
            self.records.append((rec, marker))
        self.announce(ttl)

    def announce(self, ttl: float) -> int:
        """Store every synthetic record again (they expire after `ttl` seconds)."""
        stored = 0
        expiration = get_dht_time() + ttl
        for i in range(0, len(self.records), BATCH):
            items = [
                ([block_key(r.model, b) for b in range(r.start, r.end)], r.to_wire(), marker)
                for r, marker in self.records[i : i + BATCH]
            ]
            request = functools.partial(_store, items=items, expiration=expiration)
            stored += run_in_dht(self.dht, request)
        return stored

    def close(self) -> None:
        self.dht.shutdown()
        self.forwarders.close()
