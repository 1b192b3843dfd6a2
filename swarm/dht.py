"""The control plane: start a hivemind DHT peer, announce node records, read them back.

hivemind runs its DHT in a child process; `run_coroutine` pickles the function it is given,
so the coroutines here are module-level functions bound with functools.partial.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from swarm.errors import DhtGone
from swarm.records import (
    CACHE,
    MAX_LAYERS,
    MAX_MODELS,
    MAX_TTL_S,
    MODELS_KEY,
    ModelRecord,
    NodeRecord,
    Report,
    Reported,
    ReportRecord,
    block_key,
    lenders_key,
    reports_key,
)

log = logging.getLogger(__name__)

CLOCK_SKEW_S = 60.0  # a record dated further ahead of this clock would outdate honest ones
MAX_ENTRIES_PER_KEY = 256  # records read under one key (a block's nodes); the rest are counted
MAX_REPORTED_SPANS = 8  # distinct block ranges kept of the reports on one node


def start_dht(
    initial_peers: Sequence[str] = (),
    host: str = "127.0.0.1",
    client_mode: bool = False,
    nice: int = 0,
    key: NodeKey | None = None,
):
    """Start a DHT peer with signed-record validation. No initial peers: a new swarm.
    `nice`: steps the DHT process (and the p2p daemon it starts) runs below this one's.
    `key`: the one it signs records with (default: the process's, NodeKey.process_wide); a
    record it stores is signed only where its subkey is that key's (`announce(..., key)`)."""
    import hivemind
    from hivemind.dht.crypto import RSASignatureValidator

    from swarm.dht_validator import SwarmValidator

    parent = os.getpid()
    key = key or NodeKey.process_wide()

    class DHT(hivemind.DHT):
        def run(self) -> None:  # in the forked DHT process
            from swarm.process import watch_parent

            watch_parent(parent)  # a node killed with -9 must not leave its DHT process serving
            if nice:
                os.nice(nice)
            super().run()

    return DHT(
        initial_peers=list(initial_peers),
        host_maddrs=[f"/ip4/{host}/tcp/0"],
        client_mode=client_mode,
        # hivemind's DHT is a fork of this process: the validator built here, key and all, is
        # the one the DHT process signs with (no pickling, nothing process-wide read there)
        record_validators=[RSASignatureValidator(key.key), SwarmValidator()],
        start=True,
    )


def id_of(subkey: bytes) -> str:
    """The node id a signed subkey proves. A record names its node, but only the holder of the
    key a subkey names can sign under it, so readers trust the id the key gives, not the name."""
    return hashlib.sha256(subkey).hexdigest()[:40]


@dataclass(frozen=True)
class NodeKey:
    """A node's signing key: its records are written under it and its claims (a hand-over's end,
    a relay's answer) signed with it; `peer` is the node id that key proves."""

    key: object  # hivemind.utils.crypto.RSAPrivateKey

    @classmethod
    def generate(cls) -> NodeKey:
        """A new key: a node of its own, whatever else runs in this process."""
        from hivemind.utils.crypto import RSAPrivateKey

        return cls(RSAPrivateKey())

    @classmethod
    def process_wide(cls) -> NodeKey:
        """hivemind's one key a process: what a DHT peer started without a key signs with."""
        from hivemind.utils.crypto import RSAPrivateKey

        return cls(RSAPrivateKey.process_wide())

    @functools.cached_property
    def subkey(self) -> bytes:
        """The public-key marker records are written under: only this key can sign them."""
        from hivemind.dht.crypto import RSASignatureValidator

        return RSASignatureValidator(self.key).local_public_key

    @property
    def peer(self) -> str:
        return id_of(self.subkey)

    def sign(self, data: bytes) -> tuple[str, str]:
        """The key as subkeys name it, and its signature of `data`."""
        return self.subkey.decode(), self.key.sign(data).decode()


def node_id() -> str:
    """The node id the process's key proves (NodeKey.process_wide): a node's own is its key's."""
    return NodeKey.process_wide().peer


def sign_as_node(data: bytes) -> tuple[str, str]:
    """`data` signed with the process's key (NodeKey.process_wide().sign)."""
    return NodeKey.process_wide().sign(data)


def proves(peer: str, key: str, data: bytes, proof: str) -> bool:
    """Whether `proof` is `key`'s signature of `data`, `key` being the one behind node id `peer`."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.utils.crypto import RSAPublicKey

    marker = key.encode()
    found = re.fullmatch(RSASignatureValidator.PUBLIC_KEY_REGEX, marker)
    if found is None or id_of(marker) != peer:
        return False
    try:
        return RSAPublicKey.from_bytes(found.group(1)).verify(data, proof.encode())
    except (ValueError, TypeError):  # not a key, or not base64
        return False


def visible_maddrs(dht) -> list[str]:
    return [str(m) for m in dht.get_visible_maddrs()]


# multiprocessing writes a message over 16 KiB to a pipe in two parts, and hivemind's DHT process
# reads its request pipe non-blocking (uvloop's add_reader): if it wakes between the parts, the
# read fails half-way, the next one parses garbage, and the DHT process dies (hivemind 1.1.12).
# Every later request then waits forever, so a request must stay under this size.
MAX_REQUEST_BYTES = 16 * 1024
# hivemind's DHT.run_coroutine writes to that pipe without a lock, and a client's sessions route
# from several threads at once: an API server's DHT process went defunct under concurrent
# requests (cause not proven; interleaved writes are one candidate). One request crosses at a
# time; the answers are awaited outside the lock, with a timeout, so a dead DHT is an error.
_PIPE_LOCK = threading.Lock()


def run_in_dht(dht, request, timeout: float = 60.0):
    """`dht.run_coroutine(request)`, its request sent under this process's pipe lock; DhtGone
    if the DHT process has exited or does not answer within `timeout` seconds."""
    if not dht.is_alive():
        raise DhtGone(f"the DHT process exited (code {dht.exitcode})")
    with _PIPE_LOCK:
        future = dht.run_coroutine(request, return_future=True)
    try:
        return future.result(timeout)
    except TimeoutError:
        alive = "alive" if dht.is_alive() else f"exited with code {dht.exitcode}"
        raise DhtGone(f"no answer from the DHT process in {timeout:g} s ({alive})") from None


async def _store_records(_dht, node, groups, expiration, subkey):
    """Store each (keys, value) group's value under every one of its keys (in the DHT)."""
    keys = [key for group_keys, _ in groups for key in group_keys]
    values = [value for group_keys, value in groups for _ in group_keys]
    result = await node.store_many(
        keys, values, expiration_time=expiration, subkeys=[subkey] * len(keys)
    )
    return sum(bool(v) for v in result.values())


def store_request(records: Sequence[NodeRecord], expiration: float, subkey: bytes):
    """The request that stores one record per block plus a model index entry. Each record
    crosses into the DHT process once with the keys it goes under (not once per block: 30
    copies of a record with its link figures came to over MAX_REQUEST_BYTES)."""
    groups = [
        (
            [block_key(r.model, b) for b in range(r.start, r.end)] or [lenders_key(r.model)],
            r.to_wire(),
        )
        for r in records
    ]
    first = records[0]
    index = ModelRecord(first.model, first.num_layers, first.fingerprint, first.arch)
    groups.append(([MODELS_KEY], index.to_wire()))
    return functools.partial(_store_records, groups=groups, expiration=expiration, subkey=subkey)


def announce(dht, records: Sequence[NodeRecord], ttl: float, key: NodeKey | None = None) -> int:
    """Store one record per block plus a model index entry, under `key` (the one `dht` was
    started with; default: the process's). Returns how many stores succeeded."""
    from hivemind.utils import get_dht_time

    if not records:
        return 0
    subkey = (key or NodeKey.process_wide()).subkey
    request = store_request(records, get_dht_time() + ttl, subkey)
    size = len(pickle.dumps(request))
    if size > MAX_REQUEST_BYTES - 1024:  # the rest of the message: the call and its future
        raise ValueError(f"an announcement of {size} bytes would break the DHT's request pipe")
    return run_in_dht(dht, request)


async def get_latest(_dht, node, keys):
    """{key: {subkey: (value, expiration)}} of dict records, asked of peers (run in the DHT).

    Latest: without it a cached, unexpired copy satisfies the search (for a client-mode peer,
    often its own cache, up to a TTL old), so newcomers stay unseen and leavers look online."""
    found = await node.get_many(keys, sufficient_expiration_time=float("inf"))
    out = {}
    for key, item in found.items():
        if item is None or not isinstance(item.value, dict):
            continue
        out[key] = {sub: (entry.value, entry.expiration_time) for sub, entry in item.value.items()}
    return out


@dataclass
class SwarmView:
    """Everything read from the DHT in one pass, with a count of records that failed validation."""

    models: dict[str, ModelRecord] = field(default_factory=dict)
    nodes: dict[str, list[NodeRecord]] = field(default_factory=dict)  # model -> records
    expirations: dict[tuple[str, str], float] = field(default_factory=dict)  # (model, peer)
    reports: dict[str, dict[str, Reported]] = field(default_factory=dict)  # model -> peer -> it
    malformed: int = 0


def read_models(
    dht, max_models: int = MAX_MODELS, max_layers: int = MAX_LAYERS
) -> tuple[dict[str, ModelRecord], int]:
    """The model index: the first `max_models` models by name, and how many entries were skipped.

    Anyone can write the index, and each layer of a listed model costs a DHT key to read, so
    models claiming more than `max_layers` layers, or beyond the first `max_models`, are skipped.
    """
    raw = run_in_dht(dht, functools.partial(get_latest, keys=[MODELS_KEY]))
    models: dict[str, ModelRecord] = {}
    malformed = 0
    for value, _exp in raw.get(MODELS_KEY, {}).values():
        try:
            m = ModelRecord.from_wire(value)
        except ValueError:
            malformed += 1
            continue
        if m.num_layers > max_layers:
            malformed += 1
            continue
        models.setdefault(m.model, m)
    names = sorted(models)
    malformed += len(names[max_models:])
    return {name: models[name] for name in names[:max_models]}, malformed


def read_nodes(dht, model: str, num_layers: int) -> tuple[list[NodeRecord], dict[str, float], int]:
    """Distinct node records of a model (a node is stored once per block, returned once), each
    node's newest; their expirations by node; how many entries failed validation. A record
    counts only for the node its signing key proves (`id_of`), and only if its time is not
    ahead of this clock: a stranger can neither speak for a node nor outdate its records."""
    from hivemind.utils import get_dht_time

    keys = [block_key(model, b) for b in range(num_layers)]
    raw = run_in_dht(dht, functools.partial(get_latest, keys=keys))
    latest = get_dht_time() + CLOCK_SKEW_S
    by_peer: dict[str, NodeRecord] = {}
    expirations: dict[str, float] = {}
    malformed = 0
    for key, entries in raw.items():
        block = int(key.rsplit(".", 1)[1])
        for subkey, (value, exp) in list(entries.items())[:MAX_ENTRIES_PER_KEY]:
            try:
                rec = NodeRecord.from_wire(value)
            except ValueError as exc:
                log.debug("skipping malformed record under %s: %s", key, exc)
                malformed += 1
                continue
            if (
                rec.model != model
                or not rec.start <= block < rec.end
                or rec.peer != id_of(subkey)
                or rec.updated > latest
            ):
                malformed += 1
                continue
            old = by_peer.get(rec.peer)
            if old is None or rec.updated > old.updated:
                by_peer[rec.peer] = rec
                expirations[rec.peer] = exp
        malformed += max(0, len(entries) - MAX_ENTRIES_PER_KEY)
    return list(by_peer.values()), expirations, malformed


def read_lenders(dht, model: str) -> list[NodeRecord]:
    """The `--role cache` nodes of a model (they serve no blocks: read_nodes never lists them),
    each node's newest record, a record counting only for the node its key proves."""
    from hivemind.utils import get_dht_time

    key = lenders_key(model)
    raw = run_in_dht(dht, functools.partial(get_latest, keys=[key])).get(key, {})
    latest = get_dht_time() + CLOCK_SKEW_S
    by_peer: dict[str, NodeRecord] = {}
    for subkey, (value, _exp) in list(raw.items())[:MAX_ENTRIES_PER_KEY]:
        try:
            rec = NodeRecord.from_wire(value)
        except ValueError:
            continue
        if rec.role != CACHE or rec.model != model or rec.peer != id_of(subkey):
            continue
        if rec.updated <= latest and rec.updated > getattr(by_peer.get(rec.peer), "updated", -1):
            by_peer[rec.peer] = rec
    return list(by_peer.values())


def publish_reports(
    dht,
    model: str,
    reports: Sequence[Report],
    ttl: float = MAX_TTL_S,
    key: NodeKey | None = None,
) -> bool:
    """Put `reports` on `model`'s nodes in the DHT, signed with `key` (the one `dht` was started
    with; default: the process's): they replace what that key published before, and expire
    after `ttl` seconds."""
    from hivemind.utils import get_dht_time

    request = functools.partial(
        _store_records,
        groups=[([reports_key(model)], ReportRecord(tuple(reports)).to_wire())],
        expiration=get_dht_time() + min(ttl, MAX_TTL_S),
        subkey=(key or NodeKey.process_wide()).subkey,
    )
    return bool(run_in_dht(dht, request))


def read_reports(dht, model: str) -> tuple[dict[str, Reported], int]:
    """What the reports on `model` say of each node they name, and how many entries failed
    validation. A report counts for the reporter its signing key proves (`id_of`), whatever
    it claims; reports older than MAX_TTL_S or dated ahead of this clock, and reporters past
    the first MAX_ENTRIES_PER_KEY, are skipped."""
    from hivemind.utils import get_dht_time

    key = reports_key(model)
    entries = run_in_dht(dht, functools.partial(get_latest, keys=[key])).get(key, {})
    now = get_dht_time()
    earliest, latest = now - MAX_TTL_S, now + CLOCK_SKEW_S
    found: dict[str, list[tuple[str, Report]]] = {}
    malformed = max(0, len(entries) - MAX_ENTRIES_PER_KEY)
    for subkey, (value, _exp) in list(entries.items())[:MAX_ENTRIES_PER_KEY]:
        try:
            record = ReportRecord.from_wire(value)
        except ValueError:
            malformed += 1
            continue
        for report in record.reports:
            if earliest <= report.at <= latest:
                found.setdefault(report.peer, []).append((id_of(subkey), report))
    return {
        peer: Reported(
            peer,
            frozenset(reporter for reporter, _ in said),
            tuple(sorted({(r.start, r.end) for _, r in said}))[:MAX_REPORTED_SPANS],
            max(r.at for _, r in said),
        )
        for peer, said in found.items()
    }, malformed


def read_swarm(dht, max_models: int = MAX_MODELS, max_layers: int = MAX_LAYERS) -> SwarmView:
    """Every model in the index, its nodes and the reports on them, in one pass (blocking).
    Skipped entries counted."""
    view = SwarmView()
    view.models, view.malformed = read_models(dht, max_models, max_layers)
    for name, m in view.models.items():
        nodes, exps, bad = read_nodes(dht, name, m.num_layers)
        view.nodes[name] = nodes
        view.malformed += bad
        for peer, exp in exps.items():
            view.expirations[(name, peer)] = exp
        view.reports[name], bad = read_reports(dht, name)
        view.malformed += bad
    return view
