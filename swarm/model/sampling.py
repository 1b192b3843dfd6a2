"""How a reply's next token is picked from the logits before it: the client's sampler, and the
same on a route's last node where that node picks the tokens (swarm.protocol.Picking)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

import torch


class Sampling(Protocol):
    """What a sampler reads (swarm.client.options.Sampling; on a node, swarm.protocol.Picking)."""

    temperature: float
    top_p: float
    top_k: int
    seed: int | None


@dataclass(frozen=True)
class Greedy:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = 0


class Sampler:
    """Picks each token of one reply from its logits, as `sampling` says.

    A token is the Gumbel-max pick: the argmax of the tempered, top-k/top-p-masked logits plus
    Gumbel noise drawn for its position alone (from the seed and the position). That is a draw
    from the sampling distribution, and the same draw whether the tokens before it came one a
    step or in verification rounds: speculative decoding keeps a draft exactly where it equals
    this pick, so its output is the plain output, token for token, under any seed."""

    def __init__(self, sampling: Sampling | None = None):
        self.sampling = sampling = sampling or Greedy()
        self.seed = sampling.seed if sampling.seed is not None else random.randrange(2**62)

    def __call__(self, logits: torch.Tensor, position: int) -> int:
        """The token at `position` of the session, from the logits [vocab] before it."""
        s = self.sampling
        if s.temperature <= 0:
            return int(logits.argmax())
        scores = self._masked(logits.double() / s.temperature)
        noise = torch.Generator().manual_seed((self.seed * 1_000_003 + position) % 2**64)
        uniform = torch.rand(scores.shape, generator=noise, dtype=torch.float64)
        gumbel = -torch.log(-torch.log(uniform.clamp(1e-300, 1.0 - 1e-16)))
        return int((scores + gumbel).argmax())

    def _masked(self, scores: torch.Tensor) -> torch.Tensor:
        """`scores` with -inf outside the top k and the top-p nucleus."""
        s = self.sampling
        if s.top_k > 0:
            kth = torch.topk(scores, min(s.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if s.top_p < 1.0:
            probs = torch.softmax(scores, dim=-1)
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < s.top_p
            mask = torch.zeros_like(probs, dtype=torch.bool)
            mask[order[keep]] = True
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores
