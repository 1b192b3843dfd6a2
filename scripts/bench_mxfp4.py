"""MXFP4 against Q4_0 on swarm's kernels: one 14336 x 4096 matrix (an 8B-class MLP's), 1 and 8
input rows, each instruction set this CPU runs, its default input terms, one thread.

Both formats hold gguf-py's quantization of the same N(0, 0.02) weights. Each figure is the
median of --calls calls' thread CPU time (the kernels run on the calling thread at one thread);
the formats take turns call by call, so the host's drifting memory bandwidth meets both alike,
and the ratio is the medians'. MXFP4 reads 17 bytes a block to Q4_0's 18.

Example: nice .venv/bin/python scripts/bench_mxfp4.py --calls 30
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import numpy as np
import torch

from swarm.model import kernels

N, K = 14336, 4096


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=30)
    args = p.parse_args()
    torch.set_num_threads(1)
    w = (np.random.default_rng(0).standard_normal((N, K)) * 0.02).astype(np.float32)
    blocks = {k: gguf.quants.quantize(w, gguf.GGMLQuantizationType[k]) for k in ("Q4_0", "MXFP4")}
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line),
        "?",
    )
    print(f"CPU: {cpu}; {N} x {K}, one thread, ms a call (median of {args.calls})")
    for isa in kernels.runnable_isas():
        lib = kernels.load(isa)
        packed = {k: lib.pack(k, b, K) for k, b in blocks.items()}
        for rows in (1, 8):
            x = torch.randn(rows, K)
            times: dict[str, list[float]] = {k: [] for k in packed}
            for _ in range(args.calls + 2):
                for kind, pk in packed.items():
                    start = time.thread_time()
                    lib.matmul(kind, pk, N, K, x, 1)
                    times[kind].append(time.thread_time() - start)
            ms = {k: 1e3 * statistics.median(t[2:]) for k, t in times.items()}
            print(
                f"{isa:10s} rows {rows}: Q4_0 {ms['Q4_0']:.2f}  MXFP4 {ms['MXFP4']:.2f}"
                f"  MXFP4/Q4_0 {ms['MXFP4'] / ms['Q4_0']:.2f}"
                f"  (terms {kernels.input_terms(isa)})"
            )


if __name__ == "__main__":
    main()
