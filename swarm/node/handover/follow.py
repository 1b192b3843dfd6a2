"""The node before a leaving one: its next hop handed a session over (`Moved`), and it follows.

It claims the session at the replica as its owner (`Resume`), sends the steps from now on there
and, once the steps it had queued for the leaving node have gone, sends that node `Release`
(which then passes its held steps on, and `Release`, to the replica: see send.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from swarm.errors import SwarmError
from swarm.protocol import Moved, Release, Resume, Resumed

if TYPE_CHECKING:
    from swarm.node.context import SessionContext
    from swarm.node.session import Session

log = logging.getLogger("swarm.node")


async def follow(ctx: SessionContext, s: Session, moved: Moved) -> None:
    """The next hop left, handing `s` over to `moved.to`: claim it there as its owner, send the
    steps from now on there, and release it on the node that left once the steps queued for
    that node have gone. If anything fails the session stays as it was; it fails when the next
    hop is gone, and its client replays."""
    if moved.hop != s.hop + 1 or s.state.closed or s.downstream is None:
        return
    downstream, uplink = ctx.downstream, ctx.uplink
    old, dest = s.downstream, moved.to.link
    try:
        conn = await downstream.connect(moved.to)
    except SwarmError as exc:
        log.warning("cannot follow session %s... to %s: %s", s.sid[:8], dest, exc)
        return
    answer = downstream.expect_handover(dest, s.sid)
    reply = None
    uplink.send_control(conn, Resume(s.sid, s.sink_token, owner=True, sink=False))
    with trio.move_on_after(ctx.config.limits.open_timeout_s):
        reply = await answer.receive()
    downstream.forget_handover(dest, s.sid)
    if not isinstance(reply, Resumed) or s.state.closed:
        log.warning("session %s... could not follow to %s: %s", s.sid[:8], dest, reply)
        return
    s.downstream = dest
    s.route = tuple(moved.to if i == moved.hop else h for i, h in enumerate(s.route))
    await uplink.until_sent(s.sid, old)
    if (ds := downstream.stream(old)) is not None:
        uplink.send_control(ds, Release(sid=s.sid))
    log.info("session %s... follows its next hop to %s", s.sid[:8], dest)
