"""How much a decode step slows next to other nodes' prompt passes on the same PC.

One process times decode steps through 10 layers of the default model (one token each, 30 ms
apart) while --others processes compute 8-token prompt passes through 10 layers back to back at
nice 10, as other nodes' prompt threads do at `--prefill-nice 10`. The others start either in the
timing process's session, as `devtools.launch` starts nodes, or each in a session of its own
(`setsid`). Linux's autogroups share the CPU equally between sessions, whatever the nice values
inside them, so only in the same session do the niced passes yield to the decode steps.

    .venv/bin/python scripts/bench_cpu_share.py
    .venv/bin/python scripts/bench_cpu_share.py --others 3 --steps 300
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
import warnings

import bench  # noqa: F401  (first: OpenMP's wait policy, a node's, before torch loads)
import torch
from bench.stats import percentile

warnings.filterwarnings("ignore")

from swarm.model.blocks import KVCache, Span  # noqa: E402
from swarm.model.source import open_model  # noqa: E402

LAYERS = 10
PASS_TOKENS = 8


def load() -> Span:
    torch.set_num_threads(1)
    return Span.load(open_model(None), 0, LAYERS, weights="float32")


def prompt_passes() -> None:
    """Run forever: niced prompt passes, as a node's prefill thread."""
    span = load()
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    print("ready", flush=True)
    with torch.inference_mode():
        while True:
            cache = KVCache.allocate(span.config, 0, LAYERS, 1024)
            for pos in range(0, 1024, PASS_TOKENS):
                span.forward(torch.randn(1, PASS_TOKENS, span.config.hidden), cache, pos, 0, LAYERS)


def decode_steps(span: Span, steps: int) -> list[float]:
    cache = KVCache.allocate(span.config, 0, LAYERS, steps + 1)
    times = []
    with torch.inference_mode():
        for pos in range(steps):
            started = time.perf_counter()
            span.forward(torch.randn(1, 1, span.config.hidden), cache, pos, 0, LAYERS)
            times.append(time.perf_counter() - started)
            time.sleep(0.03)
    return times[steps // 10 :]  # past warm-up


def measure(span: Span, others: int, own_sessions: bool, steps: int) -> list[float]:
    procs = []
    try:
        for _ in range(others):
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--prompt-passes"],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    **({"start_new_session": True} if own_sessions else {"process_group": 0}),
                )
            )
        for p in procs:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a prompt-pass process did not start")
        return decode_steps(span, steps)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--others", type=int, default=2, help="prompt-pass processes beside")
    p.add_argument("--steps", type=int, default=200, help="decode steps timed per setting")
    p.add_argument("--prompt-passes", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.prompt_passes:
        prompt_passes()
        return
    span = load()
    print(f"decode step, {LAYERS} layers of the default model, {os.cpu_count()} cores:")
    base = None
    for name, others, own in (
        ("alone", 0, False),
        (f"{a.others} others, same session", a.others, False),
        (f"{a.others} others, own sessions", a.others, True),
    ):
        times = measure(span, others, own, a.steps)
        mean = statistics.fmean(times)
        base = base or mean
        print(
            f"  {name:28} mean {mean * 1e3:5.1f} ms, p50 {statistics.median(times) * 1e3:5.1f}"
            f" ms, p90 {percentile(times, 0.9) * 1e3:5.1f} ms ({mean / base:.2f}x)",
            flush=True,
        )


if __name__ == "__main__":
    main()
