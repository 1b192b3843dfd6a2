"""Start a DHT and a few nodes splitting the model, stream one reply, shut everything down."""

from __future__ import annotations

import argparse
import logging
import sys
import time

import bench  # noqa: F401 (this checkout first on the path)

from devtools.launch import even_spans, start_swarm, stop_all
from swarm.cli import model_option, wire_dtype_option
from swarm.model.source import open_model
from swarm.options import add_options


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("prompt", nargs="?", default="Why is the sky blue? Answer in two sentences.")
    p.add_argument("--nodes", type=int, default=2)
    add_options(p, model=model_option(), wire_dtype=wire_dtype_option(None, "the model's"))
    p.add_argument("--max-new-tokens", type=int, default=64)
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    num_layers = open_model(a.model).config.num_layers
    spans = even_spans(num_layers, a.nodes)
    print(f"starting {a.nodes} nodes serving {spans} ...", flush=True)
    t = time.perf_counter()
    extra = ["--wire-dtype", a.wire_dtype] if a.wire_dtype else []
    nodes = start_swarm(spans, model=a.model, extra=extra)
    try:
        for n in nodes:
            print(f"  node {n.layers[0]}:{n.layers[1]} at {n.addr} peer {n.peer[:12]}...")
        print(f"swarm up in {time.perf_counter() - t:.1f} s; initial peer {nodes[0].maddrs[0]}")
        from swarm.client.client import Client

        client = Client(nodes[0].maddrs[:1], model=a.model)
        print(f"\n> {a.prompt}\n", flush=True)
        t = time.perf_counter()
        first = None
        chat = [{"role": "user", "content": a.prompt}]
        reply = client.stream(chat if client.chat else a.prompt, max_new_tokens=a.max_new_tokens)
        for piece in reply:
            first = first or time.perf_counter()
            print(piece, end="", flush=True)
        n = len(reply.tokens)
        done = time.perf_counter()
        rate = (n - 1) / (done - first) if first and n > 1 else 0.0
        print(f"\n\n[{n} tokens, first after {(first or done) - t:.2f} s, {rate:.1f} tokens/s]")
        client.close()
    finally:
        print("stopping nodes ...", flush=True)
        stop_all(nodes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
