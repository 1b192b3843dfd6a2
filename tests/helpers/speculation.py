"""What speculative decoding's tests share: a tuner that does as it is told."""

from __future__ import annotations

from swarm.client.tuner import Tuner


class Fixed(Tuner):
    """Always this many drafts a round and rounds in flight, whatever it measures: rounds the
    same in every run, as long as a test wants them."""

    def __init__(self, drafts: int, in_flight: int):
        super().__init__()
        self.k, self.n = drafts, in_flight

    def plan(self, produced: int, kind: int = 0) -> tuple[int, int]:
        return self.k, self.n
