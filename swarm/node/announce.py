"""Keeps this node's records on the DHT fresh, and marks them offline when it leaves."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import trio

from swarm import __version__
from swarm.dht import NodeKey, announce
from swarm.node.status import Status
from swarm.records import BOTH, ONLINE, NodeRecord

log = logging.getLogger("swarm.node")

ANNOUNCE_TIMEOUT = 15.0


class Announcer:
    """A node's records of one span, written under its `key` through `dht` (started with it)."""

    def __init__(
        self,
        dht,
        key: NodeKey,
        addr: str,
        model: str,
        num_layers: int,
        fingerprint: str,
        start: int,
        end: int,
        ttl: float,
        tls: str = "",
        arch: str = "",
        role: str = BOTH,
    ):
        self.dht, self.key = dht, key
        self.peer, self.addr, self.model = key.peer, addr, model
        self.num_layers, self.fingerprint = num_layers, fingerprint
        self.start, self.end, self.ttl = start, end, ttl
        self.tls, self.arch, self.role = tls, arch, role
        self.relay = ""  # the relay's peer id while nobody can dial this node directly
        self.reach = ""  # what the dial-back check found (swarm.records.NodeRecord.reach)

    def record(self, state: str, status: Status | None = None) -> NodeRecord:
        """The record of this node's span in `state`, carrying `status` (default: not serving
        yet)."""
        from hivemind.utils import get_dht_time

        status = status or Status()

        return NodeRecord(
            peer=self.peer,
            addr=self.addr,
            model=self.model,
            start=self.start,
            end=self.end,
            state=state,
            fingerprint=self.fingerprint,
            version=__version__,
            num_layers=self.num_layers,
            free_cache_tokens=status.free_cache_tokens,
            throughput=round(status.throughput, 2),
            link=status.link,
            weights=status.weights,
            sessions=status.sessions,
            decode_batch=round(status.decode_batch, 3),
            throttled=status.throttled,
            decode_passes=status.decode_passes,
            prompt_passes=status.prompt_passes,
            moved_in=status.moved_in,
            moved_out=status.moved_out,
            transfers=status.transfers,
            tls=self.tls,
            relay=self.relay,
            reach=self.reach,
            arch=self.arch,
            role=self.role,
            lent_mb=round(status.lent_mb, 2),
            borrowing=status.borrowing,
            lend_free_mb=math.floor(status.lend_free_mb * 100) / 100,  # never more than it has
            cache_tokens=status.cache_tokens,
            borrow_tokens=status.borrow_tokens,
            session_tokens=status.session_tokens,
            updated=get_dht_time(),
        )

    async def publish(
        self, state: str, status: Status | None = None, ttl: float | None = None
    ) -> None:
        rec = self.record(state, status)
        if not self.dht.is_alive():
            # every request would wait forever: say so rather than time out each time
            log.error(
                "announce %s failed: the DHT process exited (code %s)", state, self.dht.exitcode
            )
            return
        try:
            with trio.fail_after(ANNOUNCE_TIMEOUT):
                stored = await trio.to_thread.run_sync(
                    announce, self.dht, [rec], ttl or self.ttl, self.key, abandon_on_cancel=True
                )
        except trio.TooSlowError:
            log.warning(
                "announce %s failed: no answer from the DHT in %.0f s", state, ANNOUNCE_TIMEOUT
            )
            return
        except Exception as exc:  # the DHT being slow must not take the data plane down
            log.warning("announce %s failed: %s: %s", state, type(exc).__name__, exc)
            return
        log.debug("announced %s to %d keys", state, stored)

    async def keep_fresh(self, read: Callable[[], Status]) -> None:
        """Announce the node online with `read()`'s figures every third of the TTL."""
        while True:
            await self.publish(ONLINE, read())
            await trio.sleep(self.ttl / 3)
