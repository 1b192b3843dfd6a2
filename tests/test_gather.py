"""A decode pass waits for another session's step only where that finishes both sooner: the
forecast (sans-IO, times given) and the compute queue that follows it (real lane threads)."""

from __future__ import annotations

import time

import outcome
import pytest
import trio

from swarm.node.compute import ComputeQueue
from swarm.node.gather import GO, Forecast

PASS = 0.05  # seconds a pass of one row costs in these tests


def stepping(forecast: Forecast, who: str, arrivals: list[float], pass_s: float = PASS) -> None:
    """`who` steps at each of `arrivals`, each step computed alone in `pass_s`."""
    for at in arrivals:
        forecast.arrived(who, at)
        forecast.left(who, at + pass_s)
        forecast.passed(1, pass_s)


def test_a_lone_session_is_never_held():
    forecast = Forecast()
    stepping(forecast, "a", [0.0, 0.06, 0.12, 0.18])
    forecast.arrived("a", 0.24)
    assert forecast.hold(["a"], 0.24) == GO


def test_a_pass_waits_for_a_step_due_within_its_fixed_cost():
    forecast = Forecast()
    stepping(forecast, "b", [0.0, 0.06])  # away 10 ms after each pass: due at 0.12
    forecast.arrived("a", 0.115)
    hold = forecast.hold(["a"], 0.115)
    assert hold.expected == {"b"}
    assert 0.12 <= hold.until < 0.12 + PASS


def test_a_step_due_after_the_pass_would_end_is_not_waited_for():
    forecast = Forecast()
    stepping(forecast, "b", [0.0, 0.15])  # away 100 ms: due at 0.30
    forecast.arrived("a", 0.22)
    assert forecast.hold(["a"], 0.22) == GO


def test_rows_that_cost_their_own_time_are_never_waited_for():
    forecast = Forecast()
    stepping(forecast, "b", [0.0, 0.06])
    forecast.passed(2, 2 * PASS)  # compute-bound: two rows cost two passes
    forecast.arrived("a", 0.115)
    assert forecast.hold(["a"], 0.115) == GO


def test_a_session_that_stops_stepping_is_waited_for_at_most_until_its_step_was_due():
    forecast = Forecast()
    stepping(forecast, "b", [0.0, 0.06])  # due at 0.12, never comes
    forecast.arrived("a", 0.125)
    assert forecast.hold(["a"], 0.125) == GO


def test_the_cost_of_an_unmeasured_size_lies_on_the_line_through_the_measured():
    forecast = Forecast()
    forecast.passed(1, 0.05)
    forecast.passed(4, 0.08)
    assert forecast.cost(2) == pytest.approx(0.06)
    assert forecast.cost(8) == pytest.approx(0.12)
    assert Forecast().cost(1) is None


async def mean_batch_of_two_sessions(gather: bool, steps: int = 12) -> float:
    """Two closed-loop sessions on one queue: A's step is away 5 ms after its pass, B's 15 ms,
    so B's arrives while A's pass runs; a pass blocks its lane thread for PASS seconds whatever
    its rows (memory-bound). The mean rows a pass over the second half of the steps."""
    queue = ComputeQueue(gather=gather)
    counted = {}

    def run_batch(items):
        time.sleep(PASS)
        return [outcome.Value(i) for i in items]

    async def session(who: str, away: float) -> None:
        await trio.sleep(away)
        for i in range(steps):
            if i == steps // 2 and who == "a":
                counted["from"] = (queue.decode_passes, queue.decode_pass_rows)
            await queue.decode("blocks", i, run_batch, who)
            await trio.sleep(away)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.worker)
        with trio.fail_after(20):
            async with trio.open_nursery() as sessions:
                sessions.start_soon(session, "a", 0.005)
                sessions.start_soon(session, "b", 0.015)
        nursery.cancel_scope.cancel()
    passes, rows = counted["from"]
    return (queue.decode_pass_rows - rows) / (queue.decode_passes - passes)


async def test_two_sessions_a_pass_apart_come_to_share_their_passes():
    assert await mean_batch_of_two_sessions(gather=True) > 1.6


async def test_without_gathering_two_sessions_a_pass_apart_stay_apart():
    assert await mean_batch_of_two_sessions(gather=False) < 1.4


def test_a_session_is_alone_once_the_others_have_not_stepped_for_a_while():
    forecast = Forecast()
    stepping(forecast, "b", [0.0])
    forecast.arrived("a", 0.1)
    assert not forecast.alone("a", 0.1)
    assert forecast.alone("a", 10.0)
