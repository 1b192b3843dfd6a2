"""Decode and prompt speed of a model on this CPU, against llama.cpp (issues 27 and 49).

One sitting, one table, tokens per second at 1 and 2 threads:
  prompt   a 512-token prompt pass (the swarm: 512 / time to first token)
  decode   128 greedy tokens after a 1-token prompt
  @500     128 greedy tokens after 500 tokens of context
for: llama.cpp's llama-bench on the same GGUF file (when --llama-bench names its binary),
transformers in float32, the project's unsplit span code (Span.forward + Head, as a node and
client run it, default weights and float32) and a 2-node local swarm at the defaults (each node
--threads N). "the same, layer by layer" is the unsplit span with its plain layers on
blocks.py's path instead of one call of swarm's kernels a step (swarm.model.fast_layers).
Rows alternate inside each repeat so machine noise hits them alike; medians.

    .venv/bin/python scripts/bench_decode.py --llama-bench /path/to/llama-bench [--repeats 3]

With --model FILE (a GGUF file, e.g. scripts/synthetic_gguf.py's 16 8B-shaped Q4_K layers) the
rows are that file's whole span unsplit in this process, the same span on one node (--threads N,
this process its client) and llama-bench on the same file; float32 and transformers, 4 bytes a
weight, are left out:

    .venv/bin/python scripts/bench_decode.py --model /tmp/l8b-16.Q4_K.gguf --llama-bench PATH

llama-bench is a yardstick built in a scratch folder, not a dependency (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
import warnings

import bench  # noqa: F401  (first: OpenMP's wait policy, a node's, before torch loads)
import torch
from bench.timing import session_greedy

from swarm.model.blocks import Span
from swarm.model.fast_layers import FastLayers
from swarm.model.head import Head
from swarm.model.source import default_model_path, open_model

PROMPT, NEW, CONTEXT = 512, 128, 500
COLUMNS = ("prompt", "decode", "@500")
GOAL_UNSPLIT_VS_LLAMA = 0.5
GOAL_SWARM_VS_UNSPLIT = 0.8
GOAL_MODEL_VS_LLAMA = 1.0  # issue 49: a node's whole span at llama.cpp's speed, 1 and 2 threads


def ids(n: int, salt: int = 0, vocab: int = 40100) -> list[int]:
    return [(i * 7919 + salt) % min(40000, vocab - 100) + 100 for i in range(n)]


def span_figures(span: Span, head: Head) -> dict[str, float]:
    vocab = span.config.vocab

    def prompt_pass(n: int):
        cache = span.allocate_cache(span.start, span.end, n + NEW + 1)
        start = time.perf_counter()
        embedded = head.embed_tokens(ids(n, vocab=vocab))
        hidden = span.forward(embedded, cache, 0, span.start, span.end)
        token = int(head.logits(hidden[:, -1]).argmax())
        return cache, token, time.perf_counter() - start

    def decode(cache, token) -> float:
        start = time.perf_counter()
        for _ in range(NEW):
            h = span.forward(head.embed_tokens([token]), cache, cache.length, span.start, span.end)
            token = int(head.logits(h[:, -1]).argmax())
        return NEW / (time.perf_counter() - start)

    _, _, seconds = prompt_pass(PROMPT)
    out = {"prompt": PROMPT / seconds}
    out["decode"] = decode(*prompt_pass(1)[:2])
    out["@500"] = decode(*prompt_pass(CONTEXT)[:2])
    return out


def layered_figures(span: Span, head: Head) -> dict[str, float]:
    """span_figures with the span's plain layers on blocks.py's layer-by-layer path instead of
    one call of swarm's kernels a step (swarm.model.fast_layers)."""
    fast, span.fast = span.fast, FastLayers(span.start)
    try:
        return span_figures(span, head)
    finally:
        span.fast = fast


