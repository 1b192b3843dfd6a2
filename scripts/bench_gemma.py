"""Gemma 3 270M (Q4_K_M GGUF, `scripts/setup.sh --with-gemma`) in transformers, the yardstick a
swarm serving it is compared to; with --swarm, local swarms against it.

  transformers  each in a fresh process: the tokenizer read from the GGUF, saved once with
                save_pretrained to a folder beside it, and read from that folder (same ids?).
                In this process: the float32 model's load time and RSS, then greedy decode
                tok/s of --new-tokens tokens at each of --threads on each prompt (median of
                --repeats), and the greedy tokens and text (checked against generate()).
  --swarm       per split (--splits) and node --weights (--formats): nodes at --node-threads
                each and a client in its own process; the client's tokens against
                transformers' (identical, first divergence), each node's RSS (after serving,
                after the runs), the client's RSS, decode and first-token times.

    PYTHONPATH=$PWD nice .venv/bin/python scripts/bench_gemma.py [--swarm] [--model PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

from bench.proc import cpu_name, memory
from bench.timing import session_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
]
MB = 1e6


def tokenizer_folder(path: Path) -> Path:
    return path.with_suffix(".tokenizer")


def run_child(args: list[str]) -> dict:
    cmd = [sys.executable, __file__, *args]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["?"])[-1][:200]}
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# the tokenizer, each load in a fresh process


def tokenizer_child(path: str, source: str) -> dict:
    """`source` "gguf": read it from the GGUF (and save it to the folder if that is missing);
    "folder": read it from the folder."""
    warnings.filterwarnings("ignore")
    t = time.perf_counter()
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    import_s = time.perf_counter() - t
    gguf_path = Path(path)
    folder = tokenizer_folder(gguf_path)
    t = time.perf_counter()
    if source == "gguf":
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    else:
        tok = AutoTokenizer.from_pretrained(str(folder))
    load_s = time.perf_counter() - t
    out = {
        "import_s": import_s,
        "load_s": load_s,
        "rss": memory()["VmRSS"],
        "class": type(tok).__name__,
        "vocab": len(tok),
        "special": [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id],
        "chat_template": tok.chat_template is not None,
        "ids": [tok(p)["input_ids"] for p in PROMPTS],
        "decoded": tok.decode(list(range(1000, 1100))),
    }
    if source == "gguf" and not folder.exists():
        tmp = folder.with_name(folder.name + ".part")  # a killed run leaves no half folder
        t = time.perf_counter()
        tok.save_pretrained(str(tmp))
        tmp.rename(folder)
        out["save_s"] = time.perf_counter() - t
    if folder.exists():
        out["folder_mb"] = sum(f.stat().st_size for f in folder.iterdir()) / MB
    return out


def measure_tokenizer(path: Path) -> dict[str, dict]:
    print("tokenizer: from the GGUF, then from the saved folder, each in a fresh process ...")
    res = {"gguf": run_child(["--child-tokenizer", str(path), "gguf"])}
    res["folder"] = run_child(["--child-tokenizer", str(path), "folder"])
    return res


def print_tokenizer(res: dict[str, dict], path: Path) -> None:
    print(f"\ntokenizer (fresh process each; folder {tokenizer_folder(path)}):")
    print("| read from | import transformers s | load s | process RSS MB | class | vocab |")
    print("|---|---|---|---|---|---|")
    for source, r in res.items():
        if "error" in r:
            print(f"| {source} | {r['error']} |")
            continue
        print(
            f"| {source} | {r['import_s']:.2f} | {r['load_s']:.2f} | {r['rss'] / MB:.0f} |"
            f" {r['class']} | {r['vocab']} |"
        )
    g, f = res["gguf"], res["folder"]
    if "save_s" in g:
        print(f"saved once with save_pretrained in {g['save_s']:.2f} s")
    if "error" not in g and "error" not in f:
        same = all(g[k] == f[k] for k in ("ids", "special", "vocab", "decoded", "chat_template"))
        print(
            f"folder {f.get('folder_mb', 0):.1f} MB; same ids, specials and decoding: {same};"
            f" chat template in the GGUF: {g['chat_template']};"
            f" load {g['load_s'] / f['load_s']:.0f}x faster from the folder"
        )


# ---------------------------------------------------------------------------------------------
# transformers in this process


def greedy(model, ids: list[int], new: int) -> tuple[list[int], float, float, float]:
    """`new` greedy tokens: the first from the prompt pass, the rest decode steps.
    Returns the tokens, seconds to the first, decode tok/s, and the process's CPU seconds a
    decode step (on a shared machine wall time also counts waiting for a core)."""
    import torch

    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        tokens = [int(out.logits[0, -1].argmax())]
        ttft = time.perf_counter() - t0
        t1, c1 = time.perf_counter(), time.process_time()
        for _ in range(new - 1):
            out = model(
                torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True
            )
            tokens.append(int(out.logits[0, -1].argmax()))
        cpu = (time.process_time() - c1) / (new - 1)
        return tokens, ttft, (new - 1) / (time.perf_counter() - t1), cpu


def run_transformers(path: Path, a) -> dict:
    warnings.filterwarnings("ignore")
    before = memory()
    t = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    import_s = time.perf_counter() - t
    folder = tokenizer_folder(path)
    if folder.exists():  # the same ids as from the GGUF, checked above, in a fraction of the time
        tok = AutoTokenizer.from_pretrained(str(folder))
    else:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    loaded_tok = memory()
    print("transformers: loading the model in float32 ...", flush=True)
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    load_s = time.perf_counter() - t
    loaded = memory()
    params = sum(p.numel() for p in model.parameters())

    runs: dict[int, list[list[tuple[list[int], float, float]]]] = {}
    for r in range(a.repeats):
        for threads in a.threads:
            torch.set_num_threads(threads)
            if r == 0:
                greedy(model, prompts[0], 4)  # first call's one-off costs
            runs.setdefault(threads, []).append([greedy(model, p, a.new_tokens) for p in prompts])
        print(f"  repeat {r + 1}/{a.repeats} done", flush=True)
    tokens = {t: [x[0] for x in rs[0]] for t, rs in runs.items()}
    reference = tokens[a.threads[0]]
    with torch.inference_mode():  # the loop above against transformers' own greedy generate()
        gen = [
            model.generate(torch.tensor([p]), max_new_tokens=a.new_tokens, do_sample=False)[0]
            for p in prompts
        ]
    out = {
        "import_s": import_s,
        "load_s": load_s,
        "params": params,
        "rss_before": before["VmRSS"],
        "rss_tokenizer": loaded_tok["VmRSS"],
        "rss_loaded": loaded["VmRSS"],
        "anon_loaded": loaded["RssAnon"],
        "hwm_loaded": loaded["VmHWM"],
        "rss_after": memory()["VmRSS"],
        "prompts": prompts,
        "tokens": reference,
        "threads_agree": all(tokens[t] == reference for t in tokens),
        "generate_agrees": [
            g[len(p) :].tolist() == ref[: len(g) - len(p)]
            for g, p, ref in zip(gen, prompts, reference)
        ],
        "texts": [tok.decode(t) for t in reference],
        "eos": tok.eos_token_id,
        "rates": {
            t: [
                (
                    statistics.median(rep[i][1] for rep in rs),
                    statistics.median(rep[i][2] for rep in rs),
                    statistics.median(rep[i][3] for rep in rs),
                )
                for i in range(len(prompts))
            ]
            for t, rs in runs.items()
        },
    }
    del model
    gc.collect()
    return out


def print_transformers(r: dict, a) -> None:
    print(
        f"\ntransformers float32 ({r['params'] / 1e6:.0f} M parameters): import"
        f" {r['import_s']:.1f} s, model load {r['load_s']:.1f} s; process VmRSS"
        f" {r['rss_before'] / MB:.0f} MB at start, {r['rss_tokenizer'] / MB:.0f} MB with the"
        f" tokenizer, {r['rss_loaded'] / MB:.0f} MB loaded (anon {r['anon_loaded'] / MB:.0f}),"
        f" peak {r['hwm_loaded'] / MB:.0f} MB while loading, {r['rss_after'] / MB:.0f} MB after"
        " the runs"
    )
    print(
        f"\ngreedy, {a.new_tokens} new tokens (1 from the prompt pass, {a.new_tokens - 1} decode"
        f" steps), median of {a.repeats}; load average {os.getloadavg()[0]:.2f}"
    )
    cols = " | ".join(f"{t} thr: decode tok/s | CPU ms/step | TTFT ms" for t in a.threads)
    print(f"| prompt | tokens | {cols} |")
    print("|---|---|" + "---|---|---|" * len(a.threads))
    for i, p in enumerate(PROMPTS):
        cells = " | ".join(
            f"{r['rates'][t][i][1]:.1f} | {r['rates'][t][i][2] * 1e3:.1f}"
            f" | {r['rates'][t][i][0] * 1e3:.0f}"
            for t in a.threads
        )
        print(f"| {p!r} | {len(r['prompts'][i])} | {cells} |")
    print(
        f"same tokens at every thread count: {r['threads_agree']};"
        f" same as generate(): {r['generate_agrees']}"
    )
    for i, p in enumerate(PROMPTS):
        eos = " (EOS among them)" if r["eos"] in r["tokens"][i] else ""
        print(f"\n{p!r} -> prompt ids {r['prompts'][i]}\n  greedy ids{eos}: {r['tokens'][i]}")
        print(f"  text: {r['texts'][i]!r}")


# ---------------------------------------------------------------------------------------------
# --swarm: local nodes and a client process


def client_child(spec: str) -> dict:
    """In a fresh process: a client of the swarm, greedy on each prompt, its own RSS."""
    warnings.filterwarnings("ignore")
    import torch

    from swarm.client.client import Client

    s = json.loads(spec)
    torch.set_num_threads(s["threads"])
    t = time.perf_counter()
    client = Client(s["peers"], model=s["model"], wire_dtype=s["wire"])
    start_s = time.perf_counter() - t

    def run(ids: list[int], new: int) -> tuple[list[int], float, float]:
        t = session_greedy(client, ids, new - 1)
        return t.tokens, t.ttft, t.tokens_per_s

    t = time.perf_counter()
    run(s["prompts"][0], 4)  # connections, route, the head's load
    warm_s = time.perf_counter() - t
    runs = [[run(p, s["new"]) for p in s["prompts"]] for _ in range(s["repeats"])]
    client.close()
    status = memory()
    return {
        "start_s": start_s,
        "warm_s": warm_s,
        "tokens": [x[0] for x in runs[0]],
        "repeat_agrees": all([x[0] for x in rep] == [x[0] for x in runs[0]] for rep in runs),
        "ttft": [statistics.median(rep[i][1] for rep in runs) for i in range(len(s["prompts"]))],
        "tps": [statistics.median(rep[i][2] for rep in runs) for i in range(len(s["prompts"]))],
        "rss": status["VmRSS"],
        "hwm": status["VmHWM"],
    }


def compare(got: list[int], want: list[int]) -> tuple[int, int | None]:
    """Tokens equal at the same position, and the first position that differs (None: none)."""
    same = sum(g == w for g, w in zip(got, want))
    first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
    if first is None and len(got) != len(want):
        first = min(len(got), len(want))
    return same, first


def run_swarm(path: Path, ref: dict, a) -> list[dict]:
    from devtools.launch import even_spans, start_swarm, stop_all
    from swarm.model.source import open_model

    layers = open_model(path).config.num_layers
    rows = []
    for parts in a.splits:
        spans = even_spans(layers, parts)
        for fmt in a.formats:
            label = f"{parts} nodes {spans}, --weights {fmt}"
            print(f"swarm: {label} ...", flush=True)
            # float32 weights are the exact mode only with float32 on the wire too; else the
            # model's own wire dtype (bfloat16 for Gemma: its residual overflows float16)
            wire = a.wire_dtype or ("float32" if fmt == "float32" else None)
            extra = ["--weights", fmt, "--threads", str(a.node_threads)]
            extra += ["--wire-dtype", wire] if wire else []
            row = {"parts": parts, "weights": fmt, "spans": spans, "wire": wire or "model's"}
            t = time.perf_counter()
            try:
                nodes = start_swarm(spans, model=str(path), extra=extra, stderr=subprocess.STDOUT)
            except (RuntimeError, TimeoutError) as exc:
                last = [line for line in str(exc).splitlines() if line.strip()][-3:]
                row["error"] = " / ".join(last)[-400:]
                rows.append(row)
                print(f"  failed: {row['error']}", flush=True)
                continue
            try:
                row["up_s"] = time.perf_counter() - t
                time.sleep(a.settle)  # the DHT announcement and first health refresh are done
                row["rss_serving"] = [memory(n.pid) for n in nodes]
                spec = {
                    "peers": nodes[0].maddrs[:1],
                    "model": str(path),
                    "prompts": ref["prompts"],
                    "new": a.new_tokens,
                    "repeats": a.swarm_repeats,
                    "threads": a.client_threads,
                    "wire": wire,
                }
                row["client"] = run_child(["--child-client", json.dumps(spec)])
                row["rss_after"] = [memory(n.pid) for n in nodes]
                row["said"] = [
                    line.strip()
                    for n in nodes
                    for line in n.lines
                    if re.search(r"loaded blocks|fall(s|ing)? back|left out|unavailable", line)
                ]
            finally:
                stop_all(nodes)
            rows.append(row)
    return rows


def print_swarm(rows: list[dict], ref: dict, a) -> None:
    print(
        f"\nswarm: nodes --threads {a.node_threads}, client {a.client_threads} thread(s) in its"
        f" own process, {a.new_tokens} greedy tokens a prompt, median of {a.swarm_repeats};"
        f" tokens against transformers float32 at {a.threads[0]} thread(s)"
    )
    print(
        "| split | weights | wire | identical tokens (first divergence) per prompt | decode tok/s"
        " per prompt | TTFT ms | node VmRSS MB serving / after | client VmRSS MB (peak) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        head = f"| {row['spans']} | {row['weights']} | {row['wire']} |"
        c = row.get("client", {})
        if "error" in row or "error" in c:
            print(f"{head} failed: {row.get('error') or c['error']} |")
            continue
        agree = ", ".join(
            f"{same}/{len(want)}" + ("" if first is None else f" (@{first})")
            for same, first, want in (
                (*compare(got, want), want) for got, want in zip(c["tokens"], ref["tokens"])
            )
        )
        tps = ", ".join(f"{x:.1f}" for x in c["tps"])
        ttft = ", ".join(f"{x * 1e3:.0f}" for x in c["ttft"])
        rss = ", ".join(
            f"{s['VmRSS'] / MB:.0f} / {e['VmRSS'] / MB:.0f}"
            for s, e in zip(row["rss_serving"], row["rss_after"])
        )
        print(
            f"{head} {agree} | {tps} | {ttft} | {rss} | {c['rss'] / MB:.0f} ({c['hwm'] / MB:.0f}) |"
        )
    for row in rows:
        c = row.get("client", {})
        if "error" in row or "error" in c:
            continue
        print(
            f"{row['spans']} {row['weights']}: swarm up in {row['up_s']:.1f} s; client start"
            f" {c['start_s']:.1f} s, first session (route, head) {c['warm_s']:.1f} s; repeats"
            f" gave the same tokens: {c['repeat_agrees']}"
        )
        for line in row["said"]:
            print(f"  {line}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    csv = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--model", type=Path, help="the GGUF (default: the package's, assembled)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--threads", type=csv, default=[1, 2], help="transformers' torch threads")
    p.add_argument("--repeats", type=int, default=3, help="transformers runs per prompt")
    p.add_argument("--no-tokenizer", action="store_true", help="skip the tokenizer loads")
    p.add_argument("--swarm", action="store_true", help="also local swarms against transformers")
    p.add_argument("--splits", type=csv, default=[2, 3], help="how many nodes split the blocks")
    p.add_argument("--formats", type=lambda s: s.split(","), default=["float32", "auto"])
    p.add_argument("--node-threads", type=int, default=1)
    p.add_argument(
        "--wire-dtype",
        help="every row's (default: float32 with float32 weights, else the model's own)",
    )
    p.add_argument("--client-threads", type=int, default=1)
    p.add_argument("--swarm-repeats", type=int, default=1)
    p.add_argument("--settle", type=float, default=3.0, help="seconds after serving before RSS")
    p.add_argument("--child-tokenizer", nargs=2, help=argparse.SUPPRESS)
    p.add_argument("--child-client", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child_tokenizer:
        print(json.dumps(tokenizer_child(*a.child_tokenizer)))
        return
    if a.child_client:
        print(json.dumps(client_child(a.child_client)))
        return
    # transformers' GGUF loader draws a progress bar with tqdm itself; tqdm reads this on import
    os.environ.setdefault("TQDM_DISABLE", "1")
    from swarm.model.source import gemma3_270m_path

    try:
        path = a.model or gemma3_270m_path()
    except FileNotFoundError as exc:
        sys.exit(str(exc))
    print(f"{path} ({path.stat().st_size / MB:.0f} MB); CPU {cpu_name()}, {os.cpu_count()} cores")
    tokenizer = None if a.no_tokenizer else measure_tokenizer(path)
    ref = run_transformers(path, a)
    if tokenizer:
        print_tokenizer(tokenizer, path)
    print_transformers(ref, a)
    if a.swarm:
        print_swarm(run_swarm(path, ref, a), ref, a)


if __name__ == "__main__":
    main()
