"""A lender that leaves hands its KV blocks on (issue #52): its borrowers take them back and lend
them to another lender, and their sessions go on without a replay; with nowhere to go, they
replay when it has gone. The borrower's checks on what comes back first; then real DHT, node
processes, TLS."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from devtools.launch import start_node, start_swarm, stop_all
from swarm.client.client import Client
from swarm.dht import read_lenders
from swarm.errors import ProtocolError, ShapeMismatch
from swarm.lending import LendLeaving
from swarm.node.directory import REFRESH_S
from swarm.node.lender_link import Returned, check_notice
from swarm.protocol import KvChunk
from swarm.wire import pack_tensor
from tests.conftest import reference_greedy
from tests.helpers.flags import exact_flags

PROMPT = [(7 * i + 3) % 500 + 5 for i in range(40)]
NEW = 40  # 80 tokens in all: more than the serving nodes' cache
SHORT = ["--max-cache-tokens", "64"]
SID = "s" * 32


def chunk(layer: int, pos: int, n: int, sid: str = SID, width: int = 8) -> KvChunk:
    kv = (pack_tensor(torch.randn(1, n, width), "float32") for _ in range(2))
    return KvChunk(sid, layer, pos, *kv)


def test_what_comes_back_becomes_the_lends_for_the_next_lender_in_order():
    back = Returned(SID, {0: (2, 4), 2: (2, 4)}, held=32)
    lends = [back.take(c) for c in (chunk(0, 0, 16), chunk(0, 16, 16), chunk(2, 0, 32))]
    assert back.done
    assert [(f.layer, f.pos, f.kv_heads, f.head_dim) for f in lends] == [
        (0, 0, 2, 4),
        (0, 16, 2, 4),
        (2, 0, 2, 4),
    ]


@pytest.mark.parametrize(
    "bad",
    [
        chunk(2, 0, 16),  # a layer before the first is done
        chunk(0, 16, 16),  # a gap
        chunk(0, 0, 16, sid="t" * 32),  # another session's
    ],
)
def test_a_piece_sent_back_out_of_place_is_a_protocol_error(bad):
    back = Returned(SID, {0: (2, 4), 2: (2, 4)}, held=32)
    with pytest.raises(ProtocolError, match="sent back"):
        back.take(bad)


def test_a_piece_sent_back_past_what_was_lent_is_refused():
    back = Returned(SID, {0: (2, 4)}, held=32)
    back.take(chunk(0, 0, 16))
    with pytest.raises(ShapeMismatch):
        back.take(chunk(0, 16, 20))
    back.take(chunk(0, 16, 16))
    with pytest.raises(ProtocolError, match="all had come"):
        back.take(chunk(0, 32, 16))


def test_a_leaving_notice_naming_another_session_is_a_protocol_error():
    check_notice(SID, LendLeaving(SID))
    with pytest.raises(ProtocolError, match="leaving notice"):
        check_notice(SID, LendLeaving("t" * 32))


# ---- a live swarm ----------------------------------------------------------------------------


def _cache_node(nodes, path, grace: float):
    extra = [*exact_flags(ttl=20), "--role", "cache", "--grace", str(grace)]
    node = start_node(None, nodes[0].maddrs[:1], model=str(path), extra=extra)
    nodes.append(node)
    node.wait_serving()
    return node


def _until_announced(client: Client, node) -> None:
    """Until the client reads `node`'s record, and the serving nodes' next look for a lender
    would read it too (they read the DHT again at most every REFRESH_S: one that read it just
    before would pass the new lender by, and its session replay)."""
    deadline = time.monotonic() + 30
    while node.peer not in {r.peer for r in read_lenders(client.dht, client.config.name)}:
        assert time.monotonic() < deadline, "the new cache node was never announced"
        time.sleep(0.5)
    time.sleep(REFRESH_S + 0.5)


def _generate(client: Client, fault, after=None):
    """Greedy tokens of a session borrowing from its first lender, `fault(session)` at the
    tenth; `after()` once they are all out, the session still open."""
    out = []
    with client.session(len(PROMPT) + NEW) as s:
        logits = s.feed(PROMPT)  # 40 positions: 32 kept on the hop, 16 lent
        for i in range(NEW):
            if i == 10:
                fault(s)
            out.append(int(logits.argmax()))
            logits = s.feed([out[-1]])
        if after is not None:
            after()
        return out, s.recoveries


@pytest.fixture
def nodes():
    started = []
    yield started
    stop_all(started)


def _leaves_without_a_replay(nodes, model_dir, reference, leave) -> None:
    """A session borrowing from a cache node that leaves (`leave(first, client)` -> the fault
    and after-callbacks of _generate) once a second one is announced: the reference tokens, no
    replay, and the leaver's log says it handed its loans on."""
    nodes += start_swarm([(0, 6)], model=str(model_dir), extra=[*exact_flags(ttl=20), *SHORT])
    first = _cache_node(nodes, model_dir, grace=120)
    client = Client(nodes[0].maddrs[:1], model=str(model_dir), wire_dtype="float32")
    try:
        _until_announced(client, first)
        out, recoveries = _generate(client, *leave(first, client))
    finally:
        client.close()
    assert out == reference_greedy(reference, PROMPT, NEW)
    assert recoveries == []
    assert any("loans handed on to other lenders: 1;" in line for line in first.lines)


