"""A span's pass over 1, 2, 4, 8 and 16 input rows (a decode step, a batch, a verification
round), its kernels taking their inputs in one int8 term and in two, one thread.

The same blocks are loaded twice, once per term count, and the two spans take turns pass by
pass after a 100-token prompt, so the host's drifting memory bandwidth meets both alike; each
figure is a median of --calls passes' wall time. The default model's first 10 blocks unless
--model (a GGUF file, e.g. scripts/synthetic_gguf.py's 8B-shaped one) and --blocks say.

Example: nice .venv/bin/python scripts/bench_rows.py --model l8b-2.Q4_K.gguf --blocks 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import bench  # noqa: F401 (this checkout first on the path)
import torch

from swarm.model.blocks import Span
from swarm.model.kernels import load as load_kernels
from swarm.model.source import default_model_path, open_model

ROWS = (1, 2, 4, 8, 16)
PROMPT = 100


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    p.add_argument("--blocks", type=int, default=10, help="the span: blocks 0:N")
    p.add_argument("--calls", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(1)
    source = open_model(args.model or str(default_model_path()))
    end = min(args.blocks, source.config.num_layers)
    lib = load_kernels()
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line),
        "?",
    )
    print(f"CPU: {cpu}, kernels {lib.isa if lib else 'none'}; blocks 0:{end}, one thread")
    spans = {t: Span.load(source, 0, end, terms=t) for t in (1, 2)}
    caches = {t: spans[t].allocate_cache(0, end, PROMPT + max(ROWS)) for t in (1, 2)}
    prompt = torch.randn(
        1, PROMPT, source.config.hidden, generator=torch.Generator().manual_seed(0)
    )
    for t in (1, 2):
        spans[t].forward(prompt, caches[t], 0, 0, end)
    print("rows   1 term ms   2 terms ms   2 / 1")
    for rows in ROWS:
        x = torch.randn(1, rows, source.config.hidden)
        times: dict[int, list[float]] = {1: [], 2: []}
        for call in range(args.calls + 2):  # the first two: warming up
            for t in (1, 2):
                caches[t].rewind(PROMPT)
                start = time.perf_counter()
                spans[t].forward(x, caches[t], PROMPT, 0, end)
                if call >= 2:
                    times[t].append(1000 * (time.perf_counter() - start))
        one, two = (statistics.median(times[t]) for t in (1, 2))
        print(f"{rows:4d}   {one:9.2f}   {two:10.2f}   {two / one:5.2f}")


if __name__ == "__main__":
    main()
