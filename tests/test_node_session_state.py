"""A session's protocol state, without sockets: which messages each state takes, and how steps
are checked."""

from __future__ import annotations

import pytest

from swarm.errors import ProtocolError, SessionNotFound, ShapeMismatch
from swarm.node.session_state import (
    ATTACHED,
    CLOSED,
    OPEN,
    OPENING,
    TRANSITIONS,
    Fail,
    SessionState,
    SinkGone,
    StepIn,
)
from swarm.protocol import DECODE, PREFILL, Attach, Close, Error, Opened

SID = "s" * 32


def opened(last: bool = False, max_length: int = 16) -> SessionState:
    state = SessionState(SID, max_length, last=last)
    state.handle(Opened(sid=SID))
    return state


def attached() -> SessionState:
    state = opened(last=True)
    state.handle(Attach(sid=SID, sink_token="t"))
    return state


def test_a_session_opens_when_the_next_hop_answers():
    state = SessionState(SID, 16, last=False)
    assert state.state is OPENING
    assert state.handle(Opened(sid=SID)) is OPEN


def test_an_opening_session_takes_no_steps_yet():
    state = SessionState(SID, 16, last=False)
    with pytest.raises(ProtocolError, match="still opening"):
        state.handle(StepIn(PREFILL, 0, 4, 4))
    assert state.state is OPENING and state.next_pos == 0


def test_the_client_attaches_to_the_last_hop_only():
    assert attached().state is ATTACHED
    with pytest.raises(SessionNotFound, match="to attach to here"):
        opened(last=False).handle(Attach(sid=SID, sink_token="t"))


def test_a_second_attach_is_refused_until_the_first_client_is_gone():
    state = attached()
    with pytest.raises(SessionNotFound, match="to attach to here"):
        state.handle(Attach(sid=SID, sink_token="t"))
    assert state.handle(SinkGone()) is OPEN
    assert state.handle(Attach(sid=SID, sink_token="t")) is ATTACHED


@pytest.mark.parametrize("make", [lambda: SessionState(SID, 16, False), opened, attached])
def test_close_or_a_failure_ends_a_session_in_any_live_state(make):
    assert make().handle(Close(sid=SID)) is CLOSED
    assert make().handle(Fail(Error(code="peer_failed", message="gone"))) is CLOSED


def test_a_closed_session_takes_nothing():
    state = opened()
    state.handle(Close(sid=SID))
    assert TRANSITIONS[CLOSED] == {}
    for event in (StepIn(PREFILL, 0, 1, 1), Close(sid=SID), Opened(sid=SID)):
        with pytest.raises(SessionNotFound):
            state.handle(event)


def test_steps_advance_the_next_position_in_order():
    state = opened()
    state.handle(StepIn(PREFILL, 0, 5, 5))
    state.handle(StepIn(DECODE, 5, 1, 6))
    assert state.next_pos == 6
    with pytest.raises(ProtocolError, match="out of order; expected position 6"):
        state.handle(StepIn(DECODE, 5, 1, 6))  # a replay


def test_a_step_past_its_phase_or_the_sessions_length_is_a_shape_mismatch():
    state = opened(max_length=16)
    with pytest.raises(ShapeMismatch, match="phase ending at 3"):
        state.handle(StepIn(PREFILL, 0, 4, 3))
    with pytest.raises(ShapeMismatch, match="at most 16 tokens"):
        state.handle(StepIn(PREFILL, 0, 4, 40))
    assert state.next_pos == 0  # refused steps move nothing


def test_a_decode_step_carries_one_token():
    state = opened()
    state.handle(StepIn(PREFILL, 0, 3, 3))
    with pytest.raises(ShapeMismatch, match="one token, this one 2"):
        state.handle(StepIn(DECODE, 3, 2, 5))


def test_an_open_session_expires_after_idling_from_its_last_step():
    state = SessionState(SID, 16, last=True, now=100.0)
    assert not state.expired(now=1000.0, idle=300.0)  # still opening: the open timeout rules
    state.handle(Opened(sid=SID))
    assert state.expired(now=400.0, idle=300.0)
    state.handle(StepIn(PREFILL, 0, 1, 1, now=390.0))
    assert not state.expired(now=400.0, idle=300.0)
    assert state.expired(now=690.0, idle=300.0)


def test_a_refused_open_closes_the_session_and_keeps_the_refusal():
    state = SessionState(SID, 16, last=False)
    refusal = Error(code="busy", message="node serves its maximum of 64 sessions", sid=SID, hop=1)
    assert state.opening
    assert state.handle(Fail(refusal)) is CLOSED
    assert not state.opening and state.error == refusal
