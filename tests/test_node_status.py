"""A node's figures are read in one place, and its periodic status line is short and human."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from swarm.model.source import open_model
from swarm.node.config import Limits
from swarm.node.directory import PeerDirectory
from swarm.node.status import Status, status_line, status_of
from tests.helpers.records import node_record

MB = 2**20


def test_the_status_line_names_sessions_token_rate_bandwidth_and_rtt():
    link = {"bandwidth_Bps": 600_000.0, "rtt_s": 0.0234, "sends": 99.0, "chunks_sent": 3.0}
    before = Status(sessions=1, free_cache_tokens=100, tokens=1000, link={})
    now = Status(sessions=3, free_cache_tokens=50, tokens=2236, link=link)
    assert status_line(now, before, 30.0) == "3 sessions, 41.2 tokens/s, link 4.8 Mbit/s, RTT 23 ms"


def test_a_link_not_yet_measured_says_so():
    idle = Status(sessions=1, free_cache_tokens=100, tokens=0, link={})
    assert status_line(idle, idle, 30.0) == "1 session, 0.0 tokens/s, link not measured yet"


def serving_node(
    free: int = 900,
    span=None,
    directory=None,
    max_session_tokens: int = 2048,
    cache: int | None = None,
    host_share: int = 8192,
) -> SimpleNamespace:
    """The parts of a Node its figures are read from, as a node serving two sessions holds them
    (a cache of `cache` tokens, else 4096 unless `span` is given: then 64; `host_share` what
    one address may reserve of it)."""
    lending = SimpleNamespace(lending=True)
    sessions = [SimpleNamespace(lender=None), SimpleNamespace(lender=lending)]  # one borrows
    table = type(
        "Sessions",
        (),
        {
            "__len__": lambda self: 2,
            "__iter__": lambda self: iter(sessions),
            "free_cache_tokens": free,
        },
    )()
    cache = cache or (4096 if span is None else 64)
    limits = Limits(
        max_cache_tokens=cache,
        max_session_tokens=max_session_tokens,
        max_host_cache_tokens=host_share,
    )
    return SimpleNamespace(
        config=SimpleNamespace(limits=limits),
        key=SimpleNamespace(peer="me"),
        directory=directory or PeerDirectory(list),
        sessions=table,
        tokens_done=1234,
        uplink=SimpleNamespace(stats=lambda: {"bandwidth_Bps": 1e6}),
        throttle=SimpleNamespace(refused=5, evicted=1, hosts={"a", "b"}, recent=lambda now: 3),
        throughput=41.5,
        lends=SimpleNamespace(lent_bytes=3 * MB, free_for_one=5 * MB),
        span=span or SimpleNamespace(format="int8"),
        compute=SimpleNamespace(mean_decode_batch=1.75, decode_passes=80),
        counters=SimpleNamespace(
            prompt_passes=7, moved_in=2, moved_out=1, transfers=1, rounds_done=40, steps_dropped=6
        ),
    )


def test_a_node_not_serving_yet_reports_nothing_going_on_and_the_default_weights():
    idle = Status()
    assert (idle.sessions, idle.free_cache_tokens, idle.tokens, idle.link) == (0, 0, 0, {})
    assert (idle.throughput, idle.decode_batch, idle.decode_passes, idle.throttled) == (0, 1, 0, 0)
    assert idle.weights == "float32"


def test_a_serving_node_reports_every_figure_it_holds():
    assert status_of(serving_node()) == Status(
        sessions=2,
        free_cache_tokens=900,
        tokens=1234,
        link={"bandwidth_Bps": 1e6},
        refused=5,
        evicted=1,
        throttled_hosts=2,
        throttled=3,
        throughput=41.5,
        weights="int8",
        decode_batch=1.75,
        decode_passes=80,
        prompt_passes=7,
        moved_in=2,
        moved_out=1,
        transfers=1,
        rounds=40,
        rounds_dropped=6,
        lent_mb=3.0,
        borrowing=1,
        lend_free_mb=5.0,
        cache_tokens=4096,
        borrow_tokens=0,  # it allows no session longer than its cache
        session_tokens=2048,
    )


@pytest.fixture
def tiny_span(tiny_model_dir) -> SimpleNamespace:
    """Every block of the tiny Llama, float32: 1536 bytes of KV a position."""
    config = open_model(str(tiny_model_dir)).config
    return SimpleNamespace(config=config, start=0, end=6, cache_dtype=torch.float32, format="f")


def lenders(**offers: float) -> PeerDirectory:
    """A directory that last read lenders named as `offers`, each offering so many MB; the
    node itself (`me`), an offline one and one without TLS offer more."""
    directory = PeerDirectory(list)
    directory.seed(
        [node_record(p, 0, 6, lend_free_mb=mb, tls="a" * 64) for p, mb in offers.items()]
        + [node_record("me", 0, 6, lend_free_mb=99.0, tls="a" * 64)]
        + [node_record("gone", 0, 6, state="offline", lend_free_mb=99.0, tls="a" * 64)]
        + [node_record("plain", 0, 6, lend_free_mb=99.0)]
    )
    return directory


def test_a_node_that_could_borrow_announces_the_longest_session_its_roomiest_lender_allows(
    tiny_span,
):
    """32 positions (half its cache) here and 1.5 MB at one lender: 1024 positions, less the
    block a pass may lend ahead of need."""
    node = serving_node(64, tiny_span, lenders(a=0.5, b=1.5), max_session_tokens=8192)
    assert status_of(node).borrow_tokens == 32 + 1024 - 16


def test_a_node_whose_address_share_is_below_half_its_cache_borrows_keeping_that_share(
    tiny_span,
):
    """As at the defaults (a cache of 32768, an address's share 8192): a session longer than
    the share keeps the share here, 32 positions, and borrows the rest."""
    node = serving_node(128, tiny_span, lenders(b=1.5), 8192, cache=128, host_share=32)
    status = status_of(node)
    assert (status.cache_tokens, status.borrow_tokens) == (32, 32 + 1024 - 16)


def test_what_a_node_could_borrow_is_bounded_by_its_max_session_tokens(tiny_span):
    node = serving_node(64, tiny_span, lenders(b=1.5), max_session_tokens=1000)
    assert status_of(node).borrow_tokens == 1000


def test_a_node_without_room_for_a_borrowing_sessions_half_cache_announces_no_borrowing(
    tiny_span,
):
    node = serving_node(31, tiny_span, lenders(b=1.5), max_session_tokens=8192)
    assert status_of(node).borrow_tokens == 0


def test_a_node_with_no_lender_offering_more_than_a_block_announces_no_borrowing(tiny_span):
    """It could take a session no longer than its cache without borrowing at all."""
    node = serving_node(64, tiny_span, lenders(b=0.01), max_session_tokens=8192)
    assert status_of(node).borrow_tokens == 0


def test_the_status_line_says_what_the_node_lends_and_how_many_sessions_borrow():
    now = Status(sessions=1, link={}, lent_mb=12.5, borrowing=1)
    assert status_line(now, now, 30.0).endswith(", KV lent here 12.5 MB, 1 sessions borrowing")
