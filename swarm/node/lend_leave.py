"""A lender leaving hands its loans on (issue #52): it takes no new ones, tells each borrower
(`LendLeaving`), and waits, within the node's --grace, until each has asked its blocks back
(`Reclaim`), lent them elsewhere and closed its connection (swarm/node/borrow_link.py). What is
still held at the deadline goes with the node: those sessions replay."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from swarm.lending import LendLeaving
from swarm.node.context import send_quietly

if TYPE_CHECKING:
    from swarm.node.lender import LendTable

POLL_S = 0.05  # how often the table is looked at: it is sans IO, and a loan ends with its conn


async def tell_borrowers(lends: LendTable) -> int:
    """Take no new loans; tell the borrower of each loan held that this lender leaves. The
    loans told."""
    held = lends.leave()
    for conn, sid in held:
        await send_quietly(conn, LendLeaving(sid=sid))
    return len(held)


async def until_handed_on(lends: LendTable, deadline: float, say: Callable[[str], None]) -> None:
    """Wait until no loan is held or `deadline`; say what went where."""
    with trio.move_on_at(deadline):
        while lends.loans:
            await trio.sleep(POLL_S)
    if lends.handed_on or lends.loans:
        say(
            f"loans handed on to other lenders: {lends.handed_on}; still held at the end of the"
            f" grace period: {lends.loans} (their sessions replay)"
        )
