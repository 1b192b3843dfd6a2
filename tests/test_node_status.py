"""The node's periodic status line is short and human."""

from __future__ import annotations

from swarm.node.status import Status, status_line


def test_the_status_line_names_sessions_token_rate_bandwidth_and_rtt():
    link = {"bandwidth_Bps": 600_000.0, "rtt_s": 0.0234, "sends": 99.0, "chunks_sent": 3.0}
    before = Status(sessions=1, free_cache_tokens=100, tokens=1000, link={})
    now = Status(sessions=3, free_cache_tokens=50, tokens=2236, link=link)
    assert status_line(now, before, 30.0) == "3 sessions, 41.2 tokens/s, link 4.8 Mbit/s, RTT 23 ms"


def test_a_link_not_yet_measured_says_so():
    idle = Status(sessions=1, free_cache_tokens=100, tokens=0, link={})
    assert status_line(idle, idle, 30.0) == "1 session, 0.0 tokens/s, link not measured yet"
