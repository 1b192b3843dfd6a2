"""What checking the nodes' work costs: a session's time with and without one check of its
last step (InferenceSession.verify), on the default model, same run, alternating.

Two replicas of each half of the model (4 nodes), so a check has another route. Prints one
table. Example: .venv/bin/python scripts/bench_verify.py --prompt-tokens 100 --new-tokens 64
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.proc import cpu_name

from devtools.launch import start_swarm, stop_all
from swarm.client.client import Client
from swarm.model.source import open_model


def session(client: Client, prompt: list[int], new: int, check: bool) -> tuple[float, float]:
    """Seconds for the session's steps, and for its check (0 without one)."""
    with client.session(len(prompt) + new + 1) as s:
        started = time.perf_counter()
        token = int(s.feed(prompt).argmax())
        for _ in range(new):
            token = int(s.feed([token]).argmax())
        steps = time.perf_counter() - started
        checked = time.perf_counter()
        if check:
            verdict = s.verify(random.Random(0))
            assert verdict.agreed, verdict
        return steps, time.perf_counter() - checked if check else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    layers = open_model(None).config.num_layers
    half = layers // 2
    spans = [(0, half), (half, layers), (0, half), (half, layers)]
    nodes = start_swarm(spans, extra=["--threads", "1"])
    prompt = [(i * 7919) % 40000 + 100 for i in range(a.prompt_tokens)]
    try:
        client = Client(nodes[0].maddrs[:1])
        runs = []
        for _ in range(a.repeats):
            runs.append(session(client, prompt, a.new_tokens, check=True))
        client.close()
    finally:
        stop_all(nodes)
    steps = statistics.median(r[0] for r in runs)
    check = statistics.median(r[1] for r in runs)
    print(f"\n{cpu_name()}; 4 nodes x 1 thread (2 per half)")
    print(f"prompt {a.prompt_tokens} tokens, {a.new_tokens} new; median of {a.repeats}")
    print(f"session steps {steps:.2f} s; one check of its last step {check:.2f} s")
    print(f"a check per session costs {check / steps:.0%} of the session's time")


if __name__ == "__main__":
    main()
