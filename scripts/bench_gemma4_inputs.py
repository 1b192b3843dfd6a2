"""What Gemma 4's per-layer inputs cost a node a step: a span's inputs computed from the token
ids (swarm.model.gemma4.PerLayerInputs) at E2B's shape (hidden 1536, 256 a layer), for 12
layers, the projection held in each weight format, 1 and 8 rows (a decode step of 1 and of 8
sessions). Random tables; the vocabulary cut to 32,768 rows (a row lookup does not care). At 1
thread the figures are the median CPU time of a call (scripts/bench_kernels.py's clock).

  nice .venv/bin/python scripts/bench_gemma4_inputs.py [--layers 12] [--threads 1]
"""

from __future__ import annotations

import argparse
from functools import partial

import bench  # noqa: F401  (first: OpenMP's wait policy, a node's, before torch loads)
import torch
from bench.proc import cpu_name
from bench_kernels import call_seconds

from swarm.model.config import ModelConfig, Rope
from swarm.model.gemma4 import PerLayerInputs
from swarm.model.weights import RawTensor, make_linear

VOCAB, HIDDEN, WIDTH = 32768, 1536, 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layers = args.layers
    c = ModelConfig(
        *("e2b", "gemma4", 35, HIDDEN, 6144, 8, 1, 256, Rope(1e6), 1e-6, VOCAB, 2, (1,), 4096),
        per_layer=WIDTH,
    )
    embed = RawTensor("embed", "torch", torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16))
    table = torch.randn(VOCAB, layers * WIDTH, dtype=torch.bfloat16)
    rows = RawTensor("projection", "torch", torch.randn(layers * WIDTH, HIDDEN).bfloat16())
    print(f"{cpu_name()}, {args.threads} thread(s), {layers} layers of E2B's shape")
    print("projection  rows 1 (ms)  rows 8 (ms)")
    for weights in ("float32", "auto", "int8"):
        projection = make_linear(rows, weights)
        inputs = PerLayerInputs(c, 0, layers, embed, table, projection, torch.ones(WIDTH))
        calls = [partial(inputs, list(range(n)), 0, layers) for n in (1, 8)]
        ms = [1e3 * call_seconds(call, 200, args.threads) for call in calls]
        print(f"{inputs.projection.format:10s}  {ms[0]:11.3f}  {ms[1]:11.3f}")


if __name__ == "__main__":
    main()
