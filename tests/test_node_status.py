"""A node's figures are read in one place, and its periodic status line is short and human."""

from __future__ import annotations

from types import SimpleNamespace

from swarm.node.status import Status, status_line, status_of


def test_the_status_line_names_sessions_token_rate_bandwidth_and_rtt():
    link = {"bandwidth_Bps": 600_000.0, "rtt_s": 0.0234, "sends": 99.0, "chunks_sent": 3.0}
    before = Status(sessions=1, free_cache_tokens=100, tokens=1000, link={})
    now = Status(sessions=3, free_cache_tokens=50, tokens=2236, link=link)
    assert status_line(now, before, 30.0) == "3 sessions, 41.2 tokens/s, link 4.8 Mbit/s, RTT 23 ms"


def test_a_link_not_yet_measured_says_so():
    idle = Status(sessions=1, free_cache_tokens=100, tokens=0, link={})
    assert status_line(idle, idle, 30.0) == "1 session, 0.0 tokens/s, link not measured yet"


def serving_node() -> SimpleNamespace:
    """The parts of a Node its figures are read from, as a node serving two sessions holds them."""
    lending = SimpleNamespace(lending=True)
    sessions = [SimpleNamespace(lender=None), SimpleNamespace(lender=lending)]  # one borrows
    table = type(
        "Sessions",
        (),
        {
            "__len__": lambda self: 2,
            "__iter__": lambda self: iter(sessions),
            "free_cache_tokens": 900,
        },
    )()
    return SimpleNamespace(
        sessions=table,
        tokens_done=1234,
        uplink=SimpleNamespace(stats=lambda: {"bandwidth_Bps": 1e6}),
        throttle=SimpleNamespace(refused=5, evicted=1, hosts={"a", "b"}, recent=lambda now: 3),
        throughput=41.5,
        lends=SimpleNamespace(lent_bytes=3 * 2**20),
        span=SimpleNamespace(format="int8"),
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
    )


def test_the_status_line_says_what_the_node_lends_and_how_many_sessions_borrow():
    now = Status(sessions=1, link={}, lent_mb=12.5, borrowing=1)
    assert status_line(now, now, 30.0).endswith(", KV lent here 12.5 MB, 1 sessions borrowing")
