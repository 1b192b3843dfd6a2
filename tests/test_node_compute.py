"""The node's compute lanes: a decode step never waits behind a prompt pass, and the prompt
thread yields the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import trio

from swarm.node.compute import ComputeQueue
from swarm.protocol import DECODE, PREFILL


async def run_jobs(queue: ComputeQueue, jobs: list[tuple[str, float]]) -> dict[int, tuple]:
    """Submit (phase, seconds of blocking work) jobs 50 ms apart; each job's (finish time,
    thread name, nice value) by index."""
    finished: dict[int, tuple] = {}
    all_done = trio.Event()

    def work(seconds: float):
        time.sleep(seconds)  # blocks its thread, as a forward pass does
        tid = threading.get_native_id()
        return threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, tid)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.worker)
        for i, (phase, seconds) in enumerate(jobs):

            async def done(result, error, _elapsed, _usage, i=i):
                assert error is None
                finished[i] = (trio.current_time(), *result)
                if len(finished) == len(jobs):
                    all_done.set()

            queue.submit(phase, 1, lambda s=seconds: work(s), done)
            await trio.sleep(0.05)
        with trio.fail_after(10):
            await all_done.wait()
        nursery.cancel_scope.cancel()
    return finished


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
    ran: list[int] = []
    all_done = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.worker)

        async def nothing(*_):
            pass

        queue.submit(PREFILL, 1, lambda: time.sleep(0.2), nothing)
        await trio.sleep(0.05)  # it runs; the rest wait
        for i, rank in enumerate(ranks):

            async def done(result, error, _elapsed, _usage, i=i):
                assert error is None
                ran.append(i)
                if len(ran) == len(ranks):
                    all_done.set()

            queue.submit(PREFILL, 1, lambda: None, done, rank=rank)
        with trio.fail_after(10):
            await all_done.wait()
        nursery.cancel_scope.cancel()
    return ran


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
    async with trio.open_nursery() as nursery:
        nursery.start_soon(queue.worker)
        finished = trio.Event()

        async def done(*_):
            finished.set()

        queue.submit(PREFILL, 20, lambda: time.sleep(0.2), done)
        with trio.fail_after(10):
            await finished.wait()
        nursery.cancel_scope.cancel()
    assert 0.01 <= queue.prefill_token_seconds < 0.02  # 0.2 s over 20 tokens, and a hand-off


def spin(seconds: float) -> None:
    """Burn this thread's CPU for `seconds` of its own CPU time."""
    until = time.thread_time() + seconds
    while time.thread_time() < until:
        pass


async def test_each_job_reports_its_threads_cpu_and_its_wait_for_a_cpu():
    queue = ComputeQueue()
    usages = {}
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]  # every core busy: the spinning job must wait its turns
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(queue.worker)
            finished = trio.Event()
            for name, work in (("sleep", lambda: time.sleep(0.3)), ("spin", lambda: spin(0.3))):

                async def done(_result, error, elapsed, usage, name=name):
                    assert error is None
                    usages[name] = (elapsed, usage)
                    if len(usages) == 2:
                        finished.set()

                queue.submit(DECODE, 1, work, done)
            with trio.fail_after(30):
                await finished.wait()
            nursery.cancel_scope.cancel()
    finally:
        for p in busy:
            p.kill()
            p.wait()
    elapsed, usage = usages["sleep"]
    assert usage.cpu_s < 0.05 and usage.runqueue_s < 0.05 and elapsed >= 0.3
    elapsed, usage = usages["spin"]
    assert 0.29 <= usage.cpu_s <= elapsed
    assert usage.runqueue_s > 0.05  # it shared the cores with the spinning processes
    assert usage.cpu_s + usage.runqueue_s <= elapsed + 0.002


def test_a_pass_that_would_run_before_its_sessions_earlier_positions_is_refused(tiny_model_dir):
    """Lanes run in parallel, so a client that sends a decode step before its prompt's result
    came back could have the step computed first: the session refuses it instead of computing
    on a cache with a hole."""
    from swarm.errors import ProtocolError
    from swarm.model.blocks import KVCache, Span
    from swarm.model.source import open_model
    from swarm.node.config import NodeConfig
    from swarm.node.server import Node
    from swarm.node.sessions import Session
    from swarm.protocol import Hop, Step

    source = open_model(str(tiny_model_dir))
    node = Node(NodeConfig(start=0, end=2), Span.load(source, 0, 2), source.fingerprint())
    s = Session(
        sid="s" * 32,
        hop=0,
        route=(Hop("127.0.0.1", 1, 0, 2, ""),),
        start=0,
        end=2,
        wire_dtype="float32",
        max_length=16,
        sink_token="t",
        owner=None,
        cache=KVCache.allocate(source.config, 2, 16),
    )
    hidden = torch.randn(1, 1, source.config.hidden)
    early = node._pass(s, Step(sid=s.sid, phase=DECODE, pos=4, end=5, hidden=None), hidden)
    with pytest.raises(ProtocolError, match="before the session's earlier positions"):
        early()
    prompt = torch.randn(1, 4, source.config.hidden)
    node._pass(s, Step(sid=s.sid, phase=PREFILL, pos=0, end=4, hidden=None), prompt)()
    _, out = early()  # now in order
    assert out.shape == (1, 1, source.config.hidden) and s.cache.length == 5
