"""A session's protocol state, sans IO: which messages it accepts in which state.

In the manner of h11's state table: a session is `opening` until the next hop acknowledges the
open (the last hop, having none, opens at once), `open` while steps flow, `attached` once the
client has claimed the last hop's results, and `closed` for good. `SessionState.handle` takes
one event, checks it against the table, moves to the next state or raises the error the sender
gets; it never touches a socket or a clock (times come in as arguments), so the tests drive it
directly. A failure is a transition too: the next hop refusing the open, or any error later,
closes the session through `Fail`, which keeps the error that ended it.

A hand-over (swarm/node/handover/) is a second column of the same kind, `Move`, in `MOVES`:
sending, the session is `copying` its cache to a replica while it computes on, `holding` the
steps that arrive once paused for the tail, `sent` when the replica took it and `left` once its
owner released it here; receiving, its cache is `coming`, then `installed`, and the session is
`here` once both its new owner has `claimed` it and the sender has `released` it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from swarm.errors import ProtocolError, SessionNotFound, ShapeMismatch, SwarmError
from swarm.protocol import (
    DECODE,
    MAX_REWIND,
    MAX_VERIFY_TOKENS,
    Attach,
    Close,
    Error,
    Opened,
    Release,
    Taken,
)


class State(enum.Enum):
    OPENING = "opening"
    OPEN = "open"
    ATTACHED = "attached"
    CLOSED = "closed"


@dataclass(frozen=True)
class StepIn:
    """Activations for positions [pos, pos + tokens) of a phase ending at `end`, at `now`."""

    phase: str
    pos: int
    tokens: int
    end: int
    now: float = 0.0
    spec: bool = False  # a verification step (speculative decoding): it may rewind


@dataclass(frozen=True)
class SinkGone:
    """The client's connection that claimed the results closed; another may attach."""


@dataclass(frozen=True)
class Fail:
    """The session cannot go on: `error` goes upstream (and to the client, if attached)."""

    error: Error


class Move(enum.Enum):
    HERE = "here"  # computed here, nothing moving
    COPYING = "copying"  # its cache goes to a replica while it computes on here
    HOLDING = "holding"  # paused for the tail: steps arriving wait for the replica
    SENT = "sent"  # the replica took it; its owner and sink have been told to go there
    LEFT = "left"  # its owner released it here: the held steps follow, then it closes
    COMING = "coming"  # handed over here: its cache is arriving
    INSTALLED = "installed"  # its cache is in; the sender still owns it
    CLAIMED = "claimed"  # its next owner claimed it; the sender has not released it yet
    RELEASED = "released"  # the sender released it; its next owner has not claimed it yet


@dataclass(frozen=True)
class Copy:
    """Its cache starts for a replica (a drain, or a prefill node's handoff)."""


@dataclass(frozen=True)
class Pause:
    """Compute nothing more here: the cache must stand still for its tail."""


@dataclass(frozen=True)
class Unpause:
    """The hand-over failed: the session goes on here, its held steps first."""


@dataclass(frozen=True)
class Install:
    """The whole handed-over cache has come and been checked."""


@dataclass(frozen=True)
class Claim:
    """Its next owner resumed it here."""


Event = Opened | StepIn | Attach | SinkGone | Close | Fail
MoveEvent = Copy | Pause | Unpause | Taken | Release | Install | Claim

OPENING, OPEN, ATTACHED, CLOSED = State.OPENING, State.OPEN, State.ATTACHED, State.CLOSED

# state -> {event type: next state}; an event missing from its state's row is refused
TRANSITIONS: dict[State, dict[type, State]] = {
    OPENING: {Opened: OPEN, Close: CLOSED, Fail: CLOSED},
    OPEN: {StepIn: OPEN, Attach: ATTACHED, Close: CLOSED, Fail: CLOSED},
    ATTACHED: {StepIn: ATTACHED, SinkGone: OPEN, Close: CLOSED, Fail: CLOSED},
    CLOSED: {},
}

HERE, COPYING, HOLDING, SENT, LEFT = Move.HERE, Move.COPYING, Move.HOLDING, Move.SENT, Move.LEFT
COMING, INSTALLED, CLAIMED, RELEASED = Move.COMING, Move.INSTALLED, Move.CLAIMED, Move.RELEASED

# move -> {event type: next move}; an owner's Release outside a hand-over changes nothing
MOVES: dict[Move, dict[type, Move]] = {
    HERE: {Copy: COPYING, Release: HERE},
    COPYING: {Pause: HOLDING, Unpause: HERE, Release: COPYING},
    HOLDING: {Taken: SENT, Unpause: HERE, Release: HOLDING},
    SENT: {Release: LEFT, Unpause: HERE},
    LEFT: {Release: LEFT, Unpause: HERE},
    COMING: {Install: INSTALLED},
    INSTALLED: {Claim: CLAIMED, Release: RELEASED},
    CLAIMED: {Claim: CLAIMED, Release: HERE},
    RELEASED: {Claim: HERE, Release: RELEASED},
}