def transformers_figures(model) -> dict[str, float]:
    def prompt_pass(n: int):
        start = time.perf_counter()
        out = model(torch.tensor([ids(n)]), use_cache=True, logits_to_keep=1)
        return out, int(out.logits[0, -1].argmax()), time.perf_counter() - start

    def decode(out, token) -> float:
        start = time.perf_counter()
        for _ in range(NEW):
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values)
            token = int(out.logits[0, -1].argmax())
        return NEW / (time.perf_counter() - start)

    with torch.inference_mode():
        _, _, seconds = prompt_pass(PROMPT)
        return {
            "prompt": PROMPT / seconds,
            "decode": decode(*prompt_pass(1)[:2]),
            "@500": decode(*prompt_pass(CONTEXT)[:2]),
        }


def swarm_figures(client) -> dict[str, float]:
    vocab = client.config.vocab

    def run(n: int, new: int) -> tuple[float, float]:
        t = session_greedy(client, ids(n, salt=n, vocab=vocab), new)
        return t.ttft, t.tokens_per_s

    return {
        "prompt": PROMPT / run(PROMPT, 0)[0],
        "decode": run(1, NEW)[1],
        "@500": run(CONTEXT, NEW)[1],
    }


def llama_figures(binary: str, threads: int, model: str | None = None) -> dict[str, float]:
    out = subprocess.run(
        [
            binary,
            "-m",
            model or str(default_model_path()),
            "-p",
            str(PROMPT),
            "-n",
            str(NEW),
            "-t",
            str(threads),
            "-d",
            f"0,{CONTEXT}",
            "-r",
            "1",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    figures = {}
    for row in json.loads(out):
        tps, depth = row["avg_ts"], row.get("n_depth", 0)
        if row["n_prompt"] and depth == 0:
            figures["prompt"] = tps
        elif row["n_gen"]:
            figures["decode" if depth == 0 else "@500"] = tps
    return figures


LLAMA = "llama.cpp, Q4_1"  # the default model's file
UNSPLIT = "unsplit span, default weights"
LAYERED = "the same, layer by layer"  # blocks.py's path: swarm.model.fast_layers off
SWARM = "2-node swarm, default weights"
NODE = "one node, whole span"
LLAMA_FILE = "llama.cpp, same file"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"))
    p.add_argument("--model", help="a GGUF file: its span unsplit and on one node (see above)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", default="1,2")
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    from devtools.launch import stop_all

    threads = [int(t) for t in a.threads.split(",")]
    runs, swarms, clients = model_runs(a, threads) if a.model else default_runs(a, threads)
    rows: dict[tuple[str, int], list[dict[str, float]]] = {}
    try:
        for r in range(a.repeats):
            for t in threads:
                torch.set_num_threads(t)
                for name, run in runs(t).items():
                    rows.setdefault((name, t), []).append(run())
                print(f"repeat {r + 1}/{a.repeats}, {t} thread(s) done", flush=True)
        for c in clients.values():
            c.close()
    finally:
        for nodes in swarms.values():
            stop_all(nodes)
    report(rows, threads, a)


def default_runs(a, threads: list[int]):
    """The default model's rows: its span on swarm's kernels and in float32, transformers in
    float32, a 2-node swarm; llama.cpp on its file."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from devtools.launch import even_spans, start_swarm
    from swarm.client.client import Client

    hf_logging.set_verbosity_error()
    source = open_model(None)
    layers = source.config.num_layers
    spans = {w: Span.load(source, 0, layers, weights=w) for w in ("auto", "float32")}
    heads = {w: Head.load(source, w) for w in ("auto", "float32")}
    path = default_model_path()
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    swarms = {t: start_swarm(even_spans(layers, 2), extra=["--threads", str(t)]) for t in threads}
    clients = {t: Client(swarms[t][0].maddrs[:1]) for t in threads}

    def runs(t: int) -> dict:
        out = {
            UNSPLIT: lambda: span_figures(spans["auto"], heads["auto"]),
            LAYERED: lambda: layered_figures(spans["auto"], heads["auto"]),
            "unsplit span, float32": lambda: span_figures(spans["float32"], heads["float32"]),
            "transformers, float32": lambda: transformers_figures(reference),
            SWARM: lambda: swarm_figures(clients[t]),
        }
        if a.llama_bench:
            out[LLAMA] = lambda: llama_figures(a.llama_bench, t)
        return out

    return runs, swarms, clients


def model_runs(a, threads: list[int]):
    """--model's rows: the file's whole span unsplit here and on one node at --threads t
    (this process its client), llama.cpp on the same file."""
    from devtools.launch import start_swarm
    from swarm.client.client import Client

    source = open_model(a.model)
    layers = source.config.num_layers
    span, head = Span.load(source, 0, layers), Head.load(source, "auto")
    swarms = {}
    for t in threads:  # one at a time: each holds the span's weights
        swarms[t] = start_swarm([(0, layers)], model=a.model, extra=["--threads", str(t)])
    clients = {t: Client(swarms[t][0].maddrs[:1], model=a.model) for t in threads}

    def runs(t: int) -> dict:
        out = {
            UNSPLIT: lambda: span_figures(span, head),
            LAYERED: lambda: layered_figures(span, head),
            NODE: lambda: swarm_figures(clients[t]),
        }
        if a.llama_bench:
            out[LLAMA_FILE] = lambda: llama_figures(a.llama_bench, t, a.model)
        return out

    return runs, swarms, clients


def report(rows, threads, a) -> None:
    med = {
        key: {c: statistics.median(run[c] for run in runs) for c in COLUMNS}
        for key, runs in rows.items()
    }
    names = list(dict.fromkeys(name for name, _ in rows))
    header = " | ".join(f"{c}, {' / '.join(str(t) for t in threads)} threads" for c in COLUMNS)
    print(f"\ntok/s, median of {a.repeats}; load average {os.getloadavg()[0]:.2f}")
    print(f"| | {header} |\n|---|" + "---|" * len(COLUMNS))
    for name in names:
        cells = [" / ".join(figure(med[(name, t)][c]) for t in threads) for c in COLUMNS]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for t in threads:
        for line in model_ratios(med, t) if a.model else default_ratios(med, t):
            print(line)
        one_call = [med[(UNSPLIT, t)][c] / med[(LAYERED, t)][c] for c in COLUMNS]
        print(
            f"{t} thread(s), one call / layer by layer: "
            + ", ".join(f"{c} {r:.2f}" for c, r in zip(COLUMNS, one_call))
        )


def figure(tok_s: float) -> str:
    return f"{tok_s:.0f}" if tok_s >= 100 else f"{tok_s:.1f}"


def default_ratios(med, t: int) -> list[str]:
    lines = []
    for c in ("decode", "@500"):
        ratio = med[(SWARM, t)][c] / med[(UNSPLIT, t)][c]
        line = f"{t} thread(s), {c}: swarm / unsplit {ratio:.2f} (goal >= {GOAL_SWARM_VS_UNSPLIT})"
        if (LLAMA, t) in med:
            ratio = med[(UNSPLIT, t)][c] / med[(LLAMA, t)][c]
            line += f"; unsplit / llama.cpp {ratio:.2f} (goal >= {GOAL_UNSPLIT_VS_LLAMA})"
        lines.append(line)
    if (LLAMA, t) in med:
        ratio = med[(UNSPLIT, t)]["prompt"] / med[(LLAMA, t)]["prompt"]
        lines.append(f"{t} thread(s), prompt: unsplit / llama.cpp {ratio:.2f} (goal >= 1)")
    return lines


def model_ratios(med, t: int) -> list[str]:
    if (LLAMA_FILE, t) not in med:
        return []
    return [
        f"{t} thread(s), {c}: unsplit / llama.cpp {ratio(UNSPLIT):.2f}, node / llama.cpp"
        f" {ratio(NODE):.2f} (goal >= {GOAL_MODEL_VS_LLAMA})"
        for c in COLUMNS
        for ratio in [lambda name, c=c: med[(name, t)][c] / med[(LLAMA_FILE, t)][c]]
    ]


if __name__ == "__main__":
    main()
