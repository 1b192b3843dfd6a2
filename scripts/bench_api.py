"""The OpenAI-compatible API's own cost: requests/s and time to first text, through the API
and through `swarm.client` directly, in the same run (issue 25).

A 2-node local swarm of the default model (default weights) and `python -m swarm.api` in front
of it. For N in 1, 4, 16 concurrent users, each user (a thread) asks --rounds chat questions in
turn, streamed, greedy, --max-tokens each: once with one shared `Client` in this process (as
the API server shares one), once over HTTP to the API (SSE, raw http.client). Same questions
both ways, so both do the same tokens. Prints per N and way: requests/s, time to the first text
piece p50/p90, and the API's TTFT overhead over direct. Goal: overhead under 5% of TTFT.

    .venv/bin/python scripts/bench_api.py [--users 1,4,16] [--rounds 3] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from swarm.client.client import Client
from swarm.launch import start_swarm, stop_all

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


def run_level(ask, users: int, rounds: int) -> dict:
    """`users` threads, each asking `rounds` questions in turn; the TTFTs and requests/s."""
    ttfts: list[float] = []
    lock = threading.Lock()

    def user(u: int) -> None:
        for r in range(rounds):
            t = ask(question(u, r))
            with lock:
                ttfts.append(t)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(users) as pool:
        list(pool.map(user, range(users)))
    wall = time.perf_counter() - t0
    ttfts.sort()
    return {
        "rps": users * rounds / wall,
        "p50": statistics.median(ttfts),
        "p90": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
    }


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
        for ask in ways.values():  # warm-up: heads loaded, routes pinged, in both processes
            run_level(ask, 2, 1)
        rows = []
        for users in [int(x) for x in a.users.split(",")]:
            got = {way: run_level(ask, users, a.rounds) for way, ask in ways.items()}
            rows.append((users, got))
            d, h = got["direct"], got["api"]
            print(
                f"{users:>3} users | direct {d['rps']:.2f} req/s TTFT p50 {d['p50'] * 1e3:.0f} ms"
                f" p90 {d['p90'] * 1e3:.0f} | api {h['rps']:.2f} req/s TTFT p50"
                f" {h['p50'] * 1e3:.0f} ms p90 {h['p90'] * 1e3:.0f}"
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
