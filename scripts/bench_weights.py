"""What each weight format costs and buys: memory per layer, decode and prompt speed (issue 22).

Two parts, each printing a table:

  synthetic  Llama-3-8B-shaped layers from a random-weight GGUF (scripts/synthetic_gguf.py) written
             as Q4_1 and Q8_0. Per file type and --weights format, in a fresh process: RSS added per
             layer by Span.load (and its peak while loading) against the file's bytes per layer,
             one 1-token decode step and one 128-token prompt pass per layer (1 thread, medians),
             int4's decode speed-up over float32, and how far each format's output is from
             float32's on the same input.
  model      The default model against the unsplit float32 transformers model in this process:
             RSS of real node processes serving 0:3, 0:15, 0:30 per --weights, single-stream
             decode tok/s and time to first token for a ~500-token prompt through 2 nodes
             (0:15, 15:30; --threads 1 each).

Example: nice -n 5 .venv/bin/python scripts/bench_weights.py --part synthetic
         nice -n 5 .venv/bin/python scripts/bench_weights.py --part model
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench.proc import memory
from bench.timing import session_greedy

from swarm.model.blocks import KVCache, Span
from swarm.model.source import open_model

FORMATS = ["float32", "bfloat16", "int8", "int4", "auto"]
QTYPES = ["Q4_1", "Q8_0"]
MB = 1e6
# goals from issue 22
RSS_OVER_FILE_GOAL = 1.25
_SAYS_FORMAT = re.compile(r"loaded blocks|fall(s|ing)? back|slow", re.IGNORECASE)
INT4_DECODE_SPEEDUP_GOAL = 4.0
NODE_RSS_GOALS_MB = {(0, 30): 450, (0, 15): 380}
DECODE_RATIO_GOAL = 1.0
TTFT_RATIO_GOAL = 0.8


def span_takes_weights() -> bool:
    """Whether this checkout's Span.load has the `weights` argument (issue 22) yet."""
    return "weights" in inspect.signature(Span.load).parameters


def node_takes_weights() -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "swarm.node", "--help"], capture_output=True, text=True, check=True
    ).stdout
    return "--weights" in out


# ---------------------------------------------------------------------------------------------
# part a: synthetic 8B-shaped layers, one child process per (file, format)


def synthetic_child(path: str, fmt: str, repeats: int, decode_steps: int, ref: str) -> dict:
    """Runs in a fresh process: load, measure, print one JSON line."""
    torch.set_num_threads(1)
    src = open_model(path)
    layers = src.config.num_layers
    before = memory()
    t0 = time.perf_counter()
    if span_takes_weights():
        span = Span.load(src, 0, layers, weights=fmt)
    else:
        if fmt != "float32":
            return {"error": "Span.load has no weights= on this checkout"}
        span = Span.load(src, 0, layers)
    load_s = time.perf_counter() - t0
    after = memory()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # includes the load
    # what the span holds once malloc hands freed load-time buffers back: the gap to `after`
    # is heap the load freed but the process still keeps
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed = memory()

    prompt = 128
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, prompt + decode_steps, src.config.hidden, generator=gen)
    kwargs = {}
    if "dtype" in inspect.signature(KVCache.allocate).parameters:
        kwargs["dtype"] = getattr(span, "cache_dtype", torch.float32)
    cache = KVCache.allocate(src.config, 0, layers, prompt + decode_steps + 1, **kwargs)
    # wall time, and CPU time of this process: on a shared machine the CPU time is what the
    # step cost, the wall time also counts waiting for a core
    prompt_s, decode_s, prompt_cpu, decode_cpu = [], [], [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        out = span.forward(x[:, :prompt], cache, 0, 0, layers)
        prompt_s.append(time.perf_counter() - t)
        prompt_cpu.append(time.process_time() - c)
    for i in range(decode_steps):
        t, c = time.perf_counter(), time.process_time()
        span.forward(x[:, prompt + i : prompt + i + 1], cache, prompt + i, 0, layers)
        decode_s.append(time.perf_counter() - t)
        decode_cpu.append(time.process_time() - c)

    # what the layers add to the residual stream, against float32's on the same input
    delta = (out - x[:, :prompt]).float()
    err = None
    if fmt == "float32":
        torch.save(delta, ref)
    elif os.path.exists(ref):
        want = torch.load(ref)
        err = float((delta - want).norm() / want.norm())
    return {
        "layers": layers,
        "load_s": load_s,
        "rss": after["VmRSS"] - before["VmRSS"],
        "anon": after["RssAnon"] - before["RssAnon"],
        "trimmed": trimmed["VmRSS"] - before["VmRSS"],
        "peak": peak - before["VmRSS"],
        "decode_s": statistics.median(decode_s),
        "prompt_s": statistics.median(prompt_s),
        "decode_cpu": statistics.median(decode_cpu),
        "prompt_cpu": statistics.median(prompt_cpu),
        "finite": bool(torch.isfinite(out).all()),
        "err": err,
        "cache_dtype": str(kwargs.get("dtype", torch.float32)).removeprefix("torch."),
    }


def file_bytes_per_layer(path: Path) -> float:
    import gguf

    reader = gguf.GGUFReader(str(path))
    blocks = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("blk."))
    layers = len({t.name.split(".")[1] for t in reader.tensors if t.name.startswith("blk.")})
    return blocks / layers


