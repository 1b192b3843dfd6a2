"""Generation slots shared fairly between callers (source addresses) of one API server.

First come, first served let one caller with 48 streams make another's one-token request wait
half a minute. Here a caller holds at most `per_caller` of the `total` slots, and a freed slot
goes to the waiting caller that holds the fewest, the earliest of them on a tie.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio


@dataclass(eq=False)
class _Waiter:
    caller: str
    order: int
    granted: trio.Event = field(default_factory=trio.Event)


class FairSlots:
    def __init__(self, total: int, per_caller: int):
        if total < 1 or per_caller < 1:
            raise ValueError(f"need at least one slot, got {total} and {per_caller} a caller")
        self.total, self.per_caller = total, per_caller
        self.held: Counter[str] = Counter()
        self._waiting: list[_Waiter] = []
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @asynccontextmanager
    async def slot(self, caller: str) -> AsyncIterator[None]:
        """Hold one of `caller`'s slots for the block; waits its fair turn for it."""
        waiter = _Waiter(caller, next(self._order))
        self._waiting.append(waiter)
        try:
            self._hand_out()
            await waiter.granted.wait()
        except BaseException:
            if waiter in self._waiting:
                self._waiting.remove(waiter)
            elif waiter.granted.is_set():  # granted as it was cancelled: give it on
                self._release(caller)
            raise
        try:
            yield
        finally:
            self._release(caller)

    def _release(self, caller: str) -> None:
        self.held[caller] -= 1
        if self.held[caller] <= 0:
            del self.held[caller]
        self._hand_out()

    def _hand_out(self) -> None:
        while sum(self.held.values()) < self.total:
            eligible = [w for w in self._waiting if self.held[w.caller] < self.per_caller]
            if not eligible:
                return
            chosen = min(eligible, key=lambda w: (self.held[w.caller], w.order))
            self._waiting.remove(chosen)
            self.held[chosen.caller] += 1
            chosen.granted.set()
