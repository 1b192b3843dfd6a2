"""Per family at an 8B-class layer shape: swarm's decode and prompt speed a layer, its cache a
token, and llama.cpp's decode on the same file (issue 50).

Files: per family, synthetic GGUF files of N and N + 1 layers (N = 1, but 2 for Qwen3.5 and Gemma 4:
see their plans), from scripts/bench/family_plans.py's plans (names, metadata and tensor types as
llama.cpp's converter and quantizer give them: Q4_K matrices, but gpt-oss's MXFP4 experts; F32
norms and routers; random weights, every layer the same), written by synthetic_gguf.py's
write_plan into --files (default a temporary folder; files already there are reused).
  swarm      a child process per family loads the last layer of the larger file (Span.load, the
             node's "auto" weights) and times Span.decode of one row and of 8 rows (8 sessions,
             one step) at position 0: the median thread CPU time of --decode-calls calls at 1
             thread; a 512-token prompt pass (Span.forward, one timed call after a short
             warm-up). Cache: bytes a token of the layer's KV in the node's bfloat16 cache; a
             Gated DeltaNet layer holds a fixed state a session instead (printed as such).
  llama.cpp  llama-bench -t 1 on both files (tg32, the fastest of 5 repetitions after its
             warm-up); its per-layer figure is the difference of the two, which takes the
             embedding and the output head out. Only with --llama-bench (a yardstick built in a
             scratch folder, never a dependency) and where llama.cpp runs the architecture.
Each of --repeats rounds runs every family once (both sides); the table holds each figure's
median over the rounds and the median of each round's own ratio. The ratio is of like clocks:
swarm's fastest wall-clock 1-row decode (printed in brackets) over llama.cpp's fastest of 5
(wall-clock); swarm's other times are its thread's CPU time (steadier on a loaded host).
A family that cannot be written or loaded is a row "not measured" with the reason.

Example: nice .venv/bin/python scripts/bench_families.py --files /tmp/fam \\
             --llama-bench /path/to/llama.cpp/build/bin/llama-bench
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench  # noqa: F401  (first: OpenMP's wait policy, a node's, before torch loads)
import torch
from bench.family_plans import PLANS
from bench.layers import call_seconds, llama_seconds
from bench.proc import cpu_name

PROMPT, ROWS, GOAL = 512, 8, 1.2  # goal: swarm's decode within 1.2x of llama.cpp's
# families the plans leave out, and why (printed as rows "not measured")
UNMEASURED = {
    "mistral": "llama.cpp writes Mistral as llama: the llama row (same 7B/8B layer shape)",
}


def files_of(folder: Path, family: str) -> tuple[Path, Path]:
    """The family's files of N and N + 1 layers (N: 1 but where its plan says), written unless
    there."""
    from synthetic_gguf import write_plan

    memo: dict = {}  # one family's generated tensors, shared by its two files
    paths = []
    for layers in PLANS[family](1).sizes:
        path = folder / f"{family}-{layers}.gguf"
        if not path.exists():
            print(f"writing {path} ...", file=sys.stderr, flush=True)
            partial = path.with_suffix(".part")
            write_plan(partial, PLANS[family](layers), memo=memo)
            partial.rename(path)
        paths.append(path)
    return paths[0], paths[1]


def swarm_child(path: str, decode_calls: int) -> dict:
    """The last layer of the larger file, timed here (a child: one family's weights at a
    time)."""
    from swarm.model.blocks import Span
    from swarm.model.kvcache import KVCache
    from swarm.model.source import open_model

    torch.set_num_threads(1)
    source = open_model(path)
    c = source.config
    first, end = c.num_layers - 1, c.num_layers
    span = Span.load(source, first, end)
    torch.manual_seed(0)
    fig = {"format": span.format}

    def cache(length: int):
        return span.allocate_cache(first, end, length)

    def ids(n: int) -> list[int] | None:  # Gemma 4's layers take the token ids too
        return None if span.per_layer is None else [100 + k for k in range(n)]

    with torch.inference_mode():
        one, x1 = cache(16), torch.randn(1, c.hidden)
        step = lambda: span.decode(x1, [one], [0], first, end, ids(1))  # noqa: E731
        fig["decode_ms"] = 1e3 * call_seconds(step, decode_calls, 1)
        fig["decode_wall_ms"] = 1e3 * fastest_wall(step, decode_calls)
        caches, x8 = [cache(16) for _ in range(ROWS)], torch.randn(ROWS, c.hidden)
        step = lambda: span.decode(x8, caches, [0] * ROWS, first, end, ids(ROWS))  # noqa: E731
        fig[f"decode_x{ROWS}_ms"] = 1e3 * call_seconds(step, max(3, decode_calls // 4), 1)
        span.forward(torch.randn(1, 16, c.hidden), cache(16), 0, first, end, ids(16))  # warm-up
        prompt, long_cache = torch.randn(1, PROMPT, c.hidden), cache(PROMPT)
        start = time.thread_time()
        span.forward(prompt, long_cache, 0, first, end, ids(PROMPT))
        fig["prompt_tok_s"] = PROMPT / (time.thread_time() - start)
    fig["kv_bytes"] = KVCache.bytes_per_token(c, 1, span.cache_dtype, start=first)
    states = getattr(one, "states", None) or {}
    fig["state_bytes"] = sum(_nbytes(s) for s in states.values())
    return fig


def fastest_wall(fn, calls: int) -> float:
    """The fastest wall-clock call of `calls` (llama-bench's clock and rule, for the ratio)."""
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _nbytes(state) -> int:
    """A session's fixed state's bytes (its tensors')."""
    tensors = [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def run_swarm(path: Path, decode_calls: int) -> dict:
    cmd = [sys.executable, __file__, "--child", str(path), "--decode-calls", str(decode_calls)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"swarm: {last}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_llama(binary: str, one: Path, two: Path) -> float | str:
    """llama.cpp's decode ms a layer (2-layer file's time less 1-layer file's), or why none."""
    try:
        t1, t2 = (llama_seconds(binary, p, 1, ["-p", "0"], 32) for p in (one, two))
    except subprocess.CalledProcessError as e:
        lines = [ln for ln in (e.stderr or "").splitlines() if "error" in ln.lower()]
        return f"llama.cpp: {(lines or ['failed'])[-1].strip()[:80]}"
    return 1e3 * (t2 - t1)


def measure(family: str, files: tuple[Path, Path], a) -> dict:
    """One round's figures of a family: swarm's, and llama.cpp's where asked for."""
    fig = run_swarm(files[1], a.decode_calls)
    fig["note"] = PLANS[family](1).note
    if a.llama_bench:
        fig["llama"] = run_llama(a.llama_bench, *files)
        if isinstance(fig["llama"], float) and "decode_ms" in fig:
            fig["ratio"] = fig["decode_wall_ms"] / fig["llama"]
    return fig


def medians(rounds: list[dict]) -> dict:
    """Each figure's median over the rounds (the ratio: of each round's own, as the two ran
    a minute apart at most while the host's load drifts); the first round's text."""
    out = dict(rounds[0])
    for key, value in rounds[0].items():
        numbers = [r[key] for r in rounds if isinstance(r.get(key), (int, float))]
        if isinstance(value, (int, float)) and len(numbers) == len(rounds):
            out[key] = statistics.median(numbers)
    return out


def _cache_cell(fig: dict) -> str:
    if fig.get("state_bytes"):
        return f"{fig['state_bytes']} a session (fixed state)"
    return str(fig["kv_bytes"])


def row(family: str, fig: dict) -> str:
    llama = fig.get("llama", "-")
    llama_cell = f"{llama:.2f}" if isinstance(llama, float) else str(llama)
    if "decode_ms" not in fig:  # llama.cpp's figure still shown where it ran the file
        return f"| {family}: not measured ({fig['error']}) | - | - | - | - | {llama_cell} | - |"
    ratio = f"{fig['ratio']:.2f}x" if "ratio" in fig else "-"
    cells = [
        f"{family} ({fig['note']})" if fig["note"] else family,
        f"{fig['decode_ms']:.2f} ({fig['decode_wall_ms']:.2f})",
        f"{fig[f'decode_x{ROWS}_ms']:.2f}",
        f"{fig['prompt_tok_s']:.1f}",
        _cache_cell(fig),
        llama_cell,
        ratio,
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--files", type=Path, help="folder of the GGUF files (default: a temp one)")
    p.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"))
    p.add_argument("--families", default=",".join([*PLANS, *UNMEASURED]))
    p.add_argument("--decode-calls", type=int, default=15)
    p.add_argument("--repeats", type=int, default=1, help="rounds over all the families")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(swarm_child(a.child, a.decode_calls)))
        return
    folder = a.files or Path(tempfile.mkdtemp(prefix="swarm-families-"))
    folder.mkdir(parents=True, exist_ok=True)
    families = a.families.split(",")
    files, rounds = {}, {f: [] for f in families}
    for family in families:
        if family in PLANS:
            try:
                files[family] = files_of(folder, family)
            except Exception as e:  # noqa: BLE001  (a plan that cannot be written: says why)
                rounds[family].append({"error": f"writing: {type(e).__name__}: {e}"})
    for rnd in range(a.repeats):  # families by turns in each round: drifting load hits all
        for family in files:
            rounds[family].append(measure(family, files[family], a))
            print(f"round {rnd + 1} {family}: {json.dumps(rounds[family][-1])}", file=sys.stderr)
    rows = []
    for family in families:
        if family not in PLANS:
            why = UNMEASURED.get(family, "no plan for it in scripts/bench/family_plans.py")
            rows.append(row(family, {"error": why}))
        else:
            rows.append(row(family, medians(rounds[family])))
    print(f"CPU: {cpu_name()}, 1 thread; files in {folder}")
    print(f"medians of {a.repeats} round(s); load average at the end: {os.getloadavg()[0]:.1f}")
    print(
        f"| family | decode ms a layer, 1 row (fastest wall-clock) | {ROWS} rows |"
        f" prompt {PROMPT} tok/s |"
        " KV bytes a token a layer (bf16) | llama.cpp decode ms a layer |"
        f" swarm / llama.cpp (goal <= {GOAL}x) |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
