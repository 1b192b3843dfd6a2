"""Rotary position embeddings: a table of cos and sin per position for one `Rope`, computed
with transformers' formulas in float32 so the exact path stays bit-exact."""

from __future__ import annotations

import math

import torch

from swarm.model.config import Llama3Rope, Rope, YarnRope


def llama3_frequencies(inv_freq: torch.Tensor, rope: Llama3Rope) -> torch.Tensor:
    """`inv_freq` [dim/2] as Llama 3.1 scales it (the same float32 steps as transformers)."""
    low_wavelen = rope.original_max / rope.low_freq_factor
    high_wavelen = rope.original_max / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    between = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(between, blended, scaled)


def yarn_frequencies(theta: float, dim: int, yarn: YarnRope) -> torch.Tensor:
    """RoPE's [dim/2] frequencies as YaRN blends them (transformers' float32 steps, which
    llama.cpp's ramp and rounding agree with)."""

    def dim_of(turns: float) -> float:  # the dim that turns `turns` times in original_max
        return dim * math.log(yarn.original_max / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(yarn.beta_fast), dim_of(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1 for the fast dims, extrapolated; 0 for the slow ones, interpolated
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return 1.0 / (yarn.factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept


class Rotary:
    """cos and sin of every position up to the longest seen, for the first `dim` dims of a head
    (all of them but for partial rotary models), computed once and indexed per step."""

    def __init__(self, rope: Rope, dim: int):
        self.inv_freq = 1.0 / (
            rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
        )  # [dim/2]
        if rope.llama3 is not None:
            self.inv_freq = llama3_frequencies(self.inv_freq, rope.llama3)
        if rope.linear != 1.0:
            self.inv_freq = self.inv_freq / rope.linear
        # YaRN's mscale: on cos and sin, so on q and k both (scores by its square)
        self.scale = 1.0
        if rope.yarn is not None:
            self.inv_freq = yarn_frequencies(rope.theta, dim, rope.yarn)
            self.scale = rope.yarn.attention
        if rope.proportion != 1.0:  # transformers' own rounding of the share turned
            self.inv_freq[int(rope.proportion * dim // 2) :] = 0.0
        if rope.freq_factors:
            if len(rope.freq_factors) != len(self.inv_freq):
                raise ValueError(
                    f"{len(rope.freq_factors)} RoPE frequency factors for {len(self.inv_freq)}"
                    " frequencies"
                )
            factors = torch.tensor(rope.freq_factors, dtype=torch.float32)
            self.inv_freq = self.inv_freq / factors
        self.cos = self.sin = torch.empty(0, dim)

    def _grow(self, length: int) -> None:
        length = max(length, 2 * len(self.cos), 256)
        positions = torch.arange(length, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]  # [length, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [length, dim]
        self.cos, self.sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            self.cos, self.sin = self.cos * self.scale, self.sin * self.scale

    def cos_sin(self, pos: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [pos, pos + n): cos, sin [n, dim]."""
        if pos + n > len(self.cos):
            self._grow(pos + n)
        return self.cos[pos : pos + n], self.sin[pos : pos + n]

    def at(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One position per row: cos, sin [rows, dim]."""
        if max(positions) + 1 > len(self.cos):
            self._grow(max(positions) + 1)
        index = torch.tensor(positions)
        return self.cos[index], self.sin[index]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, head_dim] turned by cos, sin [rows, dim]: the first dim dims of each
    head, the rest passed through (partial rotary)."""
    cos, sin = cos[:, None], sin[:, None]
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    turned, kept = x[..., :dim], x[..., dim:]
    return torch.cat((turned * cos + _rotate_half(turned) * sin, kept), dim=-1)