def test_a_lender_leaving_mid_generation_hands_its_blocks_on_without_a_replay(
    nodes, tiny_model_dir, tiny_reference
):
    def leave(first, client):
        def second_lender_then_leave(_session) -> None:
            _until_announced(client, _cache_node(nodes, tiny_model_dir, grace=120))
            first.proc.send_signal(signal.SIGTERM)  # generation goes on at once

        def first_gone() -> None:  # within its grace only if nothing is left with it
            first.proc.wait(60)

        return second_lender_then_leave, first_gone

    _leaves_without_a_replay(nodes, tiny_model_dir, tiny_reference, leave)


def test_a_lender_leaving_while_its_borrower_idles_hands_its_blocks_on_without_a_replay(
    nodes, tiny_model_dir, tiny_reference
):
    """No trip of the session reads the notice: the borrower looks for it between steps."""

    def leave(first, client):
        def leave_and_wait_for_it(_session) -> None:
            _until_announced(client, _cache_node(nodes, tiny_model_dir, grace=120))
            first.proc.send_signal(signal.SIGTERM)
            first.proc.wait(60)  # within its grace only once its blocks have moved

        return leave_and_wait_for_it, None

    _leaves_without_a_replay(nodes, tiny_model_dir, tiny_reference, leave)


def test_a_lender_leaving_with_nowhere_to_hand_its_blocks_on_replays_to_the_same_tokens(
    nodes, tiny_model_dir, tiny_reference
):
    # two serving nodes that lend nothing: the first lender's borrower has nowhere else to go
    extra = [*exact_flags(ttl=20), *SHORT, "--max-lend", "0"]
    nodes += start_swarm([(0, 6), (0, 6)], model=str(tiny_model_dir), extra=extra)
    first = _cache_node(nodes, tiny_model_dir, grace=3)
    client = Client(
        nodes[0].maddrs[:1], model=str(tiny_model_dir), wire_dtype="float32", step_timeout=5.0
    )

    def leave_then_a_new_lender(_session) -> None:
        first.proc.send_signal(signal.SIGTERM)
        first.proc.wait(60)
        _until_announced(client, _cache_node(nodes, tiny_model_dir, grace=3))

    try:
        _until_announced(client, first)  # else the session opens, fails to lend, and replays
        out, recoveries = _generate(client, leave_then_a_new_lender)
    finally:
        client.close()
    assert out == reference_greedy(tiny_reference, PROMPT, NEW)
    assert len(recoveries) == 1  # the replay borrows from the new lender
    assert any("still held at the end of the grace period: 1" in line for line in first.lines)


def test_a_serving_node_that_lends_hands_its_blocks_on_when_it_drains(
    nodes, tiny_model_dir, tiny_reference
):
    extra = [*exact_flags(ttl=20), *SHORT, "--grace", "120"]
    nodes += start_swarm([(0, 6), (0, 6)], model=str(tiny_model_dir), extra=extra)
    client = Client(nodes[0].maddrs[:1], model=str(tiny_model_dir), wire_dtype="float32")
    leaving = []

    def a_cache_node_then_the_lender_drains(session) -> None:
        (hop,) = session.remote.route  # its lender: the other node, the only one there was
        leaving.append(next(n for n in nodes if n.peer != hop.peer))
        _until_announced(client, _cache_node(nodes, tiny_model_dir, grace=120))
        leaving[0].proc.send_signal(signal.SIGTERM)

    try:
        out, recoveries = _generate(
            client, a_cache_node_then_the_lender_drains, lambda: leaving[0].proc.wait(60)
        )
    finally:
        client.close()
    assert out == reference_greedy(tiny_reference, PROMPT, NEW)
    assert recoveries == []
    assert any("loans handed on to other lenders: 1;" in line for line in leaving[0].lines)
