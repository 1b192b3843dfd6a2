"""How a node cuts waiting prefill pieces into forward passes."""

from __future__ import annotations

import pytest
import torch

from swarm.node.prompt import gather_wait
from swarm.node.prompt import take_tokens as _take_tokens
from swarm.protocol import PREFILL, Step


def piece(pos: int, n: int, end: int) -> tuple[Step, torch.Tensor]:
    hidden = torch.arange(pos, pos + n, dtype=torch.float32).reshape(1, n, 1)
    return Step(sid="s", phase=PREFILL, pos=pos, end=end, hidden=None), hidden


def positions(batch) -> list[int]:
    return [int(v) for _, h in batch for v in h.flatten()]


def test_small_pieces_join_one_pass_up_to_the_cap():
    pending = [piece(0, 8, 100), piece(8, 8, 100), piece(16, 8, 100)]
    batch = _take_tokens(pending, 20)
    assert positions(batch) == list(range(20))
    assert batch[0][0].pos == 0
    # the piece cut in two leaves its rest first in line, at the right position
    assert len(pending) == 1 and pending[0][0].pos == 20 and positions(pending) == [20, 21, 22, 23]


def test_a_whole_prompt_becomes_passes_of_the_cap_in_order():
    pending = [piece(0, 150, 150)]
    passes = []
    while pending:
        batch = _take_tokens(pending, 64)
        passes.append((batch[0][0].pos, sum(h.shape[1] for _, h in batch)))
        assert positions(batch) == list(range(passes[-1][0], passes[-1][0] + passes[-1][1]))
    assert passes == [(0, 64), (64, 64), (128, 22)]


def test_pieces_of_another_phase_wait_for_their_own_pass():
    pending = [piece(0, 10, 10), piece(12, 5, 17)]
    assert positions(_take_tokens(pending, 64)) == list(range(10))
    assert positions(_take_tokens(pending, 64)) == list(range(12, 17))
    assert pending == []


def test_a_pass_of_a_few_tokens_waits_a_little_for_more():
    pending = [piece(0, 3, 500), piece(3, 3, 500)]
    assert gather_wait(pending, since=10.0, now=10.03, min_tokens=16, gather_s=0.1) == (
        pytest.approx(0.07)
    )
    assert gather_wait(pending, since=10.0, now=10.2, min_tokens=16, gather_s=0.1) == 0.0


def test_a_pass_goes_at_once_with_enough_tokens_or_the_prompts_end():
    assert gather_wait([piece(0, 16, 500)], 10.0, 10.0, 16, 0.1) == 0.0
    assert gather_wait([piece(490, 10, 500)], 10.0, 10.0, 16, 0.1) == 0.0  # nothing more comes
    assert gather_wait([], 10.0, 10.0, 16, 0.1) == 0.0