def synthetic_file(cache_dir: Path, qtype: str, layers: int) -> Path:
    from synthetic_gguf import Shapes, write_synthetic_gguf

    path = cache_dir / f"llama3-8b-shapes-{layers}L.{qtype}.gguf"
    if not path.exists():  # written under a temporary name, so a killed run leaves no half file
        print(f"writing {path} ...", flush=True)
        tmp = path.with_suffix(".part")
        write_synthetic_gguf(tmp, Shapes(layers=layers), qtype)
        tmp.rename(path)
    return path


def run_synthetic(a) -> None:
    a.cache_dir.mkdir(parents=True, exist_ok=True)
    formats = a.formats if span_takes_weights() else ["float32"]
    if formats != a.formats:
        print("Span.load has no weights= here: float32 only (the formats land with issue 22)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in a.qtypes:
            path = synthetic_file(a.cache_dir, qtype, a.layers)
            per_layer_file = file_bytes_per_layer(path)
            ref = os.path.join(tmp, f"ref-{qtype}.pt")
            for fmt in ["float32"] + [f for f in formats if f != "float32"]:
                if fmt not in formats:
                    continue
                cmd = [
                    sys.executable,
                    __file__,
                    "--child-synthetic",
                    json.dumps([str(path), fmt, a.repeats, a.decode_steps, ref]),
                ]
                print(f"{qtype} {fmt} ...", flush=True)
                p = subprocess.run(cmd, capture_output=True, text=True)
                if p.returncode != 0:
                    r = {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:80]}
                else:
                    r = json.loads(p.stdout.strip().splitlines()[-1])
                rows.append((qtype, fmt, per_layer_file, r))
    print_synthetic(rows, a)


