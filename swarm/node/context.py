"""What a session may use of its node, given once by the node (`SessionContext`), and the node's
counters it adds to.

A session, and a hand-over moving one (swarm/node/handover/), reach nothing else of the node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from swarm.dht import NodeKey
    from swarm.model.blocks import Span
    from swarm.node.compute import ComputeQueue
    from swarm.node.config import NodeConfig
    from swarm.node.directory import PeerDirectory
    from swarm.node.downstream import Downstream
    from swarm.node.observer import StepObserver
    from swarm.node.session_table import SessionTable
    from swarm.node.uplink import Uplink
    from swarm.transport import FramedStream


@dataclass
class Counters:
    """What a node's sessions and connections did, for its status line."""

    errors_sent: int = 0
    steps_done: int = 0  # forward passes
    tokens_done: int = 0  # tokens through them
    prompt_passes: int = 0  # prompt passes (a replayed session costs one or more here)
    prompt_tokens: int = 0
    moved_in: int = 0  # sessions whose cache a leaving node handed over here
    moved_out: int = 0  # sessions this node handed over to a replica
    transfers: int = 0  # handovers in flight, either way
    rounds_done: int = 0  # verification rounds computed (speculative decoding)
    steps_dropped: int = 0  # verification rounds a rewind made stale before they were computed


@dataclass(frozen=True)
class SessionContext:
    """What a session may use of its node, given once by the node; it reaches nothing else."""

    config: NodeConfig  # its limits, the prompt passes' sizes, the default wire dtype
    span: Span  # the blocks: their width, a session's cache, the passes through them
    compute: ComputeQueue  # the lanes its passes wait for
    uplink: Uplink  # where its activations, results and closes leave
    downstream: Downstream  # the connections to next hops, dialled only if announced
    sessions: SessionTable  # its place, given up when it ends, and its turn for prompt passes
    observer: StepObserver
    counters: Counters
    # a session opened with a handoff calls it once its prompt is in (handover.send.hand_off)
    hand_off: Callable[..., None] | None = None  # given the session
    # what moving sessions takes besides (swarm.node.handover): the node's weights, the next
    # hops' records, its signing key and its hand-offs' turn (one cache at a time)
    fingerprint: str = ""
    directory: PeerDirectory | None = None
    key: NodeKey | None = None
    handoff_turn: trio.Lock = field(default_factory=trio.Lock)


async def send_quietly(conn: FramedStream, msg) -> None:
    try:
        with trio.move_on_after(5):
            await conn.send(msg)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
