"""Which next hops an open may name: only a peer at the address the DHT announces for it.

An open's route carries host:port for every hop, and the node connects to the next one; taking
a stranger's word for the address would let anyone make a volunteer's PC dial any address.
So the node checks the next hop against the records of its model's nodes (online, serving the
hop's blocks, at that address). It reads them from the DHT at most every `refresh_s` seconds,
whatever the opens ask: a hop not found waits for the next two reads, then is refused.

The hop's TLS key id must be the record's too: the node then dials with that key, so a peer
answering at the address without the record owner's key is refused (swarm.tls). A hop without
a key (a plaintext node) is refused unless this node runs plaintext itself (an experiment).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

import trio

from swarm.address import parse_host_port
from swarm.dht import read_lenders, read_nodes
from swarm.errors import UnannouncedPeer
from swarm.protocol import Hop
from swarm.records import ONLINE, NodeRecord

log = logging.getLogger("swarm.node")

REFRESH_S = 2.0
READS = 2  # reads a hop not found waits for before it is refused
READ_TIMEOUT_S = 10.0


class PeerDirectory:
    def __init__(
        self,
        read: Callable[[], Sequence[NodeRecord]],
        refresh_s: float = REFRESH_S,
        plaintext: bool = False,
    ):
        """`read`: the model's node records, blocking (it runs in a thread); `plaintext`: may
        dial next hops without TLS."""
        self._read = read
        self.plaintext = plaintext
        self.refresh_s = refresh_s
        self._records: dict[str, NodeRecord] = {}
        self._read_at = -math.inf
        self._lock = trio.Lock()

    @classmethod
    def of_dht(cls, dht, model: str, num_layers: int, plaintext: bool = False) -> PeerDirectory:
        """The directory of `model`'s nodes as `dht` finds them."""

        def read() -> list[NodeRecord]:  # lenders too: they serve no blocks, nobody dials them
            return read_nodes(dht, model, num_layers)[0] + read_lenders(dht, model)

        return cls(read, plaintext=plaintext)

    def announced(self, hop: Hop) -> bool:
        rec = self._records.get(hop.peer)
        if rec is None or rec.state != ONLINE or not rec.start <= hop.start < hop.end <= rec.end:
            return False
        if (rec.tls, rec.relay) != (hop.tls, hop.relay):
            return False
        try:
            return parse_host_port(rec.addr) == (hop.host, hop.port)
        except ValueError:
            return False

    async def check(self, hop: Hop) -> None:
        """Return if `hop` is announced; else read the DHT again, twice at most (each read no
        sooner than `refresh_s` after the one before: a node that has just come online may not
        have reached every DHT peer yet), and raise UnannouncedPeer if it still is not."""
        if not hop.tls and not self.plaintext:
            raise UnannouncedPeer(
                f"the next hop {hop.addr[:80]} runs without TLS; this node forwards only over"
                " TLS (both must run --plaintext for that experiment)"
            )
        for _ in range(READS):
            if self.announced(hop):
                return
            read_at = self._read_at
            async with self._lock:
                if self._read_at == read_at:  # nobody read while this one waited for the lock
                    await trio.sleep(max(0.0, self._read_at + self.refresh_s - time.monotonic()))
                    await self._refresh()
        if not self.announced(hop):
            raise UnannouncedPeer(
                f"the DHT announces no online node {hop.peer[:16] or '(none named)'} serving"
                f" blocks {hop.start}:{hop.end} at {hop.addr[:80]}; this node dials only those"
            )

    async def record(self, peer: str) -> NodeRecord | None:
        """`peer`'s record, whatever its state (a leaving node announces itself offline), read
        again once if it is not known yet; None if the DHT has none."""
        if peer not in self._records:
            async with self._lock:
                if peer not in self._records:
                    await self._refresh()
        return self._records.get(peer)

    def seed(self, records: Sequence[NodeRecord]) -> None:
        """Records just read elsewhere: no need to read them again before dialling."""
        self._records = {r.peer: r for r in records}
        self._read_at = time.monotonic()

    async def fresh(self) -> list[NodeRecord]:
        """The records as the DHT holds them now (read again, unless read within `refresh_s`)."""
        async with self._lock:
            if time.monotonic() - self._read_at >= self.refresh_s:
                await self._refresh()
        return self.records()

    async def keep_read(self, every: float) -> None:
        """Read the DHT every `every` seconds, whether or not anything asks: what the node
        announces it could borrow counts the lenders as last read (swarm.node.status)."""
        while True:
            await self.fresh()
            await trio.sleep(every)

    def records(self) -> list[NodeRecord]:
        """The records as last read."""
        return list(self._records.values())

    async def _refresh(self) -> None:
        try:
            with trio.fail_after(READ_TIMEOUT_S):
                records = await trio.to_thread.run_sync(self._read, abandon_on_cancel=True)
        except Exception as exc:  # a slow or broken DHT refuses hops; it must not kill opens
            log.warning("reading the announced peers failed: %s: %s", type(exc).__name__, exc)
            records = None
        self._read_at = time.monotonic()
        if records is not None:
            self._records = {r.peer: r for r in records}