def print_synthetic(rows, a) -> None:
    print(
        f"\nsynthetic Llama-3-8B-shaped layers (hidden 4096, intermediate 14336, 32/8 heads),"
        f" {a.layers} layers, 1 thread; decode: median of {a.decode_steps} steps after a"
        f" 128-token prompt; prompt: median of {a.repeats} 128-token passes. Per layer"
        " except 'peak-st'."
    )
    print(
        f"{'file':6}{'weights':>9}{'file MB':>8}{'RSS+ MB':>8}{'RSS/file':>9}{'trim/file':>10}"
        f"{'peak-st':>8}"
        f"{'load s':>7}{'decode ms':>10}{'(cpu)':>7}{'prompt ms':>10}{'(cpu)':>7}"
        f"{'dec x f32':>10}{'pr x f32':>9}{'err vs f32':>11}{'cache':>9}"
    )
    f32 = {q: r for q, f, _, r in rows if f == "float32" and "error" not in r}
    for qtype, fmt, file_b, r in rows:
        if "error" in r:
            print(f"{qtype:6}{fmt:>9}   {r['error']}")
            continue
        n = r["layers"]
        base = f32.get(qtype)
        dec_x = f"{base['decode_cpu'] / r['decode_cpu']:10.2f}" if base else f"{'':>10}"
        pr_x = f"{base['prompt_cpu'] / r['prompt_cpu']:9.2f}" if base else f"{'':>9}"
        err = "" if r["err"] is None else f"{r['err']:.4f}"
        flag = "" if r["finite"] else "  NON-FINITE OUTPUT"
        print(
            f"{qtype:6}{fmt:>9}{file_b / MB:8.1f}{r['rss'] / n / MB:8.1f}"
            f"{r['rss'] / n / file_b:9.2f}{r['trimmed'] / n / file_b:10.2f}"
            f"{(r['peak'] - r['rss']) / MB:8.0f}{r['load_s'] / n:7.2f}"
            f"{r['decode_s'] / n * 1e3:10.1f}{r['decode_cpu'] / n * 1e3:7.1f}"
            f"{r['prompt_s'] / n * 1e3:10.0f}{r['prompt_cpu'] / n * 1e3:7.0f}"
            f"{dec_x}{pr_x}{err:>11}{r['cache_dtype']:>9}{flag}"
        )
    print(
        f"goals: RSS/file <= {RSS_OVER_FILE_GOAL}; int4 decode >= {INT4_DECODE_SPEEDUP_GOAL}x"
        " float32's ('dec x f32'). RSS+: VmRSS added by Span.load (file pages it touched"
        " included); trim/file: the same after malloc_trim(0) returned the heap the load"
        " freed; peak-st: MB the load's peak RSS stood above that, for the whole load;"
        " x f32: float32's CPU time over this one's; err: |out - out_f32| / |out_f32| of what"
        " the layers add to the residual stream, same input."
    )


# ---------------------------------------------------------------------------------------------
# part b: the default model through real nodes, against transformers


def transformers_run(model, prompt_ids, new_tokens) -> tuple[float, float]:
    with torch.inference_mode():
        t0 = time.perf_counter()
        # logits of the last token only, as generate() and our client compute them
        out = model(torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=1)
        token = int(out.logits[0, -1].argmax())
        ttft = time.perf_counter() - t0
        t1 = time.perf_counter()
        for _ in range(new_tokens):
            out = model(torch.tensor([[token]]), cache=out.cache, use_cache=True)
            token = int(out.logits[0, -1].argmax())
        return ttft, new_tokens / (time.perf_counter() - t1)


def swarm_run(client, prompt_ids, new_tokens) -> tuple[float, float]:
    t = session_greedy(client, prompt_ids, new_tokens)
    return t.ttft, t.tokens_per_s


def node_rss_after_announce(node, settle: float) -> dict[str, int]:
    time.sleep(settle)  # the DHT announcement and first health refresh are done by then
    return memory(node.pid)


def run_model(a) -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    from devtools.launch import start_node, start_swarm, stop_all
    from swarm.client.client import Client
    from swarm.model.source import default_model_path

    path = default_model_path()
    layers = open_model(path).config.num_layers
    half = layers // 2
    has_flag = node_takes_weights()
    formats = a.formats if has_flag else [None]
    if not has_flag:
        print("python -m swarm.node has no --weights here: main's own format only")
    torch.set_num_threads(a.ref_threads)
    transformers.logging.set_verbosity_error()
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    prompt = [(i * 7919) % 40000 + 100 for i in range(a.prompt_tokens)]
    base = ["--threads", "1"]
    results = {}
    for fmt in formats:
        extra = base + (["--weights", fmt] if fmt else [])
        label = fmt or "main"
        print(f"{label}: node RSS ...", flush=True)
        rss = {}
        for span in [(0, 3), (0, layers)]:
            node = start_node(span, extra=extra)
            try:
                node.wait_serving()
                rss[span] = node_rss_after_announce(node, a.settle)
                if span == (0, layers):  # what the node says it loaded, and any fallback
                    said = [line for line in node.lines if _SAYS_FORMAT.search(line)]
            finally:
                stop_all([node])
        print(f"{label}: 2 nodes vs transformers ...", flush=True)
        nodes = start_swarm([(0, half), (half, layers)], extra=extra)
        try:
            for n in nodes:
                rss[n.layers] = node_rss_after_announce(n, a.settle / 2)
            client = Client(nodes[0].maddrs[:1])
            swarm_run(client, prompt[:16], 4)  # connections, routes and caches warm
            transformers_run(ref, prompt[:16], 4)
            runs = {"transformers": [], "swarm": []}
            for _ in range(a.repeats):  # alternate so machine noise hits both alike
                runs["transformers"].append(transformers_run(ref, prompt, a.new_tokens))
                runs["swarm"].append(swarm_run(client, prompt, a.new_tokens))
            client.close()
            rss_after = {n.layers: memory(n.pid) for n in nodes}
        finally:
            stop_all(nodes)
        results[label] = (rss, rss_after, runs, said)
    print_model(results, layers, half, a)


