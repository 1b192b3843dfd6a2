"""A session on a node's parts in this process (swarm/node/session.py): the connections,
uplink and next hops it talks to, recorded; steps and opens to give it."""

from __future__ import annotations

import time

import torch
import trio

from swarm.node.compute import ComputeQueue
from swarm.node.config import Limits, NodeConfig
from swarm.node.context import Counters, SessionContext
from swarm.node.observer import NoObserver
from swarm.node.session import Session
from swarm.node.session_table import SessionTable
from swarm.node.uplink import Payload
from swarm.protocol import PREFILL, Hop, Open, Step
from swarm.wire import pack_tensor
from tests.helpers.doubles import HIDDEN, Doubling

SID = "s" * 32
TOKEN = "t" * 32


class Conn:
    """A connection as a session sees it: what was sent on it, in order."""

    def __init__(self) -> None:
        self.sent: list = []
        self.closed = False

    async def send(self, msg) -> None:
        self.sent.append(msg)

    def peer(self) -> str:
        return "test"

    async def aclose(self) -> None:
        self.closed = True


class Uplink:
    """Records what the session hands over to leave the node."""

    def __init__(self) -> None:
        self.payloads: list[Payload] = []
        self.control: list[tuple[object, object]] = []
        self.ended: list[str] = []

    def send_activations(self, payload: Payload) -> None:
        self.payloads.append(payload)

    def send_control(self, stream, message) -> None:
        self.control.append((stream, message))

    def end_session(self, sid: str) -> None:
        self.ended.append(sid)

    def observe_decode_arrival(self, sid: str) -> None:
        pass


class NextHops:
    """The connections to next hops: a Conn per hop dialled, or `refuse` raised."""

    def __init__(self, refuse: Exception | None = None) -> None:
        self.refuse = refuse
        self.conns: dict[str, Conn] = {}

    async def connect(self, hop: Hop) -> Conn:
        if self.refuse is not None:
            raise self.refuse
        return self.conns.setdefault(hop.link, Conn())

    def stream(self, dest: str | None) -> Conn | None:
        return self.conns.get(dest)


def context(nursery, next_hops: NextHops | None = None, **limits) -> SessionContext:
    """A node's parts as a session sees them; `limits` replace the defaults."""
    compute = ComputeQueue()
    nursery.start_soon(compute.worker)
    config = NodeConfig(start=0, end=4, limits=Limits(**limits))
    sessions = SessionTable(config.limits)
    hops = next_hops or NextHops()
    return SessionContext(
        config, Doubling(), compute, Uplink(), hops, sessions, NoObserver(), Counters()
    )


def route(hops: int) -> tuple[Hop, ...]:
    return tuple(Hop("127.0.0.1", 9000 + i, 2 * i, 2 * i + 2, f"peer{i}") for i in range(hops))


def open_msg(hops: int = 1) -> Open:
    return Open(SID, route(hops), 0, "weights", "float32", 16, TOKEN)


def step(pos: int, tokens: int, end: int, phase: str = PREFILL) -> tuple[Step, torch.Tensor]:
    hidden = torch.randn(1, tokens, HIDDEN)
    return Step(SID, phase, pos, end, pack_tensor(hidden, "float32")), hidden


async def until(done, timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not done():
            await trio.sleep(0.005)


async def start(ctx: SessionContext, nursery, msg: Open) -> tuple[Session, Conn]:
    """Admit a session opened by a new connection and start its task."""
    owner = Conn()
    session = Session(ctx, owner, msg, time.monotonic())
    ctx.sessions.add(session)
    nursery.start_soon(session.run)
    return session, owner
