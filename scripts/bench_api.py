"""The OpenAI-compatible API's own cost: requests/s and time to first text, through the API
and through `swarm.client` directly, in the same run (issue 25).

A 2-node local swarm of the default model (default weights) and `python -m swarm.api` in front
of it. For N in 1, 4, 16 concurrent users (threads), --rounds rounds of one streamed, greedy chat
question each (--max-tokens), rounds taking turns between two ways: one shared `Client` in this
process (as the API server shares one), and HTTP to the API (SSE, raw http.client). CPU per
request is the client's work: this process's for direct, the API server's for the API. Same
questions both ways, so both do the same tokens. Prints per N and way: requests/s, time to the
first text piece p50/p90, and the API's TTFT overhead over direct. Goal: overhead under 5%.

    .venv/bin/python scripts/bench_api.py [--users 1,4,16] [--rounds 3] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from bench.proc import cpu_seconds
from bench.stats import percentile

from devtools.launch import start_swarm, stop_all
from swarm.client.client import Client

GOAL_OVERHEAD = 0.05


def question(user: int, round_: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"User {user}, question {round_}: name a fruit and why."}]


def direct_one(client: Client, messages, max_tokens: int) -> float:
    t0 = time.perf_counter()
    first = None
    for _piece in client.stream(messages, max_new_tokens=max_tokens):
        first = first or time.perf_counter() - t0
    return first


def api_one(host: str, port: int, model: str, messages, max_tokens: int) -> float:
    body = json.dumps(
        {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
         "stream": True}
    )  # fmt: skip
    conn = http.client.HTTPConnection(host, port, timeout=300)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    first = None
    for line in resp:
        if first is None and line.startswith(b"data: ") and b'"content":"' in line:
            if not line.rstrip().endswith(b"[DONE]") and b'"content":""' not in line:
                first = time.perf_counter() - t0
    conn.close()
    return first


def run_round(ask, users: int, r: int, cpu) -> tuple[list[float], float, float]:
    """`users` threads asking one question each at once: TTFTs, wall seconds, CPU seconds of
    whoever does the client's work (`cpu()`)."""
    c0, t0 = cpu(), time.perf_counter()
    with ThreadPoolExecutor(users) as pool:
        ttfts = list(pool.map(lambda u: ask(question(u, r)), range(users)))
    return ttfts, time.perf_counter() - t0, cpu() - c0


def run_level(ways: dict, cpus: dict, users: int, rounds: int) -> dict[str, dict]:
    """Rounds taking turns between the ways (each first in every other round)."""
    acc = {w: ([], 0.0, 0.0) for w in ways}
    for r in range(rounds):
        for way in list(ways) if r % 2 == 0 else list(ways)[::-1]:
            ttfts, wall, cpu = run_round(ways[way], users, r, cpus[way])
            a = acc[way]
            acc[way] = (a[0] + ttfts, a[1] + wall, a[2] + cpu)
    out = {}
    for way, (ttfts, wall, cpu) in acc.items():
        out[way] = {
            "rps": users * rounds / wall,
            "p50": percentile(ttfts, 0.5),
            "p90": percentile(ttfts, 0.9),
            "cpu_ms": 1000 * cpu / (users * rounds),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--users", default="1,4,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    a = p.parse_args()
    nodes = start_swarm([(0, 15), (15, 30)])
    api = None
    client = None
    try:
        peers = nodes[0].maddrs[:1]
        api = subprocess.Popen(
            [sys.executable, "-m", "swarm.api", "--initial-peers", *peers, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for line in api.stdout:
            if m := re.search(r"api on http://([\d.]+):(\d+)/v1 serving (\S+);", line):
                host, port, model = m.group(1), int(m.group(2)), m.group(3)
                break
        else:
            raise SystemExit("the API server did not start")
        threading.Thread(target=api.stdout.read, daemon=True).start()
        client = Client(peers)
        ways = {
            "direct": lambda m: direct_one(client, m, a.max_tokens),
            "api": lambda m: api_one(host, port, model, m, a.max_tokens),
        }
        # the client's work: in this process for direct, in the API server's for the API
        cpus = {"direct": time.process_time, "api": lambda: cpu_seconds(api.pid)}
        run_level(ways, cpus, 2, 2)  # warm-up: heads loaded, routes pinged, in both processes
        rows = []
        for users in [int(x) for x in a.users.split(",")]:
            got = run_level(ways, cpus, users, a.rounds)
            rows.append((users, got))
            d, h = got["direct"], got["api"]
            print(
                f"{users:>3} users | direct {d['rps']:.2f} req/s TTFT p50 {d['p50'] * 1e3:.0f} ms"
                f" p90 {d['p90'] * 1e3:.0f}, CPU {d['cpu_ms']:.0f} ms/request | api"
                f" {h['rps']:.2f} req/s TTFT p50 {h['p50'] * 1e3:.0f} ms p90"
                f" {h['p90'] * 1e3:.0f}, CPU {h['cpu_ms']:.0f} ms/request"
                f" | overhead p50 {h['p50'] / d['p50'] - 1:+.1%}",
                flush=True,
            )
        print(f"\n| users | req/s direct | req/s API | TTFT p50 direct | TTFT p50 API | overhead"
              f" (goal < {GOAL_OVERHEAD:.0%}) |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        for users, got in rows:
            d, h = got["direct"], got["api"]
            print(
                f"| {users} | {d['rps']:.2f} | {h['rps']:.2f} | {d['p50'] * 1e3:.0f} ms"
                f" | {h['p50'] * 1e3:.0f} ms | {h['p50'] / d['p50'] - 1:+.1%} |"
            )
    finally:
        if client is not None:
            client.close()
        if api is not None:
            api.terminate()
            api.wait(20)
        stop_all(nodes)


if __name__ == "__main__":
    main()
