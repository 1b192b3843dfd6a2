"""The node's compute lanes: a decode step never waits behind a prompt pass, and the prompt
thread yields the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import trio

from swarm.node.compute import ComputeQueue, Ticket, Usage
from swarm.protocol import DECODE, PREFILL


@dataclass
class Work:
    """One compute job for `run_all`: submitted, then `then` seconds before the next one."""

    phase: str
    run: Callable[[], Any]
    tokens: int = 1
    rank: float = 0.0
    then: float = 0.0


@dataclass
class Finished:
    at: float  # trio time
    result: Any
    elapsed: float
    usage: Usage


async def run_all(
    queue: ComputeQueue, jobs: list[Work], timeout: float = 10
) -> dict[int, Finished]:
    """Queue the jobs on a running queue; how each finished, by index, in the order they did."""
    finished: dict[int, Finished] = {}

    async def finish(i: int, ticket: Ticket, job: Work) -> None:
        try:
            await ticket.turn()
            done = await ticket.run(job.run, job.tokens)
        finally:
            ticket.release()
        finished[i] = Finished(trio.current_time(), done.result, done.elapsed, done.usage)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.worker)
        with trio.fail_after(timeout):
            async with trio.open_nursery() as jobs_nursery:
                for i, job in enumerate(jobs):
                    # a place in the queue now, in this order, whenever its task first runs
                    jobs_nursery.start_soon(finish, i, queue.reserve(job.phase, job.rank), job)
                    await trio.sleep(job.then)
        nursery.cancel_scope.cancel()
    return finished


async def run_jobs(queue: ComputeQueue, jobs: list[tuple[str, float]]) -> dict[int, tuple]:
    """Submit (phase, seconds of blocking work) jobs 50 ms apart; each job's (finish time,
    thread name, nice value) by index."""

    def work(seconds: float):
        time.sleep(seconds)  # blocks its thread, as a forward pass does
        tid = threading.get_native_id()
        return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, tid)

    got = await run_all(
        queue, [Work(phase, lambda s=seconds: work(s), then=0.05) for phase, seconds in jobs]
    )
    return {i: (f.at, *f.result) for i, f in got.items()}


async def test_a_decode_step_runs_while_a_prompt_pass_computes():
    started = trio.current_time()
    got = await run_jobs(ComputeQueue(lanes=2), [(PREFILL, 0.6), (DECODE, 0.05)])
    assert got[1][0] - started < 0.3  # did not wait for the 0.6 s pass
    assert got[0][0] > got[1][0]
    assert (got[0][1], got[1][1]) == ("prefill", "decode")


async def test_with_one_lane_a_decode_step_waits_for_the_running_pass():
    started = trio.current_time()
    got = await run_jobs(ComputeQueue(lanes=1), [(PREFILL, 0.4), (DECODE, 0.01)])
    assert got[1][0] - started >= 0.4
    # but it still goes before prompt passes queued behind the running one
    got = await run_jobs(ComputeQueue(lanes=1), [(PREFILL, 0.2), (PREFILL, 0.2), (DECODE, 0.01)])
    assert got[2][0] < got[1][0]


async def test_the_prompt_thread_runs_at_the_given_nice_value_and_decode_at_ours():
    own = os.getpriority(os.PRIO_PROCESS, 0)
    got = await run_jobs(ComputeQueue(lanes=2, prefill_nice=7), [(PREFILL, 0.0), (DECODE, 0.0)])
    assert got[0][2] == min(19, own + 7)
    assert got[1][2] == own


def test_a_node_computes_in_one_or_two_lanes():
    with pytest.raises(ValueError):
        ComputeQueue(lanes=3)
    with pytest.raises(ValueError, match="prompt pass order"):
        ComputeQueue(prefill_order="newest")


async def run_ranked(queue: ComputeQueue, ranks: list[float]) -> list[int]:
    """Hold the prompt lane with a pass, queue passes of the given ranks behind it: the order
    they ran in, by index."""
    hold = Work(PREFILL, lambda: time.sleep(0.2), then=0.05)  # it runs; the rest wait
    got = await run_all(queue, [hold] + [Work(PREFILL, lambda: None, rank=r) for r in ranks])
    return [i - 1 for i in got if i > 0]


async def test_waiting_prompt_passes_go_lowest_rank_first_then_in_order():
    assert await run_ranked(ComputeQueue(), [3.0, 1.0, 2.0, 1.0]) == [1, 3, 2, 0]


def test_a_prompt_ranks_by_its_arrival_plus_the_compute_it_still_needs():
    queue = ComputeQueue()
    assert queue.prefill_rank(since=5.0, tokens_left=100) == 5.0  # no pass timed yet: arrival
    queue.prefill_token_seconds = 0.01
    assert queue.prefill_rank(since=5.0, tokens_left=100) == pytest.approx(6.0)
    # a prompt needing 1 s more goes after one needing 0.2 s that arrived 0.5 s later
    assert queue.prefill_rank(4.5, 100) > queue.prefill_rank(5.0, 20)
    # but before it if it has waited longer than the difference: 1 s
    assert queue.prefill_rank(3.9, 100) < queue.prefill_rank(5.0, 20)
    turns = ComputeQueue(prefill_order="round-robin")
    turns.prefill_token_seconds = 0.01
    assert turns.prefill_rank(4.5, 100) == turns.prefill_rank(5.0, 20) == 0.0


async def test_the_compute_time_per_prompt_token_is_measured():
    queue = ComputeQueue()
    await run_all(queue, [Work(PREFILL, lambda: time.sleep(0.2), tokens=20)])
    assert 0.01 <= queue.prefill_token_seconds < 0.02  # 0.2 s over 20 tokens, and a hand-off


def spin(seconds: float) -> None:
    """Burn this thread's CPU for `seconds` of its own CPU time."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


