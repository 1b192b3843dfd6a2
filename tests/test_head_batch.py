"""A client's LM head shared by sessions in several threads: rows ready together share one
matmul, and each caller gets its own row's logits (issue 23)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from swarm.client.head_batch import LogitsBatcher
from swarm.model.head import Head
from swarm.model.source import open_model

THREADS = 6


@pytest.fixture(scope="module")
def heads(tiny_model_dir):
    source = open_model(str(tiny_model_dir))
    return {w: Head.load(source, w) for w in ("int8", "float32")}


def held_first_call(head: Head, batcher: LogitsBatcher, queued: int) -> Head:
    """`head` whose first matmul waits until `queued` more rows wait behind it, so they must
    share the next one (the head computes as before; it is only held back)."""
    compute, first = head.logits_rows, threading.Event()

    def logits_rows(hidden):
        if not first.is_set():
            first.set()
            deadline = time.monotonic() + 10
            while len(batcher._waiting) < queued and time.monotonic() < deadline:
                time.sleep(0.005)
        return compute(hidden)

    head.logits_rows = logits_rows
    return head


def in_threads(fn, n: int) -> list:
    results: list = [None] * n

    def run(i: int) -> None:
        results[i] = fn(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
        time.sleep(0.01)  # the first one leads; the rest queue behind it
    for t in threads:
        t.join(20)
    return results


def test_rows_ready_together_share_one_matmul_and_each_gets_its_own_logits(heads):
    batcher = LogitsBatcher()
    head = heads["int8"]
    hidden = torch.randn(THREADS, head.config.hidden)
    alone = [head.logits(hidden[i : i + 1]) for i in range(THREADS)]
    held_first_call(head, batcher, THREADS - 1)
    got = in_threads(lambda i: batcher.logits(head, hidden[i : i + 1]), THREADS)
    del head.logits_rows  # the fixture's head computes unheld again
    assert batcher.batches == 2 and batcher.rows == THREADS  # one alone, then the rest together
    for mine, want in zip(got, alone):
        assert int(mine.argmax()) == int(want.argmax())
        torch.testing.assert_close(mine.topk(8).values, want.topk(8).values)


def test_the_float32_head_computes_each_row_alone(heads):
    batcher = LogitsBatcher()
    head = heads["float32"]
    hidden = torch.randn(THREADS, head.config.hidden)
    got = in_threads(lambda i: batcher.logits(head, hidden[i : i + 1]), THREADS)
    assert batcher.batches == 0
    for i, mine in enumerate(got):
        assert torch.equal(mine, head.logits(hidden[i : i + 1]))


def test_a_failing_head_fails_its_callers_and_the_batcher_serves_on(heads):
    batcher = LogitsBatcher()
    head = heads["int8"]
    with pytest.raises(RuntimeError):
        batcher.logits(head, torch.randn(1, head.config.hidden + 1))  # wrong width
    assert batcher.logits(head, torch.randn(1, head.config.hidden)).shape == (head.config.vocab,)
