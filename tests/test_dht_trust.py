"""Only a node writes its own record, and records are bounded: forged records from a stranger's
DHT peer (hivemind's own, without our validator) change nothing an honest reader sees."""

from __future__ import annotations

import dataclasses
import time
from functools import partial

import hivemind
import msgpack
import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from devtools.stranger import new_key, store_padded, stranger_dht
from swarm.dht import (
    NodeKey,
    announce,
    id_of,
    node_id,
    proves,
    publish_reports,
    read_models,
    read_nodes,
    read_reports,
    start_dht,
)
from swarm.records import MODELS_KEY, ModelRecord, NodeRecord, Report, block_key, reports_key

MODEL, LAYERS = "honest-model", 4
YEAR_S = 365 * 24 * 3600.0


@pytest.fixture(scope="module")
def swarm():
    """An honest DHT peer announcing a node on all blocks, and a reader joined to it."""
    honest = start_dht()
    peers = [str(m) for m in honest.get_visible_maddrs()]
    record = NodeRecord(
        peer=node_id(),
        addr="127.0.0.1:7000",
        model=MODEL,
        start=0,
        end=LAYERS,
        state="online",
        fingerprint="f" * 16,
        version="0.1.0",
        num_layers=LAYERS,
        updated=get_dht_time(),
    )
    assert announce(honest, [record], ttl=240) > 0
    reader = start_dht(peers, client_mode=True)
    yield peers, record, reader
    reader.shutdown()
    honest.shutdown()


def forge(record: NodeRecord, **changes) -> bytes:
    return msgpack.packb({**record.to_wire(), **changes})


def honest_view(reader) -> dict[str, str]:
    records, _, _ = read_nodes(reader, MODEL, LAYERS)
    return {r.peer: r.state for r in records}


def store(dht: hivemind.DHT, keys: list[str], value, subkey, expiration: float) -> None:
    for key in keys:
        dht.store(key, value, expiration, subkey=subkey, return_future=True).result(timeout=30)


def test_an_unsigned_record_cannot_hide_a_node(swarm):
    peers, record, reader = swarm
    attacker = stranger_dht(peers)
    try:
        lie = msgpack.unpackb(forge(record, state="offline", updated=get_dht_time() + YEAR_S))
        keys = [block_key(MODEL, b) for b in range(LAYERS)]
        store(attacker, keys, lie, b"anyone", get_dht_time() + YEAR_S)
        assert honest_view(reader) == {record.peer: "online"}
    finally:
        attacker.shutdown()


def test_a_record_signed_by_another_key_cannot_speak_for_a_node(swarm):
    peers, record, reader = swarm
    key = RSAPrivateKey()
    attacker = stranger_dht(peers, key)
    try:
        lie = msgpack.unpackb(forge(record, state="offline", updated=get_dht_time() + 5))
        subkey = RSASignatureValidator(key).local_public_key
        keys = [block_key(MODEL, b) for b in range(LAYERS)]
        store(attacker, keys, lie, subkey, get_dht_time() + 60)
        assert honest_view(reader) == {record.peer: "online"}
    finally:
        attacker.shutdown()


def test_a_record_dated_ahead_does_not_outdate_the_nodes_own(swarm):
    peers, record, reader = swarm
    key = RSAPrivateKey()
    attacker = stranger_dht(peers, key)
    subkey = RSASignatureValidator(key).local_public_key
    try:
        # its own record, for its own id, but dated an hour ahead: a reader skips it
        ahead = msgpack.unpackb(forge(record, peer=id_of(subkey), updated=get_dht_time() + 3600))
        store(attacker, [block_key(MODEL, 0)], ahead, subkey, get_dht_time() + 60)
        assert honest_view(reader) == {record.peer: "online"}
    finally:
        attacker.shutdown()


def test_an_oversized_record_leaves_the_block_keys_readable(swarm):
    peers, record, reader = swarm
    key = RSAPrivateKey()
    attacker = stranger_dht(peers, key)
    try:
        subkey = RSASignatureValidator(key).local_public_key
        keys = [block_key(MODEL, b) for b in range(LAYERS)]
        pad, expiration = int(3.6 * 2**20), get_dht_time() + 60
        request = partial(store_padded, keys=keys, record=record.to_wire(), pad=pad)
        attacker.run_coroutine(partial(request, subkey=subkey, expiration=expiration))
        started = time.monotonic()
        assert honest_view(reader) == {record.peer: "online"}
        assert time.monotonic() - started < 10
    finally:
        attacker.shutdown()


