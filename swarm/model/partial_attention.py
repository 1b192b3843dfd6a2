"""Attention over part of a layer's cached positions, and the exact merge of such parts.

A session whose oldest KV blocks live on another node (swarm/node/borrow.py) attends in pieces:
each holder computes its query rows' attention over the positions it holds, returning the
output normalised over those positions alone with the log-sum-exp of its scores; `merge`
rescales the pieces by their share of the whole softmax (the flash-attention algebra), which is
the attention over every position. All in float32: the merge of two pieces equals SDPA over
their union up to float32 rounding.
"""

from __future__ import annotations

import torch

from swarm.model import kernels

Partial = tuple[torch.Tensor, torch.Tensor]  # out [rows, heads, head_dim], lse [rows, heads]


def partial_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> Partial:
    """q [rows, heads, head_dim] over keys, values [kv_heads, positions, head_dim] (grouped:
    heads a multiple of kv_heads) -> out [rows, heads, head_dim] and lse [rows, heads]; `mask`
    [rows, positions] True where a row sees a position. A row that sees nothing gets out 0 and
    lse -inf: it weighs nothing in a merge."""
    rows, heads, width = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    # the query heads sharing a key head as rows of one matmul: no copy of the keys per head
    qg = q.float().transpose(0, 1).reshape(kv_heads, group * rows, width)
    scores = (qg @ keys.float().transpose(1, 2)) * scale  # [kv_heads, group * rows, positions]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask.repeat(group, 1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [kv_heads, group * rows]
    finite = torch.isfinite(lse)
    weights = torch.exp(scores - torch.where(finite, lse, 0.0)[..., None])
    out = weights @ values.float()  # a row seeing nothing: all weights 0
    out = out.view(heads, rows, width).transpose(0, 1).contiguous()
    return out, lse.view(heads, rows).transpose(0, 1).contiguous()


def cache_partial(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seen: int,
    scale: float,
    softcap: float | None = None,
) -> Partial:
    """One row q [1, heads, head_dim] over the first `seen` positions of a cache, keys and
    values [1, kv_heads, capacity, head_dim], as `partial_attention`: on swarm's kernels where
    a decode step's attention runs on them (a bfloat16 cache, no softcap), half torch's time
    at 8B shape over 256 positions, and every lender trip waits for it."""
    lib = None
    if keys.dtype == torch.bfloat16 and softcap is None:
        if keys.is_contiguous() and values.is_contiguous():
            lib = kernels.load()
    if lib is None:
        return partial_attention(q, keys[0, :, :seen], values[0, :, :seen], scale, None, softcap)
    out, lse = lib.partial(q[0], keys, values, seen, scale)
    return out[None], lse[None]


def sink_partial(sinks: torch.Tensor, rows: int, head_dim: int) -> Partial:
    """gpt-oss's sinks [heads] as a piece of their own: a softmax column a head that adds no
    value."""
    heads = sinks.shape[0]
    out = torch.zeros(rows, heads, head_dim)
    return out, sinks.float().expand(rows, heads).contiguous()


def merge(parts: list[Partial]) -> Partial:
    """The attention over the union of the pieces' positions: each piece's output weighed by
    exp(its lse - the union's lse)."""
    outs = torch.stack([p[0] for p in parts])  # [pieces, rows, heads, head_dim]
    lses = torch.stack([p[1] for p in parts])  # [pieces, rows, heads]
    total = torch.logsumexp(lses, dim=0)  # [rows, heads]
    share = torch.exp(lses - torch.where(torch.isfinite(total), total, 0.0))
    return (share[..., None] * outs).sum(dim=0), total
