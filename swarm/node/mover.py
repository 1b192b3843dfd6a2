"""Gone: a hand-over's sending side is swarm.node.handover.send. Only lifecycle.py's import
lands here, until it reads `from swarm.node.handover.send import hand_over_all` and passes
`node.context`; then this file goes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from swarm.node.handover import send

if TYPE_CHECKING:
    from swarm.node.server import Node
    from swarm.records import NodeRecord


async def hand_over_all(
    node: Node, records: list[NodeRecord], me: str, deadline: float, say=print
) -> int:
    return await send.hand_over_all(node.context, records, me, deadline, say)