def print_model(results, layers, half, a) -> None:
    print(
        f"\ndefault model ({layers} layers), nodes --threads 1; transformers float32 unsplit in"
        f" this process, {a.ref_threads} thread(s); prompt {a.prompt_tokens} tokens, "
        f"{a.new_tokens} new tokens; median of {a.repeats}"
    )
    print(
        f"{'weights':9}{'0:3 MB':>8}{'0:15 MB':>9}{f'0:{layers} MB':>9}{'0:15 after':>11}"
        f"{'tok/s':>8}{'ref tok/s':>10}{'ratio':>7}{'TTFT s':>8}{'ref TTFT':>9}{'ratio':>7}"
    )
    for label, (rss, rss_after, runs, _) in results.items():
        med = {
            k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v))
            for k, v in runs.items()
        }
        sw, tf = med["swarm"], med["transformers"]
        print(
            f"{label:9}{rss[(0, 3)]['VmRSS'] / MB:8.0f}{rss[(0, half)]['VmRSS'] / MB:9.0f}"
            f"{rss[(0, layers)]['VmRSS'] / MB:9.0f}{rss_after[(0, half)]['VmRSS'] / MB:11.0f}"
            f"{sw[1]:8.1f}{tf[1]:10.1f}{sw[1] / tf[1]:7.2f}"
            f"{sw[0]:8.3f}{tf[0]:9.3f}{sw[0] / tf[0]:7.2f}"
        )
    goals = ", ".join(f"{s}:{e} <= {mb} MB" for (s, e), mb in NODE_RSS_GOALS_MB.items())
    print(
        f"goals: node VmRSS after announcing {goals}; decode tok/s ratio (swarm / transformers)"
        f" >= {DECODE_RATIO_GOAL}; TTFT ratio <= {TTFT_RATIO_GOAL}."
        " '0:15 after': the 0:15 node's VmRSS after the runs (KV caches allocated)."
    )
    for label, (*_, said) in results.items():
        for line in said:
            print(f"  {label} node 0:{layers}: {line.strip()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--part", choices=["synthetic", "model", "both"], default="both")
    p.add_argument(
        "--formats", type=lambda s: s.split(","), default=FORMATS, help="comma-separated"
    )
    p.add_argument("--qtypes", type=lambda s: s.split(","), default=QTYPES, help="synthetic files")
    p.add_argument("--layers", type=int, default=2, help="layers in the synthetic file")
    p.add_argument("--repeats", type=int, default=3, help="prompt passes / end-to-end runs")
    p.add_argument("--decode-steps", type=int, default=16, help="synthetic decode steps timed")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "swarm-bench",
        help="where the synthetic files are written once and reused",
    )
    p.add_argument("--prompt-tokens", type=int, default=500)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--ref-threads",
        type=int,
        default=1,
        help="torch threads of the transformers reference (1, as each node; on a loaded"
        " 2-core machine 2 threads made it 3-7x slower, not faster)",
    )
    p.add_argument("--settle", type=float, default=3.0, help="seconds after serving before RSS")
    p.add_argument("--child-synthetic", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child_synthetic:
        print(json.dumps(synthetic_child(*json.loads(a.child_synthetic))))
        return
    if a.part in ("synthetic", "both"):
        run_synthetic(a)
    if a.part in ("model", "both"):
        run_model(a)


if __name__ == "__main__":
    main()
