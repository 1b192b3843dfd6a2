"""What this machine can serve: how many blocks fit its memory, and how fast a span computes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from swarm.model.blocks import KVCache, Span
from swarm.model.deltanet import State
from swarm.model.head import head_bytes
from swarm.model.source import GGUFSource, SafetensorsSource
from swarm.node.config import NodeConfig
from swarm.node.placement import blocks_for_memory


def measure_throughput(span: Span) -> float:
    """Seconds per one-token decode step through the whole span, after a warm-up."""
    cache = span.allocate_cache(span.start, span.end, 16)
    h = torch.zeros(1, 1, span.config.hidden)
    times = []
    for pos in range(4):
        t = time.perf_counter()
        span.forward(h, cache, pos, span.start, span.end, ids=[0])  # ids: Gemma 4 reads them
        times.append(time.perf_counter() - t)
    return min(times[1:])


class Fit(NamedTuple):
    """How many blocks fit a node's memory: anywhere, and in a span ending the model, whose
    last node also holds the head it picks tokens with."""

    blocks: int
    ending: int


def blocks_that_fit(
    cfg: NodeConfig,
    source: GGUFSource | SafetensorsSource,
    usable: tuple[str, ...],
    say: Callable[[str], None],
) -> Fit:
    """Blocks whose weights and KV cache fit --max-memory, or 3/4 of the memory free now."""
    c = source.config
    # the largest kind of block: a mixture's layer holds all its experts, many times a dense one
    layer = next((i for i in range(c.num_layers) if c.moe(i)), 0)
    probe = Span.load(source, layer, layer + 1, weights=cfg.weights, usable=usable)
    block_bytes = probe.nbytes
    cache = KVCache.bytes_per_token(source.config, 1, probe.cache_dtype)
    cache_bytes = cfg.limits.max_cache_tokens * cache
    if c.delta is not None:  # Gated DeltaNet: a fixed state a session, whatever its length
        cache_bytes = max(cache_bytes, cfg.limits.max_sessions * State.nbytes(c.delta))
    if cfg.max_memory_mb is not None:
        budget = int(cfg.max_memory_mb * 2**20)
    else:
        budget = int(available_memory() * 0.75)
    n = blocks_for_memory(block_bytes, cache_bytes, budget)
    head = head_bytes(source, cfg.weights)
    ending = blocks_for_memory(block_bytes, cache_bytes, budget - head, least=0)
    say(
        f"a block takes {block_bytes / 2**20:.1f} MiB of weights and {cache_bytes / 2**20:.1f}"
        f" MiB of cache; {budget / 2**20:.0f} MiB allow {n}, {ending} beside the last block's"
        f" head ({head / 2**20:.1f} MiB)"
    )
    return Fit(n, ending)


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2**30  # unknown: a modest share
