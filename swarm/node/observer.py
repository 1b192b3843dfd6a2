"""The hook through which benchmarks see a node's steps; the node itself records nothing.

A node calls its observer as prompt pieces arrive and as decode steps and prompt passes finish,
with monotonic times and what the compute thread got from the OS. The default observer does
nothing; a benchmark passes its own (the step log of scripts/bench_link.py lives in devtools/).
"""

from __future__ import annotations

from typing import Protocol

from swarm.node.compute import Usage


class StepObserver(Protocol):
    def prompt_piece(self, sid: str, now: float, pos: int, tokens: int, end: int) -> None:
        """A prefill piece of `tokens` at `pos` (of a phase ending at `end`) arrived at `now`."""

    def decode_step(self, arrived: float, now: float, compute_s: float, usage: Usage) -> None:
        """A decode step that arrived at `arrived` was queued for the link at `now`."""

    def prompt_pass(
        self, sid: str, now: float, pos: int, tokens: int, end: int, compute_s: float, usage: Usage
    ) -> None:
        """A prompt pass over `tokens` from `pos` finished at `now`."""


class NoObserver:
    def prompt_piece(self, sid: str, now: float, pos: int, tokens: int, end: int) -> None:
        pass

    def decode_step(self, arrived: float, now: float, compute_s: float, usage: Usage) -> None:
        pass

    def prompt_pass(
        self, sid: str, now: float, pos: int, tokens: int, end: int, compute_s: float, usage: Usage
    ) -> None:
        pass
