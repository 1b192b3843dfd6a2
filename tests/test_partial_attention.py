"""Attention in pieces (swarm.model.partial_attention): pieces over disjoint positions, merged,
are the attention over all of them, as the model's own attention computes it (float32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from swarm.model.eager import eager_attention
from swarm.model.partial_attention import cache_partial, merge, partial_attention, sink_partial

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16  # grouped: four query heads a key head
SCALE = HEAD_DIM**-0.5


def _inputs(rows: int, positions: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g)
    keys = torch.randn(KV_HEADS, positions, HEAD_DIM, generator=g)
    values = torch.randn(KV_HEADS, positions, HEAD_DIM, generator=g)
    return q, keys, values


def _sdpa(q, keys, values, mask=None) -> torch.Tensor:
    """The model's attention (swarm.model.blocks.Block._attend) -> [rows, heads, head_dim]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        keys[None],
        values[None],
        attn_mask=mask,
        scale=SCALE,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def _split(q, keys, values, cuts: list[int], mask=None, **kw):
    bounds = [0, *cuts, keys.shape[1]]
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        m = None if mask is None else mask[:, lo:hi]
        parts.append(partial_attention(q, keys[:, lo:hi], values[:, lo:hi], SCALE, m, **kw))
    return parts


def test_one_piece_is_the_models_attention():
    q, keys, values = _inputs(1, 40)
    out, _ = partial_attention(q, keys, values, SCALE)
    torch.testing.assert_close(out, _sdpa(q, keys, values), rtol=0, atol=1e-5)


def test_merged_pieces_of_a_decode_step_equal_attention_over_all_positions():
    q, keys, values = _inputs(1, 100)
    out, _ = merge(_split(q, keys, values, [16, 48, 64]))
    torch.testing.assert_close(out, _sdpa(q, keys, values), rtol=0, atol=1e-5)


def test_a_decode_rows_piece_over_a_bfloat16_caches_first_positions_is_torchs():
    """cache_partial (swarm's kernels where they run) over the positions a cache holds so far
    is partial_attention's piece over them: the same output and log-sum-exp."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 32, 128, generator=g)
    keys, values = (torch.randn(1, 8, 96, 128, generator=g).bfloat16() for _ in range(2))
    out, lse = cache_partial(q, keys, values, 70, 128**-0.5)
    want_out, want_lse = partial_attention(q, keys[0, :, :70], values[0, :, :70], 128**-0.5)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-5)


def test_merged_lse_is_the_lse_over_all_positions():
    q, keys, values = _inputs(3, 50)
    _, whole = partial_attention(q, keys, values, SCALE)
    _, merged = merge(_split(q, keys, values, [20]))
    torch.testing.assert_close(merged, whole, rtol=0, atol=1e-5)


def test_a_prompt_chunk_is_causal_within_itself_over_borrowed_and_local_pieces():
    # positions 0:32 lent, 32:48 held, the chunk's 8 rows at positions 40:48
    q, keys, values = _inputs(8, 48)
    key_pos, row_pos = torch.arange(48), torch.arange(40, 48)[:, None]
    mask = key_pos <= row_pos
    out, _ = merge(_split(q, keys, values, [32], mask))
    torch.testing.assert_close(out, _sdpa(q, keys, values, mask), rtol=0, atol=1e-5)


def test_a_piece_a_row_cannot_see_weighs_nothing():
    q, keys, values = _inputs(2, 30)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[:, 20:] = False  # the second piece is wholly in the rows' future
    parts = _split(q, keys, values, [20], mask)
    assert torch.isneginf(parts[1][1]).all() and (parts[1][0] == 0).all()
    out, _ = merge(parts)
    torch.testing.assert_close(out, _sdpa(q, keys[:, :20], values[:, :20]), rtol=0, atol=1e-5)


def test_a_sliding_window_sees_only_its_window_in_pieces():
    window = 16
    q, keys, values = _inputs(4, 60)
    key_pos, row_pos = torch.arange(60), torch.arange(56, 60)[:, None]
    mask = (key_pos <= row_pos) & (key_pos > row_pos - window)
    out, _ = merge(_split(q, keys, values, [44], mask))
    torch.testing.assert_close(out, _sdpa(q, keys, values, mask), rtol=0, atol=1e-5)


def test_softcapped_scores_merge_as_gemma2s_eager_attention():
    q, keys, values = _inputs(2, 40)
    out, _ = merge(_split(q, keys, values, [25], softcap=5.0))
    want = eager_attention(q.transpose(0, 1)[None], keys[None], values[None], SCALE, softcap=5.0)
    torch.testing.assert_close(out, want[0].transpose(0, 1), rtol=0, atol=1e-5)


def test_sinks_merge_as_gpt_oss_eager_attention():
    q, keys, values = _inputs(1, 40)
    sinks = torch.randn(HEADS)
    parts = [*_split(q, keys, values, [10]), sink_partial(sinks, 1, HEAD_DIM)]
    out, _ = merge(parts)
    want = eager_attention(q.transpose(0, 1)[None], keys[None], values[None], SCALE, sinks=sinks)
    torch.testing.assert_close(out, want[0].transpose(0, 1), rtol=0, atol=1e-5)
