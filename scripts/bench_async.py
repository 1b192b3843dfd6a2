"""A reply's time a token from trio tasks (swarm.client.aio) beside the synchronous client, in the
same run (issue 49: "a step is one hop from the caller to the socket, sync and async alike").

A 2-node local swarm of the default model (1 thread a node), one `Client` in this process. Ways,
taking turns round by round: `sync`, the reply iterated in the calling thread; `per-step`, each
step handed to a trio worker thread and back (what swarm.client.aio did before 2026-12-08, kept
here as the yardstick); `reply-thread`, `AsyncSession.tokens` (the reply on a thread of its
own, tokens handed to the loop as they come). With --busy the trio loop also runs a task that
holds it in slices of that many ms (a server busy with other requests; the slices sleep, so
they take no core from the nodes). Prints per way the time a token after the first (TPOT)
p50 over every reply, and its ratio to sync's.

    .venv/bin/python scripts/bench_async.py [--rounds 4] [--new-tokens 64] [--busy 0,2]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import trio
from bench.proc import cpu_name
from bench.stats import percentile

from devtools.launch import start_swarm, stop_all
from swarm.client.aio import AsyncSession
from swarm.client.client import Client
from swarm.client.decoding import Decoding
from swarm.client.options import Sampling
from swarm.client.reply import Sampler

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def tpot(stamps: list[float]) -> float:
    return (stamps[-1] - stamps[1]) / (len(stamps) - 2)


def sync_reply(client: Client, ids: list[int], new: int) -> list[float]:
    session = client.session(len(ids) + new, "off")
    try:
        return [time.perf_counter() for _ in Decoding(session, ids, new, Sampler(Sampling()))]
    finally:
        session.close()


async def per_step_reply(client: Client, ids: list[int], new: int) -> list[float]:
    session = client.session(len(ids) + new, "off")
    try:
        tokens, stamps = iter(Decoding(session, ids, new, Sampler(Sampling()))), []
        while await trio.to_thread.run_sync(next, tokens, None) is not None:
            stamps.append(time.perf_counter())
        return stamps
    finally:
        await trio.to_thread.run_sync(session.close)


async def reply_thread_reply(client: Client, ids: list[int], new: int) -> list[float]:
    stamps = []
    async with AsyncSession(client, len(ids) + new, "off") as s:
        async for _ in s.tokens(ids, new, Sampler(Sampling())):
            stamps.append(time.perf_counter())
    return stamps


async def hold_loop(slice_s: float) -> None:
    while True:
        time.sleep(slice_s)  # the loop is held; the core is not
        await trio.sleep(0)


def in_trio(fn, client: Client, ids: list[int], new: int, busy_s: float) -> list[float]:
    async def main():
        async with trio.open_nursery() as nursery:
            if busy_s:
                nursery.start_soon(hold_loop, busy_s)
            out = await fn(client, ids, new)
            nursery.cancel_scope.cancel()
        return out

    return trio.run(main)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--busy", default="0,2", help="ms slices the loop is held in (0: not)")
    a = p.parse_args()
    print(f"{cpu_name()}; 2 nodes x 1 thread, {a.new_tokens} tokens a reply", flush=True)
    nodes = start_swarm([(0, 15), (15, 30)], extra=["--threads", "1"])
    client = Client(nodes[0].maddrs[:1])
    try:
        ids = client.encode(PROMPT)
        for busy in [float(b) / 1000 for b in a.busy.split(",")]:
            ways = {
                "sync": partial(sync_reply, client, ids, a.new_tokens),
                "per-step": partial(in_trio, per_step_reply, client, ids, a.new_tokens, busy),
                "reply-thread": partial(
                    in_trio, reply_thread_reply, client, ids, a.new_tokens, busy
                ),
            }
            for way in ways.values():  # warm-up: heads loaded, routes measured
                way()
            got: dict[str, list[float]] = {w: [] for w in ways}
            for r in range(a.rounds):
                for w in list(ways) if r % 2 == 0 else list(ways)[::-1]:
                    got[w].append(tpot(ways[w]()))
            base = percentile(got["sync"], 0.5)
            print(f"loop held in {busy * 1000:.0f} ms slices" if busy else "loop free")
            for w, figures in got.items():
                mid = percentile(figures, 0.5)
                print(
                    f"  {w:<13} TPOT p50 {mid * 1000:6.2f} ms"
                    f" ({', '.join(f'{f * 1000:.2f}' for f in figures)})  {mid / base:.3f}x sync",
                    flush=True,
                )
    finally:
        client.close()
        stop_all(nodes)


if __name__ == "__main__":
    main()