async def test_each_job_reports_its_threads_cpu_and_its_wait_for_a_cpu():
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]  # every core busy: the spinning job must wait its turns
    try:
        got = await run_all(
            ComputeQueue(),
            [Work(DECODE, lambda: time.sleep(0.3)), Work(DECODE, lambda: spin(0.3))],
            timeout=30,
        )
    finally:
        for p in busy:
            p.kill()
            p.wait()
    sleep, spun = got[0], got[1]
    assert sleep.usage.cpu_s < 0.05 and sleep.usage.runqueue_s < 0.05 and sleep.elapsed >= 0.3
    assert 0.29 <= spun.usage.cpu_s <= spun.elapsed
    assert spun.usage.runqueue_s > 0.05  # it shared the cores with the spinning processes
    assert spun.usage.cpu_s + spun.usage.runqueue_s <= spun.elapsed + 0.002


def test_a_pass_that_would_run_before_its_sessions_earlier_positions_is_refused(tiny_model_dir):
    """Lanes run in parallel, so a client that sends a decode step before its prompt's result
    came back could have the step computed first: the session refuses it instead of computing
    on a cache with a hole."""
    from swarm.errors import ProtocolError
    from swarm.model.blocks import Span
    from swarm.model.source import open_model
    from swarm.node.passes import forward_pass

    source = open_model(str(tiny_model_dir))
    span = Span.load(source, 0, 2, weights="float32")
    cache = span.allocate_cache(0, 2, 16)
    hidden = torch.randn(1, 1, source.config.hidden)
    with pytest.raises(ProtocolError, match="before the session's earlier positions"):
        forward_pass(span, cache, 0, 2, 4, hidden)
    prompt = torch.randn(1, 4, source.config.hidden)
    forward_pass(span, cache, 0, 2, 0, prompt)
    out = forward_pass(span, cache, 0, 2, 4, hidden)  # now in order
    assert out.shape == (1, 1, source.config.hidden) and cache.length == 5
