"""A re-armed trio.Event, for tasks that wait for a condition another task makes true."""

from __future__ import annotations

from collections.abc import Callable

import trio


class Signal:
    """`fire` wakes every task waiting now; `until` waits for a condition, woken by each fire.
    Whoever changes what a condition reads fires the signal, so nobody polls."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def until(self, done: Callable[[], bool]) -> None:
        while not done():
            await self._event.wait()
