"""Per Llama-3-8B-shaped layer: swarm on torch's kernels, on its own, and llama.cpp (issue 36).

Files: synthetic 1- and 4-layer GGUF files of 8B shapes (scripts/synthetic_gguf.py; written into
--files when missing, ~1.9 GB for the three types). For each type (Q4_0, Q4_K, Q8_0) and thread
count (1, 2), every round:
  swarm     one child process loads the 1-layer file twice, on torch's int4/int8 kernels (the
            path before issue 36) and on swarm's kernels (the file's blocks), and times them in
            turn: decode (Span.decode, one session) at 0 and 500 tokens of context, one step of
            8 sessions at once, prompt passes of 128 and 512 tokens (Span.forward).
  llama.cpp llama-bench on the 1- and 4-layer files, per layer = the difference / 3 (which
            takes the embedding and output head out): tg32 at depth 0 and 500, pp8 (its 8-row
            pass), pp128, pp512. Only with --llama-bench: a yardstick built in a scratch folder
            from the package index's sdist, never a dependency.

Clocks. swarm: at 1 thread the calling thread's CPU time (the kernels run on it), the median of
the calls; at 2 threads wall-clock, the fastest of each call's repeats. llama.cpp: the fastest
of 5 timed repetitions after llama-bench's own warm-up (wall-clock; a depth's prompt is outside
its timing). Each figure is the median over --repeats rounds; the ratios are the medians of each
round's own ratio, as the host's memory bandwidth drifts from minute to minute (a 33 MB matrix
took 1.2-3.2 ms). Wall-clock figures are only as good as the machine's quiet: run nothing else.
The CPU's flags that pick the kernels and the kernels the node uses are printed first.

Example: nice .venv/bin/python scripts/bench_kernels.py --files /tmp/l8b \\
             --llama-bench /tmp/lcpp/build/bin/llama-bench --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import bench  # noqa: F401  (first: OpenMP's wait policy, a node's, before torch loads)
import torch
from bench.layers import call_seconds, llama_seconds
from bench.proc import cpu_flags, cpu_name

from swarm.options import input_terms_arg

QTYPES = ["Q4_0", "Q4_K", "Q8_0"]
TORCH_KERNELS = ("float32", "bfloat16", "int8", "int4")
CONTEXT = 500
PROMPTS = (128, 512)
BATCH = 8
GOAL_DECODE = 1.15  # decode within 1.15x of llama.cpp's time per layer
VARIANTS = ("torch", "swarm", "llama.cpp")


# ---------------------------------------------------------------------------------------------
# swarm: one child per (file, threads), both variants loaded, timed in turn


def swarm_child(path: str, threads: int, decode_calls: int, terms: int | None) -> dict:
    from swarm.model.blocks import Span
    from swarm.model.linear import BLOCKS
    from swarm.model.source import open_model

    torch.set_num_threads(threads)
    source = open_model(path)
    hidden = source.config.hidden
    spans = {
        "torch": Span.load(source, 0, 1, weights="auto", usable=TORCH_KERNELS, terms=terms),
        "swarm": Span.load(
            source, 0, 1, weights="auto", usable=(*TORCH_KERNELS, BLOCKS), terms=terms
        ),
    }
    out: dict = {v: {} for v in spans}
    out["formats"] = {
        v: sorted({type(lin).__name__ for b in s.blocks for lin in b.linears})
        for v, s in spans.items()
    }
    torch.manual_seed(0)
    with torch.inference_mode():
        for name, span in spans.items():
            out[name] = _layer_figures(span, hidden, decode_calls, threads)
    return out


def _layer_figures(span, hidden: int, decode_calls: int, threads: int) -> dict:
    fig = {}
    cache = span.allocate_cache(0, 1, CONTEXT + 8)
    x1 = torch.randn(1, hidden)

    def step(pos: int) -> None:
        span.decode(x1, [cache], [pos], 0, 1)

    fig["decode_ms"] = 1e3 * call_seconds(lambda: step(0), decode_calls, threads)
    span.forward(torch.randn(1, CONTEXT, hidden), cache, 0, 0, 1)
    fig[f"decode_{CONTEXT}_ms"] = 1e3 * call_seconds(lambda: step(CONTEXT), decode_calls, threads)
    caches = [span.allocate_cache(0, 1, 8) for _ in range(BATCH)]
    x8 = torch.randn(BATCH, hidden)
    fig[f"decode_x{BATCH}_ms"] = 1e3 * call_seconds(
        lambda: span.decode(x8, caches, [0] * BATCH, 0, 1), max(3, decode_calls // 4), threads
    )
    for n in PROMPTS:
        prompt = torch.randn(1, n, hidden)
        long_cache = span.allocate_cache(0, 1, n)

        def run(p=prompt, c=long_cache):
            span.forward(p, c, 0, 0, 1)

        seconds = call_seconds(run, 3, threads)
        fig[f"prompt_{n}_tok_s"] = n / seconds
    return fig


def run_swarm(path: Path, threads: int, decode_calls: int, input_terms: int | None) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        str(path),
        "--threads",
        str(threads),
        "--decode-calls",
        str(decode_calls),
        "--input-terms",
        str(input_terms or "auto"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# llama.cpp: llama-bench on the 1- and 4-layer files


def run_llama(binary: str, one: Path, four: Path, threads: int) -> dict:
    """Per-layer figures: (4-layer time - 1-layer time) / 3 for each test."""
    tests = {
        "decode_ms": (["-p", "0"], 32),
        f"decode_{CONTEXT}_ms": (["-p", "0", "-d", str(CONTEXT)], 32),
        f"decode_x{BATCH}_ms": (["-p", str(BATCH), "-n", "0"], 0),
        **{f"prompt_{n}_tok_s": (["-p", str(n), "-n", "0"], 0) for n in PROMPTS},
    }
    fig = {}
    for name, (args, gen) in tests.items():
        t1, t4 = (llama_seconds(binary, path, threads, args, gen) for path in (one, four))
        seconds = (t4 - t1) / 3
        fig[name] = int(name.split("_")[1]) / seconds if "tok_s" in name else 1e3 * seconds
    return fig


# ---------------------------------------------------------------------------------------------


def cpu_summary() -> str:
    from swarm.model import kernels

    have = " ".join(cpu_flags())
    lib = kernels.load()
    using = f"swarm's {lib.isa} kernels ({lib.rows} rows a vector)" if lib else "torch's kernels"
    return f"CPU: {cpu_name()}, {os.cpu_count()} cores; flags: {have}\nquantized matmuls: {using}"


def ensure_files(folder: Path, qtypes: list[str]) -> dict[str, tuple[Path, Path]]:
    from synthetic_gguf import Shapes, write_synthetic_gguf

    files = {}
    for q in qtypes:
        pair = []
        for layers in (1, 4):
            path = folder / f"l8b-{layers}.{q}.gguf"
            if not path.exists():
                print(f"writing {path} ...", file=sys.stderr, flush=True)
                write_synthetic_gguf(path, Shapes(layers=layers), q)
            pair.append(path)
        files[q] = tuple(pair)
    return files


ROWS = [
    ("decode_ms", "decode, ms", False),
    (f"decode_{CONTEXT}_ms", f"decode at {CONTEXT} context, ms", False),
    (f"decode_x{BATCH}_ms", f"{BATCH} rows (llama.cpp: pp{BATCH}), ms", False),
    *((f"prompt_{n}_tok_s", f"prompt {n}, tok/s", True) for n in PROMPTS),
]


def _speedup(ours: float, theirs: float, higher_better: bool) -> float:
    """> 1 where `ours` is the faster"""
    return ours / theirs if higher_better else theirs / ours


def paired_speedup(runs: dict, key: str, higher_better: bool) -> float:
    """The median of each round's own swarm / llama.cpp speedup: the two ran a minute apart at
    most, while this host's memory bandwidth drifts from minute to minute."""
    return statistics.median(
        _speedup(ours[key], theirs[key], higher_better)
        for ours, theirs in zip(runs["swarm"], runs["llama.cpp"])
    )


