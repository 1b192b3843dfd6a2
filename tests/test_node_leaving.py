"""How a node leaves a span: it drains the same way for a move and a shutdown, and moves only
when the watch finds the swarm needs it elsewhere (swarm/node/lifecycle.py)."""

from __future__ import annotations

import trio

from swarm.node.lender import LendTable
from swarm.node.lifecycle import Move, Stop, drain, first_of, watch_for_move
from swarm.node.status import Status
from swarm.records import NodeRecord
from tests.helpers.records import LAYERS, rec

GRACE = 30.0


class FakeSessions:
    """A session table's count and its wait for the last one to leave."""

    def __init__(self, sessions: int):
        self.count = sessions
        self.emptied = trio.Event()

    def __len__(self) -> int:
        return self.count

    def clear(self) -> None:
        self.count = 0
        self.emptied.set()

    async def until_empty(self) -> None:
        if self.count:
            await self.emptied.wait()


class FakeNode:
    def __init__(self, sessions: int):
        self.sessions = FakeSessions(sessions)
        self.accepting = True
        self.lends = LendTable(0, 0)  # lends nothing: nothing to hand on

    def stop_accepting(self) -> None:
        self.accepting = False


class FakeAnnouncer:
    ttl = 3.0

    def __init__(self, node: FakeNode):
        self.node = node
        self.published: list[tuple[str, bool, float]] = []  # state, accepting then, ttl

    async def publish(self, state: str, status: Status | None = None, ttl=None) -> None:
        self.published.append((state, self.node.accepting, ttl))


async def end_sessions_after(node: FakeNode, seconds: float) -> None:
    await trio.sleep(seconds)
    node.sessions.clear()


async def test_drain_refuses_new_sessions_before_it_announces_offline(autojump_clock):
    node = FakeNode(sessions=0)
    announcer = FakeAnnouncer(node)
    await drain(node, announcer, Status, GRACE)
    assert announcer.published == [("offline", False, 10.0)]


async def test_drain_returns_as_soon_as_the_last_session_ends(autojump_clock, capsys):
    node = FakeNode(sessions=2)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(end_sessions_after, node, 5.0)
        await drain(node, FakeAnnouncer(node), Status, GRACE)
    assert 5.0 <= trio.current_time() < 6.0
    assert "grace period over" not in capsys.readouterr().out


async def test_drain_gives_up_at_the_grace_period_and_says_how_many_sessions_it_closes(
    autojump_clock, capsys
):
    node = FakeNode(sessions=2)
    await drain(node, FakeAnnouncer(node), Status, GRACE)
    assert GRACE <= trio.current_time() < GRACE + 1
    assert capsys.readouterr().out == "grace period over; closing 2 sessions\n"


def reader(*reads: list[NodeRecord]):
    """Returns each of `reads` in turn, then the last one again and again."""
    left = list(reads)

    async def read() -> list[NodeRecord]:
        return left.pop(0) if len(left) > 1 else left[0]

    return read


async def test_the_watch_moves_a_redundant_node_into_a_gap_once_one_opens(autojump_clock):
    covered = [rec("a", 0, 6), rec("b", 0, 6), rec("c", 6, 12)]
    gap = [rec("a", 0, 6), rec("b", 0, 6), rec("c", 6, 12, state="offline")]
    move = await watch_for_move(reader(covered, covered, gap), "a", (0, 6), LAYERS, 1.0)
    assert move == Move(current=(0, 6), target=(6, 12), gaps=((6, 12),))
    assert trio.current_time() == 3.0  # the third read found the gap


async def test_the_watch_keeps_a_node_whose_leaving_would_open_a_gap(autojump_clock):
    alone = [rec("a", 0, 6), rec("b", 6, 9)]
    with trio.move_on_after(100):
        await watch_for_move(reader(alone), "a", (0, 6), LAYERS, 1.0)
        raise AssertionError("moved although nobody else serves 0:6")


def test_a_move_says_from_where_to_where_and_which_blocks_nobody_serves():
    move = Move(current=(0, 6), target=(6, 12), gaps=((6, 9), (10, 12)))
    assert move.line(sessions=3) == (
        "moving from blocks 0:6 to 6:12: nobody serves 6:9, 10:12 and others still serve ours;"
        " draining 3 sessions first"
    )


def test_a_signal_stops_the_node_with_no_span_after():
    stop = Stop("SIGTERM")
    assert stop.target is None
    assert stop.line(sessions=3) == "received SIGTERM: going offline, refusing new sessions"


async def test_first_of_returns_the_first_result_and_cancels_the_others(autojump_clock):
    finished = []

    async def after(seconds: float, value: str) -> str:
        await trio.sleep(seconds)
        finished.append(value)
        return value

    assert await first_of(lambda: after(2.0, "slow"), lambda: after(1.0, "fast")) == "fast"
    await trio.sleep(5.0)
    assert finished == ["fast"]