def test_unsigned_models_do_not_push_the_real_one_out_of_the_index(swarm):
    peers, _record, reader = swarm
    attacker = stranger_dht(peers)
    try:
        for i in range(33):
            fake = ModelRecord(f"aaa-fake-{i:02d}", 1, "0" * 16).to_wire()
            attacker.store(MODELS_KEY, fake, get_dht_time() + 60, subkey=f"fake{i}".encode())
        models, _skipped = read_models(reader)
        assert MODEL in models
        assert not [name for name in models if name.startswith("aaa-fake")]
    finally:
        attacker.shutdown()


def test_a_model_record_is_read_without_fields_it_does_not_have():
    """A node record's figures in a model index entry are ignored like any unknown field, not
    a TypeError escaping the index's reader (which skips only ValueErrors)."""
    raw = {**ModelRecord("m", 4, "0" * 16).to_wire(), "moved_in": 3, "transfers": 1}
    assert ModelRecord.from_wire(raw) == ModelRecord("m", 4, "0" * 16)


def test_two_node_keys_in_one_process_are_two_nodes(swarm):
    """Each node signs with a key of its own: two in one process prove different ids, and one
    cannot overwrite the records the other announced."""
    peers, record, reader = swarm
    first, second = NodeKey.generate(), NodeKey.generate()
    assert first.peer != second.peer
    marker, signature = first.sign(b"claim")
    assert proves(first.peer, marker, b"claim", signature)
    assert not proves(second.peer, marker, b"claim", signature)
    dhts = [start_dht(peers, key=first), start_dht(peers, key=second)]
    try:
        model = "two-keys-model"  # apart from MODEL, whose readers expect one node
        mine = dataclasses.replace(record, model=model, peer=first.peer, updated=get_dht_time())
        assert announce(dhts[0], [mine], ttl=240, key=first) > 0
        lie = dataclasses.replace(mine, state="offline", updated=get_dht_time() + 5)
        announce(dhts[1], [lie], ttl=240, key=first)  # the first's subkey, the second's signer
        announce(dhts[1], [lie], ttl=240, key=second)  # the second's own: not the first's record
        records, _expirations, _malformed = read_nodes(reader, model, LAYERS)
        assert {r.peer: r.state for r in records} == {first.peer: "online"}
    finally:
        for dht in dhts:
            dht.shutdown()


# ---- reports of what clients' checks found (swarm.client.verify) -----------------------------


def report_as_stranger(peers: list[str], reports: list) -> str:
    """Store `reports` (wire form) under the model's reports key with a fresh key of a
    stranger's; the node id that key proves."""
    key, marker, stranger_id = new_key()
    attacker = stranger_dht(peers, key)
    try:
        store(attacker, [reports_key(MODEL)], {"reports": reports}, marker, get_dht_time() + 60)
    finally:
        attacker.shutdown()
    return stranger_id


def test_a_report_counts_once_for_the_key_that_signed_it(swarm):
    peers, _record, reader = swarm
    accused = "accused-" + "0" * 32
    assert publish_reports(reader, MODEL, [Report(accused, 0, 2, get_dht_time())])
    said = {"peer": accused, "start": 2, "end": 4, "at": get_dht_time(), "reporter": node_id()}
    stranger = report_as_stranger(peers, [said, said])  # naming it twice, claiming another id
    reported, malformed = read_reports(reader, MODEL)
    assert reported[accused].reporters == {node_id(), stranger} and malformed == 0
    assert reported[accused].blocks == ((0, 2), (2, 4))


def test_malformed_and_misdated_reports_are_skipped(swarm):
    peers, _record, reader = swarm
    _before, malformed_before = read_reports(reader, MODEL)
    report_as_stranger(peers, ["not a report"])
    now = get_dht_time()
    misdated = [
        {"peer": "ahead-" + "0" * 34, "start": 0, "end": 1, "at": now + 3600},
        {"peer": "stale-" + "0" * 34, "start": 0, "end": 1, "at": now - 3600},
    ]
    report_as_stranger(peers, misdated)
    reported, malformed = read_reports(reader, MODEL)
    assert malformed == malformed_before + 1
    assert not [peer for peer in reported if peer.startswith(("ahead-", "stale-"))]
