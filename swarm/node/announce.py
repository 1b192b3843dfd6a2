"""Keeps this node's records on the DHT fresh, and marks them offline when it leaves."""

from __future__ import annotations

import logging
import time

import trio

from swarm import __version__
from swarm.dht import announce
from swarm.records import DEFAULT_WEIGHTS, NodeRecord

log = logging.getLogger("swarm.node")

ANNOUNCE_TIMEOUT = 15.0


class Announcer:
    def __init__(
        self,
        dht,
        peer: str,
        addr: str,
        model: str,
        num_layers: int,
        fingerprint: str,
        start: int,
        end: int,
        ttl: float,
        tls: str = "",
    ):
        self.dht = dht
        self.peer, self.addr, self.model = peer, addr, model
        self.num_layers, self.fingerprint = num_layers, fingerprint
        self.start, self.end, self.ttl = start, end, ttl
        self.tls = tls
        self.relay = ""  # the relay's peer id while nobody can dial this node directly
        self.reach = ""  # what the dial-back check found (swarm.records.NodeRecord.reach)

    def record(self, state: str, node=None) -> NodeRecord:
        from hivemind.utils import get_dht_time

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
            free_cache_tokens=node.sessions.free_cache_tokens if node else 0,
            throughput=round(node.throughput, 2) if node else 0.0,
            link=node.uplink.stats() if node else {},
            weights=node.span.format if node else DEFAULT_WEIGHTS,
            sessions=len(node.sessions) if node else 0,
            decode_batch=round(node.compute.mean_decode_batch, 3) if node else 1.0,
            throttled=node.throttle.recent(time.monotonic()) if node else 0,
            decode_passes=node.compute.decode_passes if node else 0,
            tls=self.tls,
            relay=self.relay,
            reach=self.reach,
            updated=get_dht_time(),
        )

    async def publish(self, state: str, node=None, ttl: float | None = None) -> None:
        rec = self.record(state, node)
        if not self.dht.is_alive():
            # every request would wait forever: say so rather than time out each time
            log.error(
                "announce %s failed: the DHT process exited (code %s)", state, self.dht.exitcode
            )
            return
        try:
            with trio.fail_after(ANNOUNCE_TIMEOUT):
                stored = await trio.to_thread.run_sync(
                    announce, self.dht, [rec], ttl or self.ttl, abandon_on_cancel=True
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

    async def keep_fresh(self, node) -> None:
        while True:
            await self.publish("online", node)
            await trio.sleep(self.ttl / 3)