class SessionState:
    """One session's state and step bookkeeping. `last`: the session ends the route here (no
    next hop to wait for, and a client attaches to it)."""

    def __init__(
        self, sid: str, max_length: int, last: bool, now: float = 0.0, coming: bool = False
    ):
        """`coming`: a session handed over here, its cache still to come."""
        self.sid = sid
        self.max_length = max_length
        self.last = last
        self.state = OPENING
        self.move = COMING if coming else HERE
        self.next_pos = 0  # position the next accepted step must start at
        self.floor = 0  # where plain steps' positions end: no verification step rewinds below
        self.opened_at = now
        self.last_active = now
        self.used = False  # stepped, or (last hop) attached: someone is behind the session
        self.error: Error | None = None  # what ended the session, if a failure did

    @property
    def opening(self) -> bool:
        """Waiting for the next hop to answer the open."""
        return self.state is OPENING

    @property
    def closed(self) -> bool:
        return self.state is CLOSED

    @property
    def holds_steps(self) -> bool:
        """Paused for a hand-over: steps are kept for the replica, not computed."""
        return self.move in (HOLDING, SENT, LEFT)

    def accepts(self, event: Event | MoveEvent) -> bool:
        if isinstance(event, MoveEvent):
            return self.state is not CLOSED and type(event) in MOVES[self.move]
        return type(event) in TRANSITIONS[self.state]

    def move_on(self, event: MoveEvent) -> Move:
        """Take a hand-over's `event`; the new move. Raises the SwarmError its sender gets."""
        if not self.accepts(event):
            raise self._refusal(event)
        self.move = MOVES[self.move][type(event)]
        return self.move

    def handle(self, event: Event) -> State:
        """Take `event`; the new state. Raises the SwarmError its sender should get."""
        if not self.accepts(event) or (isinstance(event, Attach) and not self.last):
            raise self._refusal(event)
        if isinstance(event, StepIn):
            self._check_step(event)
            self.next_pos = event.pos + event.tokens
            if not event.spec:
                self.floor = self.next_pos
            self.last_active = event.now
            self.used = True
        elif isinstance(event, Attach):
            self.used = True
        elif isinstance(event, Fail):
            self.error = event.error
        self.state = TRANSITIONS[self.state][type(event)]
        return self.state

    def deadline(self, idle: float, unused: float | None = None) -> float:
        """When the session expires unless something happens: `unused` seconds after it
        opened if nobody has stepped (or, on the last hop, attached) yet, else `idle` seconds
        after its last step (`unused` None: `idle` from the open too)."""
        if not self.used and unused is not None:
            return self.opened_at + unused
        return self.last_active + idle

    def expired(self, now: float, idle: float, unused: float | None = None) -> bool:
        """Past `deadline(idle, unused)` while open."""
        return self.state in (OPEN, ATTACHED) and now >= self.deadline(idle, unused)

    def idle_for(self, now: float) -> float:
        """Seconds since the last step, or since the open if nothing came yet."""
        return now - self.last_active

    def _check_step(self, step: StepIn) -> None:
        if step.spec:
            self._check_verification(step)
        elif step.pos != self.next_pos:
            raise ProtocolError(
                f"step for positions {step.pos}:{step.pos + step.tokens} out of order; expected"
                f" position {self.next_pos}"
            )
        if not step.pos + step.tokens <= step.end <= self.max_length:
            raise ShapeMismatch(
                f"step covers {step.pos}:{step.pos + step.tokens} of a phase ending at"
                f" {step.end}; the session holds at most {self.max_length} tokens"
            )
        if step.phase == DECODE and step.tokens != 1 and not step.spec:
            raise ShapeMismatch(f"a decode step carries one token, this one {step.tokens}")

    def _check_verification(self, step: StepIn) -> None:
        if step.phase != DECODE:
            raise ProtocolError("a verification step is a decode step")
        if step.tokens > MAX_VERIFY_TOKENS:
            raise ShapeMismatch(
                f"a verification step carries at most {MAX_VERIFY_TOKENS} tokens,"
                f" this one {step.tokens}"
            )
        lowest = max(self.floor, self.next_pos - MAX_REWIND)
        if not lowest <= step.pos <= self.next_pos:
            raise ProtocolError(
                f"verification step at position {step.pos}: this session may go on at"
                f" {self.next_pos} or rewind to {lowest} at the earliest"
            )

    def _refusal(self, event: Event | MoveEvent) -> SwarmError:
        short = self.sid[:8]
        if isinstance(event, MoveEvent) and self.state is not CLOSED:
            return SessionNotFound(f"no hand-over of session {short}... is {self.move.value}")
        if isinstance(event, Attach):
            return SessionNotFound(f"no session {short}... to attach to here")
        if isinstance(event, StepIn) and self.state is OPENING:
            return ProtocolError(f"session {short}... is still opening; wait for 'opened'")
        if self.state is CLOSED:
            return SessionNotFound(f"no session {short}... on this connection")
        return ProtocolError(
            f"session {short}... is {self.state.value} and takes no {type(event).__name__}"
        )
