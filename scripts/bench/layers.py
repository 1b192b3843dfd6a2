"""Per-layer timing: swarm's calls on this thread, and llama.cpp's llama-bench (a yardstick
built in a scratch folder, never a dependency) on a model file."""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path


def call_seconds(fn, calls: int, threads: int) -> float:
    """After a warm-up: at 1 thread the median CPU time of `calls` calls (the kernels run on
    the calling thread), at more the fastest wall-clock call."""
    fn()
    clock = time.thread_time if threads == 1 else time.perf_counter
    times = []
    for _ in range(calls):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times) if threads == 1 else min(times)


def llama_bench(binary: str, path: Path, threads: int, args: list[str], reps: int) -> dict:
    """llama-bench's one JSON run of the test `args` on `path`."""
    cmd = [binary, "-m", str(path), "-t", str(threads), "-r", str(reps), "-o", "json", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    (run,) = json.loads(done.stdout)
    return run


def llama_seconds(binary: str, path: Path, threads: int, args: list[str], gen: int = 0) -> float:
    """Seconds of the prompt test `args`, or of one generated token if `gen`: the fastest of 5
    timed repetitions after llama-bench's warm-up (a depth's prompt is outside its timing)."""
    run = llama_bench(binary, path, threads, [*args, "-n", str(gen)], 5)
    return min(run["samples_ns"]) * 1e-9 / max(gen, 1)
