"""Who gives way in a full session table, decided by the sans-IO SessionTable and ConnectionTable
on sessions whose protocol state is the node's own SessionState."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import pytest

from swarm.errors import NodeBusy
from swarm.health.render import render_page
from swarm.health.snapshot import DhtStatus, Known, Snapshot, build_model_view
from swarm.node.admission import (
    ConnectionTable,
    Inbound,
    Share,
    Throttle,
    share_of,
    source_host,
)
from swarm.node.config import Limits
from swarm.node.session_state import SessionState, StepIn
from swarm.node.session_table import SessionTable
from swarm.node.status import Status, status_line
from swarm.protocol import Hop, Open, Opened
from swarm.records import ModelRecord, NodeRecord

LIMITS = Limits(
    max_sessions=4,
    max_cache_tokens=1000,
    max_session_tokens=500,
    max_host_sessions=2,
    max_host_cache_tokens=600,
    evict_idle_s=5.0,
)


@dataclass(eq=False)
class Held:
    """What the table reads of a session: its id, address, size and protocol state."""

    sid: str
    host: str
    max_length: int = 100
    opened: float = 0.0
    via: str = ""  # the node forwarding it, if one does
    pieces: list = field(default_factory=list)  # prompt pieces waiting for a pass
    state: SessionState = field(init=False)

    def __post_init__(self):
        self.state = SessionState(self.sid, self.max_length, last=True, now=self.opened)
        self.state.handle(Opened(sid=self.sid))

    @property
    def local_tokens(self) -> int:
        return self.max_length  # it borrows nothing

    def step(self, now: float) -> Held:
        pos = self.state.next_pos
        self.state.handle(StepIn("prefill", pos, 1, pos + 1, now))
        return self


def table(*held: Held) -> SessionTable:
    t = SessionTable(LIMITS)
    for h in held:
        t._sessions[h.sid] = h  # placed as they were admitted earlier
    return t


def test_an_idle_session_of_the_address_holding_most_gives_way_first():
    a1, a2 = Held("a1", "A").step(1.0), Held("a2", "A").step(2.0)
    b1, c1 = Held("b1", "B").step(0.5), Held("c1", "C").step(9.0)
    assert table(a1, a2, b1, c1).make_room(Held("n", "N", opened=10.0), now=10.0) == [a1]


def test_never_used_goes_before_used_at_the_same_address():
    used, unused = Held("u", "A").step(1.0), Held("x", "A", opened=2.0)
    others = [Held("b", "B").step(9.9), Held("c", "C").step(9.9)]
    assert table(used, unused, *others).make_room(Held("n", "N"), now=10.0) == [unused]


def test_busy_equal_shares_refuse_a_newcomer():
    held = [Held(f"s{i}", f"H{i}").step(9.0) for i in range(4)]
    with pytest.raises(NodeBusy, match="maximum of 4 sessions"):
        table(*held).make_room(Held("n", "N"), now=10.0)


def test_an_address_over_an_equal_share_gives_its_least_active_session_to_a_newcomer():
    a1, a2 = Held("a1", "A").step(8.0), Held("a2", "A").step(9.0)
    b1, c1 = Held("b1", "B").step(9.0), Held("c1", "C").step(9.0)
    assert table(a1, a2, b1, c1).make_room(Held("n", "N"), now=10.0) == [a1]


def test_an_address_at_its_share_makes_room_among_its_own_idle_sessions_only():
    own_idle, own_busy = Held("a1", "A").step(1.0), Held("a2", "A").step(9.0)
    other_idle = Held("b1", "B").step(0.0)
    t = table(own_idle, own_busy, other_idle)
    assert t.make_room(Held("n", "A"), now=10.0) == [own_idle]
    with pytest.raises(NodeBusy, match="A holds 2 sessions"):
        table(Held("a1", "A").step(9.0), own_busy).make_room(Held("n", "A"), now=10.0)


def forwarded(sid: str, user: str, now: float = 9.0) -> Held:
    return Held(sid, f"{user} via F", via="F").step(now)


def test_sessions_a_node_forwards_count_in_their_users_shares():
    t = SessionTable(replace(LIMITS, max_sessions=8, max_cache_tokens=2000))
    for i, user in enumerate(["u1", "u1", "u2", "u3"]):
        t._sessions[f"s{i}"] = forwarded(f"s{i}", user)
    assert t.make_room(forwarded("n", "u4"), now=10.0) == []
    with pytest.raises(NodeBusy, match="u1 via F holds 2 sessions"):
        t.make_room(forwarded("n", "u1"), now=10.0)


def test_what_a_node_forwards_is_capped_all_users_together():
    limits = replace(LIMITS, max_sessions=8, max_cache_tokens=2000, max_forwarded_sessions=3)
    t = SessionTable(limits)
    for i in range(3):
        t._sessions[f"s{i}"] = forwarded(f"s{i}", f"u{i}")
    with pytest.raises(NodeBusy, match=r"F \(forwarding its users' sessions\) holds 3"):
        t.make_room(forwarded("n", "u9"), now=10.0)
    assert t.make_room(Held("n", "u9"), now=10.0) == []  # the same user, directly: its own share


def hops(*hosts: str) -> tuple[Hop, ...]:
    return tuple(Hop(h, 7000 + i, i, i + 1, f"p{i}") for i, h in enumerate(hosts))


def opening(hop: int, origin: str = "") -> Open:
    route = hops("10.0.0.1", "10.0.0.2", "10.0.0.3")
    return Open("s", route, hop, "f", "", 16, "t", origin=origin)


@pytest.mark.parametrize(
    "source, msg, share",
    [
        ("1.2.3.4", opening(0), Share("1.2.3.4", "", "1.2.3.4")),
        ("10.0.0.1", opening(1, "1.2.3.4"), Share("1.2.3.4 via 10.0.0.1", "10.0.0.1", "1.2.3.4")),
        ("10.0.0.9", opening(1, "1.2.3.4"), Share("10.0.0.9", "", "10.0.0.9")),
        ("10.0.0.2", opening(1, "1.2.3.4"), Share("10.0.0.2", "", "10.0.0.2")),
    ],
    ids=["first-hop", "from-the-previous-node", "from-elsewhere", "from-itself"],
)
def test_a_session_counts_for_its_user_only_when_the_previous_node_forwards_it(source, msg, share):
    assert share_of(source, msg) == share


def test_free_cache_tokens_counts_idle_sessions_as_free():
    now = time.monotonic()
    busy = Held("a", "A", max_length=300, opened=now).step(now)
    idle = Held("b", "B", max_length=400, opened=now - 60).step(now - 60)
    assert table(busy, idle).free_cache_tokens == 700


def test_a_full_connection_table_closes_an_idle_connection_of_the_address_holding_most():
    t = ConnectionTable(max_connections=3, max_host_connections=2)
    a_busy = Inbound("A", 0.0, lambda: None, lambda: False)
    a_idle = Inbound("A", 1.0, lambda: None, lambda: True)
    b_idle = Inbound("B", 0.5, lambda: None, lambda: True)
    for c in (a_busy, a_idle, b_idle):
        assert t.admit(c) is None
    assert t.admit(Inbound("N", 2.0, lambda: None, lambda: True)) is a_idle
    with pytest.raises(NodeBusy, match="maximum of 3 connections"):  # nobody holds more
        t.admit(Inbound("B", 3.0, lambda: None, lambda: True))


def test_an_address_at_its_connection_share_is_refused():
    t = ConnectionTable(max_connections=10, max_host_connections=2)
    for opened in (0.0, 1.0):
        t.admit(Inbound("B", opened, lambda: None, lambda: True))
    with pytest.raises(NodeBusy, match="2 connections from B"):
        t.admit(Inbound("B", 3.0, lambda: None, lambda: True))


@pytest.mark.parametrize(
    "sockaddr, host",
    [
        (("10.1.2.3", 5), "10.1.2.3"),
        (("::ffff:10.1.2.3", 5, 0, 0), "10.1.2.3"),
        (("2001:db8:1:2:aaaa::1", 5, 0, 0), "2001:db8:1:2::/64"),
        (("2001:db8:1:2:bbbb::9", 5, 0, 0), "2001:db8:1:2::/64"),
    ],
)
def test_an_ipv6_subscriber_counts_as_one_address(sockaddr, host):
    assert source_host(sockaddr) == host


def test_the_status_line_tells_what_admission_turned_away():
    before = Status(sessions=6, free_cache_tokens=0, tokens=0, link={}, refused=3, evicted=1)
    now = Status(6, 0, 0, {}, refused=40, evicted=5, throttled_hosts=4)
    assert status_line(now, before, 30.0).endswith(
        "; throttled: 37 refused, 4 evicted in 30 s (4 addresses so far)"
    )


def test_the_status_line_tells_the_verification_rounds_computed_and_dropped():
    before = Status(sessions=2, rounds=10, rounds_dropped=1)
    now = Status(sessions=2, rounds=70, rounds_dropped=9)
    assert status_line(now, before, 30.0) == (
        "2 sessions, 0.0 tokens/s, link not measured yet,"
        " 60 verification rounds (8 more dropped stale)"
    )
    assert "verification" not in status_line(now, now, 30.0)


def test_the_throttle_counts_what_it_turned_away_in_the_last_minute():
    t = Throttle()
    t.refuse("A", "a session", "full", now=0.0)
    t.evict("B", "idle", now=30.0)
    t.refuse("A", "a connection", "full", now=61.0)
    assert t.recent(now=61.0) == 2  # the first is over a minute old
    assert (t.refused, t.evicted, t.hosts) == (2, 1, {"A", "B"})


@pytest.mark.parametrize("throttled, shown", [(0, False), (37, True)])
def test_the_health_page_shows_a_node_turning_hosts_away(throttled, shown):
    record = NodeRecord(
        peer="p",
        addr="10.0.0.1:7000",
        model="m",
        start=0,
        end=4,
        state="online",
        fingerprint="fp",
        version="0",
        num_layers=4,
        updated=1000.0,
        throttled=throttled,
    )
    model = build_model_view(ModelRecord("m", 4, "fp"), [Known(record, 1010.0)], {}, 1001.0)
    snap = Snapshot(taken_at=1001.0, dht=DhtStatus("ok", 1001.0, 0.01), models=(model,))
    assert ("37 turned away" in render_page(snap, 10)) is shown
    assert snap.to_json()["models"][0]["nodes"][0]["throttled"] == throttled
    assert NodeRecord.from_wire(record.to_wire()).throttled == throttled


def test_an_address_pushing_several_prompts_takes_its_turn_in_the_prompt_lane():
    pairs = [("a1", "A"), ("a2", "A"), ("a3", "A"), ("b", "B")]
    a1, a2, a3, b = (Held(sid, host, pieces=[1]) for sid, host in pairs)
    t = table(a1, a2, a3, b, Held("idle", "C"))
    # a1 waits behind A's two other prompts, in turns with B's: 2 passes x 2 addresses
    assert t.prompt_rank(a1, 10.0, 1.0) == 14.0
    assert t.prompt_rank(b, 10.5, 1.0) == 10.5  # a lone prompt keeps the lane's rank


def test_a_session_bigger_than_the_whole_cache_is_refused_naming_both_sizes():
    limits = replace(
        LIMITS, max_cache_tokens=512, max_session_tokens=8192, max_host_cache_tokens=8192
    )
    table = SessionTable(limits)
    table.add(Held("small", "10.0.0.1", max_length=100))
    with pytest.raises(NodeBusy, match="1525 cache tokens.* whole cache of 512"):
        table.add(Held("big", "10.0.0.2", max_length=1525))
    assert [s.sid for s in table] == ["small"]


def test_a_session_bigger_than_the_whole_cache_of_an_empty_node_is_refused_too():
    limits = replace(
        LIMITS, max_cache_tokens=512, max_session_tokens=8192, max_host_cache_tokens=8192
    )
    with pytest.raises(NodeBusy, match="whole cache of 512"):
        SessionTable(limits).add(Held("big", "10.0.0.2", max_length=1525))
