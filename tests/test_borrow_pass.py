"""A borrowing session's passes (swarm.node.borrow) through a span: its oldest KV blocks at a
lender (the lender's own table, swarm.node.lender, reached in process rather than over a
connection), each layer's attention merged from both; the outputs are the unborrowed ones."""

from __future__ import annotations

import pytest
import torch

from swarm.model.blocks import KVCache, Span
from swarm.model.source import open_model
from swarm.model.tiny import save_tiny
from swarm.node.borrow import (
    BLOCK,
    BorrowedCache,
    attend_request,
    borrowed_pass,
    lend_frames,
    lent_at_most,
    local_tokens,
    longest_borrowing,
    partial_of,
)
from swarm.node.config import Limits
from swarm.node.lender import LendTable, attend

LENGTH = 96  # prompt 60 in chunks, then decode steps
CAP = 2 * BLOCK  # positions kept here: the rest lent


class InProcessLender:
    """A lender's table driven with the borrower's own messages, in this thread."""

    def __init__(self, max_bytes: int = 1 << 30):
        self.table = LendTable(max_bytes, max_bytes)
        self.conn = object()
        self.lends = 0

    def lend_sync(self, cache, n):
        for frame in lend_frames("s" * 8, cache, n):
            self.table.lend(self.conn, "borrower", frame)
        self.lends += 1

    def attend_soon(self, layer, upto, q, block):
        msg = attend_request("s" * 8, layer, upto, q, block)
        reply = attend(msg, *self.table.query(self.conn, msg))
        return Answered(partial_of(reply, q.shape[0], block))


class Answered:
    """A lender's piece, computed before the trip returns (swarm.node.borrow.LentPiece)."""

    def __init__(self, piece):
        self.piece = piece

    def result(self):
        return self.piece

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.fixture(scope="module", params=["llama", "mistral", "gemma2", "gpt_oss"])
def span(request, tmp_path_factory):
    """Every block of a tiny model of the family, float32: mistral's layers slide a window of
    16, gemma2's alternate windows and softcap scores, gpt_oss's have sinks."""
    path = tmp_path_factory.mktemp(request.param)
    save_tiny(request.param, path)
    source = open_model(str(path))
    return Span.load(source, 0, source.config.num_layers, weights="float32")


def _run(span, cache, run, chunks):
    outs, pos = [], 0
    hidden = torch.randn(1, LENGTH, span.config.hidden, generator=torch.Generator().manual_seed(1))
    for n in chunks:
        outs.append(run(cache, pos, hidden[:, pos : pos + n]))
        pos += n
    return torch.cat(outs, dim=1)


def test_borrowed_passes_equal_unborrowed_ones(span):
    chunks = [25, 35] + [1] * (LENGTH - 60)
    end = span.config.num_layers
    whole = span.allocate_cache(0, end, LENGTH)
    want = _run(span, whole, lambda c, p, h: span.forward(h, c, p, 0, end), chunks)
    lender = InProcessLender()
    cache = BorrowedCache.allocate(span, 0, end, LENGTH, CAP)

    def borrowed(c, p, h):
        return borrowed_pass(span, c, lender, 0, end, p, h)

    got = _run(span, cache, borrowed, chunks)
    assert cache.offset >= LENGTH - CAP and lender.lends > 1  # most of it lent, bit by bit
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_a_windowed_layer_lends_nothing(span):
    end = span.config.num_layers
    cache = BorrowedCache.allocate(span, 0, end, LENGTH, CAP)
    lender = InProcessLender()
    _run(span, cache, lambda c, p, h: borrowed_pass(span, c, lender, 0, end, p, h), [60])
    windowed = [i for i in range(end) if (span.config.window(i) or LENGTH) < LENGTH]
    lent = {layer for (_, _), loan in lender.table._loans.items() for layer in loan.keys}
    assert lent == set(range(end)) - set(windowed)


def test_a_session_that_fits_borrows_nothing(span):
    assert local_tokens(span.config, Limits(max_cache_tokens=4096), 4096) is None
    assert local_tokens(span.config, Limits(max_cache_tokens=64), 100) == 32  # half, in blocks


def test_a_session_longer_than_an_addresss_share_borrows_keeping_that_share_here(span):
    """The defaults: a cache of 32768, of which one address may reserve 8192. A session past
    the share borrows (refused, it would need --max-host-cache-tokens raised too), keeping the
    share here rather than half the cache (16384, past the share)."""
    limits = Limits()
    assert (limits.max_cache_tokens, limits.max_host_cache_tokens) == (32768, 8192)
    assert local_tokens(span.config, limits, 8192) is None
    assert local_tokens(span.config, limits, 8193) == 8192
    assert local_tokens(span.config, limits, 65536) == 8192
    wide = Limits(max_host_cache_tokens=32768, max_forwarded_cache_tokens=32768)
    assert local_tokens(span.config, wide, 65536) == 16384  # half the cache


@pytest.mark.parametrize("chunks", [[1] * 200, [200], [25, 35, 140], [47, 1, 49, 1, 102]])
def test_a_session_as_long_as_longest_borrowing_never_lends_more_than_offered(span, chunks):
    """A node announces how long a session it could take from what a lender offers
    (swarm.node.status.borrowable): lending whole blocks, a quarter of the local ones at a
    time, such a session's passes never ask the lender for more."""
    cap, end = 4 * BLOCK, span.config.num_layers
    offered = 200 - longest_borrowing(cap, 0)  # positions: the session is 200 long
    assert longest_borrowing(cap, offered) == 200 == sum(chunks)
    assert lent_at_most(cap, 200) == offered
    cache = BorrowedCache.allocate(span, 0, end, 200, cap)
    lender = InProcessLender(max_bytes=offered * cache.position_bytes)
    hidden = torch.randn(1, 200, span.config.hidden, generator=torch.Generator().manual_seed(2))
    pos = 0
    for n in chunks:  # LendRefused if a lend asked for more than offered
        borrowed_pass(span, cache, lender, 0, end, pos, hidden[:, pos : pos + n])
        pos += n
    assert cache.offset > 200 - cap  # most of it lent


def test_a_lent_position_takes_the_keys_and_values_of_every_lending_layer(span):
    """What a node announces it could borrow and what a lender holds count the same bytes."""
    end = span.config.num_layers
    cache = BorrowedCache.allocate(span, 0, end, LENGTH, CAP)
    lender = InProcessLender()
    _run(span, cache, lambda c, p, h: borrowed_pass(span, c, lender, 0, end, p, h), [60])
    assert lender.table.lent_bytes == cache.offset * cache.position_bytes
    if all(cache.lent):
        assert cache.position_bytes == KVCache.bytes_per_token(span.config, end, span.cache_dtype)
