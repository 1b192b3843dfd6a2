"""Decode steps of different sessions computed as one pass (issue 23): the compute queue's
batching, and the node's decode pass that keeps each session's failure its own."""

from __future__ import annotations

import threading

import outcome
import pytest
import torch
import trio

from swarm.errors import ProtocolError
from swarm.model.source import open_model
from swarm.node.compute import ComputeQueue
from swarm.node.passes import DecodeItem, decode_pass
from swarm.protocol import DECODE


class Recorder:
    """A run_batch that records the batches it was given and returns each item doubled."""

    def __init__(self, fail: set[int] = frozenset()):
        self.batches: list[list[int]] = []
        self.fail = fail

    def __call__(self, items: list[int]) -> list[outcome.Outcome]:
        self.batches.append(list(items))
        return [
            outcome.Error(ValueError(f"item {i}")) if i in self.fail else outcome.Value(2 * i)
            for i in items
        ]


async def with_busy_lane(queue: ComputeQueue, nursery: trio.Nursery) -> threading.Event:
    """Occupy the decode lane with a job that runs until the returned event is set."""
    release, started = threading.Event(), trio.Event()
    token = trio.lowlevel.current_trio_token()

    def hold() -> None:
        token.run_sync_soon(started.set)
        release.wait(10)

    nursery.start_soon(queue.run, DECODE, hold, 1)
    await started.wait()
    return release


async def decode_all(queue, nursery, key_items, run_batch, results=None) -> dict:
    """Queue each (key, item) in order; `results` fills in as their passes finish."""
    results = {} if results is None else results

    async def one(key, item):
        try:
            results[item] = (await queue.decode(key, item, run_batch)).result
        except ValueError as exc:
            results[item] = exc

    for key, item in key_items:
        nursery.start_soon(one, key, item)
        await trio.sleep(0.01)  # queued in this order
    return results


async def run_with_queue(body, max_batch=8):
    queue = ComputeQueue(max_batch=max_batch)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.worker)
        await body(queue, nursery)
        nursery.cancel_scope.cancel()
    return queue


def test_decode_steps_waiting_together_run_as_one_pass():
    recorder, results = Recorder(), {}

    async def body(queue, nursery):
        release = await with_busy_lane(queue, nursery)
        async with trio.open_nursery() as inner:
            await decode_all(queue, inner, [("a", 1), ("a", 2), ("a", 3)], recorder, results)
            release.set()

    queue = trio.run(run_with_queue, body)
    assert recorder.batches == [[1, 2, 3]]
    assert results == {1: 2, 2: 4, 3: 6}
    assert queue.mean_decode_batch == 3.0


def test_a_lone_decode_step_runs_at_once_without_waiting_for_a_batch():
    recorder = Recorder()

    async def body(queue, nursery):
        with trio.fail_after(2):
            done = await queue.decode("a", 7, recorder)
        assert done.result == 14

    trio.run(run_with_queue, body)
    assert recorder.batches == [[7]]


def test_max_batch_bounds_a_pass_and_the_rest_go_in_the_next():
    recorder = Recorder()

    async def body(queue, nursery):
        release = await with_busy_lane(queue, nursery)
        async with trio.open_nursery() as inner:
            await decode_all(queue, inner, [("a", i) for i in range(5)], recorder)
            release.set()

    trio.run(run_with_queue, body, 2)
    assert recorder.batches == [[0, 1], [2, 3], [4]]


def test_steps_through_different_blocks_do_not_share_a_pass():
    recorder = Recorder()

    async def body(queue, nursery):
        release = await with_busy_lane(queue, nursery)
        async with trio.open_nursery() as inner:
            await decode_all(queue, inner, [("a", 1), ("b", 2), ("a", 3)], recorder)
            release.set()

    trio.run(run_with_queue, body)
    assert sorted(recorder.batches) == [[1, 3], [2]]


def test_one_steps_failure_in_a_pass_is_its_own():
    recorder, results = Recorder(fail={2}), {}

    async def body(queue, nursery):
        release = await with_busy_lane(queue, nursery)
        async with trio.open_nursery() as inner:
            await decode_all(queue, inner, [("a", 1), ("a", 2), ("a", 3)], recorder, results)
            release.set()

    trio.run(run_with_queue, body)
    assert recorder.batches == [[1, 2, 3]]
    assert results[1] == 2 and results[3] == 6 and isinstance(results[2], ValueError)