def table(results: dict, qtypes: list[str], threads: list[int]) -> str:
    have_llama = any("llama.cpp" in r for r in results.values())
    head = "| per 8B-shaped layer | torch kernels | swarm kernels | swarm / torch |"
    rule = "|---|---|---|---|"
    if have_llama:
        head += " llama.cpp | swarm vs llama.cpp |"
        rule += "---|---|"
    lines = [head, rule]
    for q in qtypes:
        for t in threads:
            runs = results[(q, t)]
            for key, label, higher_better in ROWS:
                med = {v: statistics.median(r[key] for r in runs[v]) for v in runs}
                row = (
                    f"| {q}, {t} thr, {label} | {med['torch']:.2f} | {med['swarm']:.2f} |"
                    f" {_speedup(med['swarm'], med['torch'], higher_better):.2f}x |"
                )
                if have_llama:
                    ratio = paired_speedup(runs, key, higher_better)
                    row += f" {med['llama.cpp']:.2f} | {ratio:.2f}x |"
                lines.append(row)
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--files", type=Path, default=Path("/tmp/swarm-l8b"))
    p.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"))
    p.add_argument("--qtypes", default=",".join(QTYPES))
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--decode-calls", type=int, default=20)
    p.add_argument("--json", type=Path, help="also write every round's figures here")
    p.add_argument(
        "--isa",
        help="swarm's kernels for this instruction set (avx2 measures an AVX2-only machine's on"
        " an AVX-512 one; build llama.cpp with GGML_NATIVE=OFF GGML_AVX2=ON to match)",
    )
    p.add_argument(
        "--input-terms", type=input_terms_arg, default=None, help="as a node's: auto, 1 or 2"
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    from swarm.model import kernels

    if a.isa:
        os.environ[kernels.ISA_ENV] = a.isa  # the children inherit it
    if a.child:
        print(json.dumps(swarm_child(a.child, int(a.threads), a.decode_calls, a.input_terms)))
        return
    qtypes, threads = a.qtypes.split(","), [int(t) for t in a.threads.split(",")]
    a.files.mkdir(parents=True, exist_ok=True)
    files = ensure_files(a.files, qtypes)
    print(cpu_summary(), flush=True)
    results: dict = {
        (q, t): {v: [] for v in VARIANTS[: 3 if a.llama_bench else 2]}
        for q in qtypes
        for t in threads
    }
    formats = {}
    for rnd in range(a.repeats):
        for q in qtypes:
            for t in threads:
                fig = run_swarm(files[q][0], t, a.decode_calls, a.input_terms)
                formats[q] = fig.pop("formats")
                for v in ("torch", "swarm"):
                    results[(q, t)][v].append(fig[v])
                if a.llama_bench:
                    results[(q, t)]["llama.cpp"].append(run_llama(a.llama_bench, *files[q], t))
                print(
                    f"round {rnd + 1}/{a.repeats} {q} {t} thread(s): "
                    + json.dumps({v: r[-1] for v, r in results[(q, t)].items()}),
                    file=sys.stderr,
                    flush=True,
                )
    for q, f in formats.items():
        print(f"{q}: torch path holds {', '.join(f['torch'])}; swarm path {', '.join(f['swarm'])}")
    print(f"medians of {a.repeats} rounds; load average at the end: {os.getloadavg()[0]:.1f}")
    print(table(results, qtypes, threads))
    if a.llama_bench:
        worst = 1 / min(paired_speedup(r, "decode_ms", False) for r in results.values())
        print(f"decode goal: within {GOAL_DECODE}x of llama.cpp; worst here {worst:.2f}x")
    if a.json:
        a.json.write_text(json.dumps({f"{q} {t}": r for (q, t), r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
