"""The background collector: reads the DHT and pings nodes on a cadence, publishes snapshots.

Requests only ever read `Collector.snapshot`, an immutable object swapped in whole, so a slow
DHT or a hung node delays the next snapshot, never a page.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from swarm import __version__
from swarm.dht import SwarmView, read_swarm, start_dht
from swarm.errors import DhtBusy
from swarm.health.snapshot import DhtStatus, Known, Snapshot, build_model_view
from swarm.options import non_negative_float, option, positive_float
from swarm.records import MAX_LAYERS, MAX_MODELS, ModelRecord, Reported
from swarm.transport import Reach, ping

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CollectorConfig:
    """What the collector reads, how often, and how long it waits; the option fields are
    `python -m swarm.health`'s flags (swarm/options.py)."""

    initial_peers: tuple[str, ...]
    dht_host: str = option("127.0.0.1", "address the DHT peer listens on")
    interval: float = option(
        5.0,  # between the starts of two refreshes
        "seconds between DHT reads and pings",
        type=positive_float,
        metavar="SECONDS",
    )
    dht_start_timeout: float = 60.0
    dht_timeout: float = option(
        15.0,
        "give up on one DHT read after this many seconds",
        type=positive_float,
        metavar="SECONDS",
    )
    ping_timeout: float = option(
        3.0,  # connect plus all ping rounds to one node
        "mark a node unreachable if it does not answer within this many seconds",
        type=positive_float,
        metavar="SECONDS",
    )
    ping_rounds: int = 3  # the best round trip of these is the node's figure
    ping_concurrency: int = 64
    forget_after: float = option(
        600.0,
        "seconds an expired node stays listed",
        type=non_negative_float,
        metavar="SECONDS",
    )
    max_models: int = MAX_MODELS
    max_layers: int = MAX_LAYERS

    @property
    def stale_after(self) -> float:
        """Seconds without a good DHT read after which /healthz reports trouble."""
        return 3 * self.interval + self.dht_timeout + self.ping_timeout


class Collector:
    """Owns the health server's DHT peer and the latest snapshot.

    The DHT starter, the survey and the ping are arguments so tests can stand in a slow or
    broken DHT without starting one.
    """

    def __init__(
        self,
        config: CollectorConfig,
        *,
        dht_starter: Callable[[CollectorConfig], Any] | None = None,
        surveyor: Callable[..., SwarmView] = read_swarm,
        pinger: Callable[..., Awaitable[Reach]] = ping,
        clock: Callable[[], float] = time.time,
    ):
        self.config = config
        self._start_dht = dht_starter or _start_client_dht
        self._survey = surveyor
        self._ping = pinger
        self._clock = clock
        self._dht: Any = None
        self._dht_lock = threading.Lock()
        self._status = DhtStatus("starting")
        self._models: dict[str, ModelRecord] = {}
        self._known: dict[tuple[str, str], Known] = {}  # (model, peer)
        self._reports: dict[str, dict[str, Reported]] = {}  # model -> peer -> (last read)
        self._skipped = 0
        self._serial = 0
        self.snapshot = self._build({})

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Refresh forever; shuts the DHT peer down when cancelled."""
        task_status.started()
        try:
            while True:
                began = trio.current_time()
                await self.refresh()
                await trio.sleep_until(began + self.config.interval)
        finally:
            if self._dht is not None:
                dht, self._dht = self._dht, None
                with trio.CancelScope(shield=True), trio.move_on_after(10):
                    await trio.to_thread.run_sync(dht.shutdown, abandon_on_cancel=True)

    async def refresh(self) -> Snapshot:
        """One cycle: survey the DHT, ping every current node, publish a new snapshot."""
        await self._read()
        reach = await self._ping_all()
        self.snapshot = self._build(reach)
        return self.snapshot

    async def _read(self) -> None:
        cfg = self.config
        if self._dht is None:
            try:
                self._dht = await self._blocking(
                    lambda: self._start_dht(cfg), cfg.dht_start_timeout
                )
            except Exception as exc:
                self._fail(f"cannot join the DHT: {_reason(exc, cfg.dht_start_timeout)}")
                return
        began = time.perf_counter()
        dht = self._dht
        try:
            view = await self._blocking(
                lambda: self._survey(dht, cfg.max_models, cfg.max_layers), cfg.dht_timeout
            )
        except Exception as exc:
            self._fail(f"DHT read failed: {_reason(exc, cfg.dht_timeout)}")
            return
        now = self._clock()
        self._status = DhtStatus("ok", last_ok=now, read_seconds=time.perf_counter() - began)
        self._skipped = view.malformed
        for name, records in view.nodes.items():
            for rec in records:
                exp = view.expirations.get((name, rec.peer), now)
                self._known[(name, rec.peer)] = Known(rec, exp)
        self._models.update(view.models)
        self._reports = view.reports
        self._forget(now, set(view.models))

    def _fail(self, error: str) -> None:
        s = self._status
        if error != s.error:  # once per kind of trouble, not once per cycle
            log.warning("%s", error)
        state = "starting" if s.last_ok is None else "failing"
        self._status = DhtStatus(state, s.last_ok, s.read_seconds, error)
        self._forget(self._clock(), set(self._models))

    def _forget(self, now: float, listed: set[str]) -> None:
        for key, k in list(self._known.items()):
            if k.expires + self.config.forget_after < now:
                del self._known[key]
        with_nodes = {name for name, _ in self._known}
        for name in list(self._models):
            if name not in listed and name not in with_nodes:
                del self._models[name]

    async def _blocking(self, fn: Callable[[], Any], timeout: float) -> Any:
        # hivemind calls block and cannot be interrupted: on timeout the thread is abandoned,
        # and the lock keeps a second call off the DHT's pipe until the first one returns
        def guarded() -> Any:
            if not self._dht_lock.acquire(blocking=False):
                raise DhtBusy("the previous DHT call has not returned yet")
            try:
                return fn()
            finally:
                self._dht_lock.release()

        with trio.fail_after(timeout):
            return await trio.to_thread.run_sync(guarded, abandon_on_cancel=True)

    async def _ping_all(self) -> dict[str, Reach]:
        now = self._clock()
        hops = {  # keyed as snapshot.py looks them up: nodes behind one relay share its address
            k.record.dial_key: k.record.hop() for k in self._known.values() if k.expires > now
        }
        results: dict[str, Reach] = {}
        limiter = trio.CapacityLimiter(self.config.ping_concurrency)

        async def one(link: str, hop) -> None:
            async with limiter:
                results[link] = await self._ping(
                    hop, timeout=self.config.ping_timeout, rounds=self.config.ping_rounds
                )

        async with trio.open_nursery() as nursery:
            for link, hop in sorted(hops.items()):
                nursery.start_soon(one, link, hop)
        return results

    def _build(self, reach: dict[str, Reach]) -> Snapshot:
        now = self._clock()
        models = []
        for name in sorted(self._models):
            known = [k for (m, _), k in self._known.items() if m == name]
            reports = self._reports.get(name, {})
            models.append(build_model_view(self._models[name], known, reach, now, reports))
        self._serial += 1
        return Snapshot(
            taken_at=now,
            dht=self._status,
            skipped_records=self._skipped,
            models=tuple(models),
            refresh_interval=self.config.interval,
            version=__version__,
            serial=self._serial,
        )


def _start_client_dht(cfg: CollectorConfig) -> Any:
    return start_dht(cfg.initial_peers, host=cfg.dht_host, client_mode=True)


def _reason(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, trio.TooSlowError):
        return f"no answer within {timeout:g} s"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
