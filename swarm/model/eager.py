"""Attention as transformers' eager steps (scores, then softmax, then the mix), for what SDPA
and swarm's kernels do not compute: Gemma 2's softcapped scores and gpt-oss's sinks, one learned
logit a head that takes a share of the softmax and adds no value."""

from __future__ import annotations

import torch


def eager_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    causal: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [1, heads, n, head_dim] over keys, values [1, kv_heads, m, head_dim] -> [1, heads, n,
    head_dim]; `mask` [n, m] True where a query sees a key; `sinks` [heads] float32."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = (q @ keys.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        n, m = scores.shape[-2:]
        mask = torch.ones(n, m, dtype=torch.bool).tril(diagonal=m - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32) @ values
    # gpt-oss: the sink as a last column, the row's max taken out first as transformers does
    column = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    scores = torch.cat((scores, column), dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values
    return torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :-1] @ values
