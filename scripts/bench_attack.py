"""An honest user's time per output token and to first token while hostile hosts flood its node.

One node serves the whole model (default: SmolLM2-135M, --weights auto); an honest client on
127.0.0.1 generates greedily, quiet and then while 1, 4 or 16 hostile hosts (127.0.0.2, ...)
flood the node from a separate process, round after round. Each hostile host holds as many
connections as the node lets it, and on them opens sessions it never uses, sends garbage
frames, and opens routes through a next hop nobody announced; with --steps some of its
connections also push prompt steps of random activations through the sessions they got.
Each flooded measurement follows a quiet one of the same user in the same run (the machine's
load drifts); a row per number of hosts gives medians and the median ratio of the pairs, then
what the node answered the attackers.

  nice -n 19 .venv/bin/python scripts/bench_attack.py [--hosts 1 4 16] [--rounds 2] [--steps]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import time
from collections import Counter

import bench  # noqa: F401  (first: OpenMP's wait policy, a node's, before torch loads)
import torch
import trio
from bench.timing import session_greedy

from devtools.launch import NodeProcess, start_swarm, stop_all
from swarm.client.client import Client
from swarm.errors import SwarmError
from swarm.model.source import open_model
from swarm.protocol import Attach, Error, Hop, Open, Step
from swarm.tls import dial
from swarm.transport import FramedStream
from swarm.wire import pack_tensor

CONNS_PER_HOST = 40  # more than a node's default share of 32
REPLY_TIMEOUT = 5.0


# ---- the hostile hosts (in their own process) ------------------------------------------------


class Flood:
    def __init__(self, addr, peer, tls, fingerprint, hidden, num_layers, steps: bool):
        self.addr, self.peer, self.tls, self.fingerprint = addr, peer, tls, fingerprint
        self.hidden, self.num_layers, self.steps = hidden, num_layers, steps
        self.answers: Counter = Counter()

    def open(self, route: tuple[Hop, ...], max_length: int = 256) -> Open:
        return Open(
            sid=os.urandom(16).hex(),
            route=route,
            hop=0,
            fingerprint=self.fingerprint,
            wire_dtype="float16",
            max_length=max_length,
            sink_token="s" * 32,
        )

    def me(self, end: int | None = None) -> Hop:
        return Hop(self.addr[0], self.addr[1], 0, end or self.num_layers, self.peer, self.tls)

    async def reply(self, conn: FramedStream) -> str:
        with trio.fail_after(REPLY_TIMEOUT):
            msg = await conn.receive()
        if msg is None:
            raise EOFError
        kind = f"error:{msg.code}" if isinstance(msg, Error) else msg.t
        self.answers[kind] += 1
        return kind

    async def connection(self, source: str, role: int, stop: trio.Event) -> None:
        rng = random.Random(role)
        while not stop.is_set():
            try:
                stream = await trio.open_tcp_stream(*self.addr, local_address=source)
                # attackers speak TLS as everyone does: the handshake is the node's cost too
                conn = FramedStream(await dial(stream, self.tls, "the node"))
            except SwarmError as exc:  # refused before TLS (the address's share is full)
                self.answers[f"error:{exc.code}"] += 1
                await trio.sleep(0.2)
                continue
            except (OSError, trio.BrokenResourceError, trio.TooSlowError):
                self.answers["connect failed"] += 1
                await trio.sleep(0.5)
                continue
            try:
                while not stop.is_set():
                    await self.act(conn, role, rng)
            except (EOFError, trio.TooSlowError, trio.BrokenResourceError, OSError):
                self.answers["closed"] += 1
            except Exception as exc:  # an answer we cannot parse is a finding too
                self.answers[f"bad reply {type(exc).__name__}"] += 1
            finally:
                await conn.aclose()
            await trio.sleep(0.2)

    async def act(self, conn: FramedStream, role: int, rng: random.Random) -> None:
        kind = role % 4
        if kind == 0 or (kind == 3 and not self.steps):  # sessions never used
            await conn.send(self.open((self.me(),)))
            await self.reply(conn)
            await trio.sleep(1.0)
        elif kind == 1:  # garbage
            body = rng.randbytes(rng.randrange(1, 200))
            await conn.send_raw(len(body).to_bytes(4, "big") + body)
            await self.reply(conn)
            await trio.sleep(0.2)
        elif kind == 2:  # a route through a next hop nobody announced
            split = self.num_layers // 2
            bogus = Hop("127.0.0.1", 9, split, self.num_layers, "QmNobody")
            await conn.send(self.open((self.me(split), bogus)))
            await self.reply(conn)
            await trio.sleep(0.5)
        else:  # prompt steps of random activations on its own session, as fast as answered
            msg = self.open((self.me(),), max_length=256)
            await conn.send(msg)
            if await self.reply(conn) != "opened":
                await trio.sleep(1.0)
                return
            await conn.send(Attach(sid=msg.sid, sink_token=msg.sink_token))
            await self.reply(conn)
            for pos in range(0, 256, 64):
                hidden = pack_tensor(torch.randn(1, 64, self.hidden), "float16")
                await conn.send(
                    Step(sid=msg.sid, phase="prefill", pos=pos, end=pos + 64, hidden=hidden)
                )
                await self.reply(conn)

    async def run(self, hosts: int, seconds_file: str) -> None:
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            for h in range(hosts):
                source = f"127.0.0.{2 + h}"
                for role in range(CONNS_PER_HOST):
                    nursery.start_soon(self.connection, source, role, stop)
            while not os.path.exists(seconds_file):
                await trio.sleep(0.1)
            stop.set()
            nursery.cancel_scope.deadline = trio.current_time() + 2


def flood_process(args, hosts: int, stop_file: str, out: mp.Queue) -> None:
    os.nice(5)  # the attack is on the node, not on this machine's CPU
    torch.set_num_threads(1)
    flood = Flood(*args)
    trio.run(flood.run, hosts, stop_file)
    out.put(dict(flood.answers))


# ---- the honest user ------------------------------------------------------------------------


def honest(client: Client, prompt: list[int], new: int) -> tuple[float, float]:
    """(time to first token, mean time per output token) of one greedy generation."""
    t = session_greedy(client, prompt, new)
    return t.ttft, t.tpot


def measure(client, prompt, new, generations) -> tuple[list, int]:
    runs, failed = [], 0
    for _ in range(generations):
        try:
            runs.append(honest(client, prompt, new))
        except Exception as exc:
            print(f"    honest generation failed: {type(exc).__name__}: {exc}", flush=True)
            failed += 1
    return runs, failed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hosts", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--generations", type=int, default=3, help="honest generations per round")
    p.add_argument("--prompt-tokens", type=int, default=48)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--warmup", type=float, default=4.0, help="seconds of flood before measuring")
    p.add_argument("--steps", action="store_true", help="attackers also push prompt steps")
    p.add_argument("--weights", default="auto")
    p.add_argument("--node-arg", action="append", default=[], help="extra node option")
    a = p.parse_args()
    src = open_model(None)
    cfg = src.config
    extra = ["--weights", a.weights, "--announce-ttl", "10", *a.node_arg]
    node: NodeProcess = start_swarm([(0, cfg.num_layers)], extra=extra)[0]
    host, _, port = node.addr.rpartition(":")
    flood_args = ((host, int(port)), node.peer, node.tls, src.fingerprint(), cfg.hidden)
    flood_args += (cfg.num_layers,)
    flood_args += (a.steps,)
    prompt = [(i * 7919) % 40000 + 100 for i in range(a.prompt_tokens)]
    client = Client(node.maddrs[:1])
    # (hosts) -> per round: (quiet runs just before, runs under the flood)
    pairs: dict[int, list[tuple[list, list]]] = {h: [] for h in a.hosts}
    failed: Counter = Counter()
    answers: dict[int, Counter] = {h: Counter() for h in a.hosts}
    try:
        honest(client, prompt, 4)  # warm up
        for r in range(a.rounds):
            for hosts in a.hosts:
                quiet, bad = measure(client, prompt, a.new_tokens, a.generations)
                failed[0] += bad
                stop_file = f"/tmp/bench-attack-stop-{os.getpid()}-{r}-{hosts}"
                out: mp.Queue = mp.Queue()
                proc = mp.Process(target=flood_process, args=(flood_args, hosts, stop_file, out))
                proc.start()
                time.sleep(a.warmup)
                runs, bad = measure(client, prompt, a.new_tokens, a.generations)
                open(stop_file, "w").close()
                answers[hosts].update(out.get(timeout=60))
                proc.join(30)
                os.unlink(stop_file)
                failed[hosts] += bad
                pairs[hosts].append((quiet, runs))
                print(
                    f"  round {r} hosts {hosts:2d}: TPOT {_med(runs, 1) * 1000:.1f} ms,"
                    f" quiet just before {_med(quiet, 1) * 1000:.1f} ms",
                    flush=True,
                )
                time.sleep(2)  # the node lets go of what the flood left
    finally:
        client.close()
        stop_all([node])
    load = os.getloadavg()
    print(
        f"\n{cfg.name}, one node ({a.weights}), prompt {a.prompt_tokens}, {a.new_tokens} new"
        f" tokens; per round {a.generations} generations quiet, then {a.generations} under the"
        f" flood; {a.rounds} rounds{'; attackers push prompt steps' if a.steps else ''};"
        f" load {load[0]:.1f}"
    )
    print("ratios: median over rounds of (flooded / quiet just before)")
    print(
        f"{'hostile hosts':>14}{'TTFT ms':>9}{'quiet':>8}{'ratio':>7}{'TPOT ms':>9}{'quiet':>8}"
        f"{'ratio':>7}{'failed':>8}"
    )
    for hosts, rounds in pairs.items():
        ok = [(q, f) for q, f in rounds if q and f]
        if not ok:
            print(f"{hosts:>14}{'-':>9}{'':>8}{'':>7}{'-':>9}{'':>8}{'':>7}{failed[hosts]:>8}")
            continue
        cells = []
        for k in (0, 1):
            flooded = statistics.median(_med(f, k) for _, f in ok)
            quiet = statistics.median(_med(q, k) for q, _ in ok)
            ratio = statistics.median(_med(f, k) / _med(q, k) for q, f in ok)
            cells.append(f"{flooded * 1000:>9.1f}{quiet * 1000:>8.1f}{ratio:>7.2f}")
        print(f"{hosts:>14}{''.join(cells)}{failed[hosts]:>8}")
    print(f"quiet generations failed: {failed[0]}")
    for hosts, counts in answers.items():
        told = ", ".join(f"{k} {n}" for k, n in counts.most_common())
        print(f"answers to {hosts} hosts: {told}")


def _med(runs: list[tuple[float, float]], k: int) -> float:
    return statistics.median(r[k] for r in runs)


if __name__ == "__main__":
    main()