def test_the_leading_step_cancelled_while_its_pass_runs_leaves_the_others_their_results():
    results, doomed = {}, trio.CancelScope()
    in_pass, finish = threading.Event(), threading.Event()

    def slow(items):
        in_pass.set()
        finish.wait(10)
        return [outcome.Value(2 * i) for i in items]

    async def body(queue, nursery):
        release = await with_busy_lane(queue, nursery)
        async with trio.open_nursery() as inner:
            inner.start_soon(_cancellable, queue, doomed, slow)
            await trio.sleep(0.01)  # queued first: it leads the pass
            await decode_all(queue, inner, [("a", 2), ("a", 3)], slow, results)
            release.set()
            await trio.to_thread.run_sync(in_pass.wait, 10)
            doomed.cancel()
            finish.set()

    trio.run(run_with_queue, body)
    assert results == {2: 4, 3: 6}


async def _cancellable(queue, scope, run_batch, item=1):
    with scope:
        await queue.decode("a", item, run_batch)


def test_a_step_taken_into_a_pass_and_cancelled_leaves_only_once_the_pass_is_done():
    """Its session's cache is freed when it leaves; the pass still reads it until it ends."""
    doomed = trio.CancelScope()
    in_pass, finish = threading.Event(), threading.Event()
    passes_done, seen_on_leaving = [], []

    def slow(items):
        in_pass.set()
        finish.wait(10)
        passes_done.append(list(items))
        return [outcome.Value(2 * i) for i in items]

    async def body(queue, nursery):
        async def rider():
            await _cancellable(queue, doomed, slow, item=2)
            seen_on_leaving.append(list(passes_done))

        release = await with_busy_lane(queue, nursery)
        async with trio.open_nursery() as inner:
            await decode_all(queue, inner, [("a", 1)], slow)  # queued first: it leads
            inner.start_soon(rider)
            await trio.sleep(0.01)
            release.set()
            await trio.to_thread.run_sync(in_pass.wait, 10)
            doomed.cancel()
            await trio.sleep(0.05)  # time to leave, were it free to
            finish.set()

    trio.run(run_with_queue, body)
    assert seen_on_leaving == [[[1, 2]]]


@pytest.fixture(scope="module")
def tiny_span(tiny_model_dir):
    from swarm.model.blocks import Span

    return Span.load(open_model(str(tiny_model_dir)), 0, 6, weights="float32")


def primed(span, lengths):
    caches = []
    for n in lengths:
        cache = span.allocate_cache(0, 6, 32)
        span.forward(torch.randn(1, n, span.config.hidden), cache, 0, 0, 6)
        caches.append(cache)
    return caches


def test_a_decode_pass_fails_only_the_step_that_cannot_run(tiny_span):
    caches = primed(tiny_span, [3, 5, 7])
    steps = [torch.randn(1, 1, tiny_span.config.hidden) for _ in caches]
    items = [DecodeItem(c, c.length, h) for c, h in zip(caches, steps)]
    items[1] = DecodeItem(caches[1], caches[1].length + 4, steps[1])  # out of order
    outs = decode_pass(tiny_span, 0, 6, items)
    with pytest.raises(ProtocolError):
        outs[1].unwrap()
    assert caches[1].length == 5  # untouched
    assert [caches[0].length, caches[2].length] == [4, 8]
    assert all(outs[i].unwrap().shape == (1, 1, tiny_span.config.hidden) for i in (0, 2))


def test_a_decode_pass_gives_each_session_what_it_would_get_alone(tiny_span):
    torch.manual_seed(0)
    prompts = [torch.randn(1, n, tiny_span.config.hidden) for n in (2, 9, 4)]
    steps = [torch.randn(1, 1, tiny_span.config.hidden) for _ in prompts]

    def caches():
        out = []
        for p in prompts:
            cache = tiny_span.allocate_cache(0, 6, 32)
            tiny_span.forward(p, cache, 0, 0, 6)
            out.append(cache)
        return out

    together = caches()
    outs = decode_pass(
        tiny_span, 0, 6, [DecodeItem(c, c.length, h) for c, h in zip(together, steps)]
    )
    for cache, step, out in zip(caches(), steps, outs):
        alone = tiny_span.forward(step, cache, cache.length, 0, 6)
        torch.testing.assert_close(out.unwrap(), alone, rtol=1e-5, atol=1e-5)
