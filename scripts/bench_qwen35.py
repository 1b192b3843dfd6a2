"""What Qwen3.5's Gated DeltaNet layers cost a node, against transformers on the same weights,
in one run: a random Qwen3.5 text model shaped like a small one (hidden 1024, 8 layers of which
2 full attention, 16 q/k and 16 value heads of 128 in the linear ones, 8 / 2 heads of 256 in
the full ones), its whole span in one process. Prints, for transformers at float32 and for
swarm's Span at float32 (the exact mode) and at `auto`: a --prompt-token prompt's seconds and
the decode tok/s of --new-tokens greedy steps after it (median of --repeats); and what a
session's cache holds after the prompt (DeltaNet states beside the full layers' keys).

At 1 thread (the default) the figures are the calling thread's CPU time, which other work on
shared cores does not stretch; compare the rows as ratios within one run.

    PYTHONPATH=$PWD nice .venv/bin/python scripts/bench_qwen35.py [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import bench  # noqa: F401  (first: OpenMP's wait policy, a node's, before torch loads)
import torch
from bench.proc import cpu_name

from swarm.model.blocks import Span
from swarm.model.deltanet import State
from swarm.model.head import Head
from swarm.model.source import open_model
from swarm.model.tiny import save_tiny

SHAPE = dict(
    vocab_size=4096,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    full_attention_interval=4,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
)


def clock(threads: int) -> float:
    return time.thread_time() if threads == 1 else time.perf_counter()


def transformers_run(model, ids: list[int], new: int, threads: int) -> tuple[float, float]:
    """(prompt seconds, decode tok/s) of transformers' own cached greedy loop."""
    with torch.inference_mode():
        t = clock(threads)
        out = model(torch.tensor([ids]), use_cache=True)
        prompt = clock(threads) - t
        cache, token = out.past_key_values, out.logits[0, -1].argmax()
        t = clock(threads)
        for _ in range(new):
            out = model(token.view(1, 1), past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[0, -1].argmax()
        return prompt, new / (clock(threads) - t)


def swarm_run(head, span, ids: list[int], new: int, threads: int):
    """(prompt seconds, decode tok/s, the session's cache) through the whole span."""
    layers = span.end
    cache = span.allocate_cache(0, layers, len(ids) + new + 1)
    with torch.inference_mode():
        t = clock(threads)
        x = span.forward(head.embed_tokens(ids), cache, 0, 0, layers)
        prompt = clock(threads) - t
        token = int(head.logits(x[0, -1]).argmax())
        t = clock(threads)
        for _ in range(new):
            x = span.decode(head.embed_tokens([token])[0], [cache], [cache.length], 0, layers)
            token = int(head.logits_rows(x)[0].argmax())
        return prompt, new / (clock(threads) - t), cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ids = [(37 * i + 11) % 4000 + 5 for i in range(args.prompt_tokens)]
    print(f"CPU: {cpu_name()}; {args.threads} thread(s); prompt {len(ids)}, {args.new_tokens} new")
    with tempfile.TemporaryDirectory() as folder:
        model = save_tiny("qwen3_5", folder, **SHAPE)
        rows = {
            "transformers float32": lambda: transformers_run(
                model, ids, args.new_tokens, args.threads
            )
        }
        source = open_model(folder)
        head = Head.load(source, weights="float32")
        for weights in ("float32", "auto"):
            span = Span.load(source, 0, SHAPE["num_hidden_layers"], weights=weights)
            rows[f"swarm {weights} ({span.format})"] = lambda span=span: swarm_run(
                head, span, ids, args.new_tokens, args.threads
            )[:2]
        figures = {name: [run() for _ in range(args.repeats)] for name, run in rows.items()}
        base = statistics.median(r[1] for r in figures["transformers float32"])
        for name, runs in figures.items():
            prompt = statistics.median(r[0] for r in runs)
            tok_s = statistics.median(r[1] for r in runs)
            ratio = f"{tok_s / base:.2f}x"
            print(f"{name:28} prompt {prompt:6.2f} s   decode {tok_s:6.1f} tok/s ({ratio})")
        *_, cache = swarm_run(head, span, ids, 0, args.threads)
        states = sum(s.conv.nbytes + s.s.nbytes for s in cache.states.values())
        keys = sum(k.nbytes + v.nbytes for k, v in zip(cache.keys, cache.values))
        print(
            f"a session's cache at {len(ids)} tokens: {len(cache.states)} DeltaNet states of"
            f" {State.nbytes(source.config.delta) / 2**10:.0f} KiB ({states / 2**20:.1f} MiB, any"
            f" length) beside {keys / 2**20:.1f} MiB of keys and values"
        )


if __name__ == "__main__":
    main()
