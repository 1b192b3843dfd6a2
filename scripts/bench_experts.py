"""What a mixture-of-experts layer costs a node, beside a dense layer with the same active
parameters, in the same run.

Writes one-layer synthetic GGUF files shaped like Qwen3-30B-A3B (hidden 2048, 32 heads / 4 KV
heads of 128, 128 experts of width 768, 8 used per token) and the dense layer computing as many
parameters per token (one MLP of width 8 x 768 = 6144), their matrices as Q4_K or Q8_0 blocks of
random codes (gguf-py cannot quantize to Q4_K; speed does not care what the codes mean). Loads
each as a node would (`--weights auto`) and prints per layer: decode ms for 1 and 8 sessions,
prompt tok/s at 512 tokens, resident MiB against the file's bytes. With --llama-bench, the
same figures from llama.cpp's llama-bench (a yardstick built in a scratch folder, never a
dependency) on 1- and 4-layer files of the same layers, per layer = the difference / 3: tg32 at
depth 100, pp8 (8 rows of one prompt, where the node's are 8 sessions' steps), pp512.

At 1 thread the figures are CPU time (the calling thread's; llama.cpp's from getrusage, see
scripts/bench_kernels.py), which other work on shared cores does not stretch; at more threads,
wall-clock.

  nice .venv/bin/python scripts/bench_experts.py [--qtypes Q4_K Q8_0] [--threads 1] \\
      [--llama-bench /path/to/llama-bench]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import bench  # noqa: F401  (first: OpenMP's wait policy, a node's, before torch loads)
import gguf
import numpy as np
import torch
from bench.proc import cpu_flags, cpu_name, memory
from bench_kernels import call_seconds, llama_seconds
from synthetic_gguf import add_vocab

from swarm.model.blocks import Span
from swarm.model.source import open_model

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, USED, EXPERT_WIDTH = 128, 8, 768
DENSE_WIDTH = USED * EXPERT_WIDTH
VOCAB = 1024
CONTEXT = 100  # tokens each session holds when its decode steps are timed


def random_blocks(qtype: str, rows: int, cols: int, rng) -> np.ndarray:
    """[rows, bytes per row] of valid `qtype` blocks: random codes, small positive scales."""
    gq = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[gq]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scales = 2 if qtype == "Q8_0" else 4  # Q8_0: d; Q4_K: d and dmin, f16 each
    d = rng.uniform(1e-3, 4e-3, size=(rows, cols // block, scales // 2)).astype(np.float16)
    data[..., :scales] = d.view(np.uint8).reshape(rows, cols // block, scales)
    return data.reshape(rows, -1)


def tensor_plan(moe: bool, layers: int = 1) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape, quantized) of a file of `layers` identical layers."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    plan = [
        ("token_embd.weight", (VOCAB, HIDDEN), True),
        ("output_norm.weight", (HIDDEN,), False),
        ("output.weight", (VOCAB, HIDDEN), True),
    ]
    for b in range(layers):
        p = f"blk.{b}."
        plan += [
            (p + "attn_norm.weight", (HIDDEN,), False),
            (p + "ffn_norm.weight", (HIDDEN,), False),
            (p + "attn_q_norm.weight", (HEAD_DIM,), False),
            (p + "attn_k_norm.weight", (HEAD_DIM,), False),
            (p + "attn_q.weight", (q, HIDDEN), True),
            (p + "attn_k.weight", (kv, HIDDEN), True),
            (p + "attn_v.weight", (kv, HIDDEN), True),
            (p + "attn_output.weight", (HIDDEN, q), True),
        ]
        if not moe:
            plan += [
                (p + "ffn_gate.weight", (DENSE_WIDTH, HIDDEN), True),
                (p + "ffn_up.weight", (DENSE_WIDTH, HIDDEN), True),
                (p + "ffn_down.weight", (HIDDEN, DENSE_WIDTH), True),
            ]
        else:
            plan += [
                (p + "ffn_gate_inp.weight", (EXPERTS, HIDDEN), False),
                (p + "ffn_gate_exps.weight", (EXPERTS, EXPERT_WIDTH, HIDDEN), True),
                (p + "ffn_up_exps.weight", (EXPERTS, EXPERT_WIDTH, HIDDEN), True),
                (p + "ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_WIDTH), True),
            ]
    return plan


def write_layer(path: Path, qtype: str, moe: bool, layers: int = 1, seed: int = 0) -> int:
    """Write the file; returns one block's bytes in it."""
    arch = "qwen3moe" if moe else "qwen3"
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {
        "block_count": layers,
        "context_length": 4096,
        "embedding_length": HIDDEN,
        "feed_forward_length": DENSE_WIDTH,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
        "attention.key_length": HEAD_DIM,
        "attention.value_length": HEAD_DIM,
        "rope.freq_base": 1e6,
    }.items():
        w.add_uint32(f"{arch}.{key}", value) if isinstance(value, int) else w.add_float32(
            f"{arch}.{key}", value
        )
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    if moe:
        w.add_uint32(f"{arch}.expert_count", EXPERTS)
        w.add_uint32(f"{arch}.expert_used_count", USED)
        w.add_uint32(f"{arch}.expert_feed_forward_length", EXPERT_WIDTH)
    add_vocab(w, VOCAB)  # llama.cpp loads no file without one
    block_bytes = 0
    for name, shape, quantized in tensor_plan(moe, layers):
        if quantized:
            rows = int(np.prod(shape[:-1]))
            data = random_blocks(qtype, rows, shape[-1], rng).reshape(*shape[:-1], -1)
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[qtype])
        elif name.endswith("ffn_gate_inp.weight"):
            w.add_tensor(name, rng.normal(0, 0.05, size=shape).astype(np.float32))
        else:
            w.add_tensor(name, rng.uniform(0.5, 1.5, size=shape).astype(np.float32))
        if name.startswith("blk.0."):
            block_bytes += data.nbytes if quantized else int(np.prod(shape)) * 4
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return block_bytes


def measure(path: Path, repeats: int, prompt: int, threads: int) -> dict:
    """In a fresh process (see main), so its RSS is this layer's alone."""
    torch.set_num_threads(threads)
    before = memory()["VmRSS"]
    span = Span.load(open_model(str(path)), 0, 1, weights="auto")
    held = memory()["VmRSS"] - before
    gen = torch.Generator().manual_seed(0)
    kinds = sorted({type(lin).__name__ for b in span.blocks for lin in b.linears})
    out = {"rss": held, "formats": f"{span.formats} {'/'.join(kinds)}"}
    for sessions in (1, 8):
        caches = [span.allocate_cache(0, 1, CONTEXT + 2 * repeats + 8) for _ in range(sessions)]
        for cache in caches:
            span.forward(torch.randn(1, CONTEXT, HIDDEN, generator=gen), cache, 0, 0, 1)
        h = torch.randn(sessions, HIDDEN, generator=gen)

        def step(h=h, caches=caches):
            span.decode(h, caches, [c.length for c in caches], 0, 1)

        out[f"decode{sessions}"] = 1e3 * call_seconds(step, repeats, threads)
    x = torch.randn(1, prompt, HIDDEN, generator=gen)
    cache = span.allocate_cache(0, 1, prompt)
    out["prompt"] = prompt / call_seconds(lambda: span.forward(x, cache, 0, 0, 1), 3, threads)
    return out


def measure_llama(binary: str, qtype: str, moe: bool, folder: Path, prompt: int, threads: int):
    """llama-bench's per-layer figures on 1- and 4-layer files of the same layers."""
    paths = [folder / f"synthetic-{'moe' if moe else 'dense'}-{qtype}-{n}.gguf" for n in (1, 4)]
    for path, layers in zip(paths, (1, 4)):
        write_layer(path, qtype, moe, layers)
    # (args, tokens generated, extra): differences of runs long enough that the noise of
    # loading a GiB-sized file stays small beside them (see llama_seconds); mapped, a run's
    # first tokens fault each expert's pages in, the same in both runs of a difference
    tests = {
        "decode1": (["-p", "0", "-d", str(CONTEXT)], 64, 3),
        "decode8": (["-p", "8", "-n", "0"], 0, 40),
        "prompt": (["-p", str(prompt), "-n", "0"], 0, 2),
    }
    out = {}
    try:
        for name, (args, gen, extra) in tests.items():
            one, four = (llama_seconds(binary, p, threads, args, gen, extra) for p in paths)
            seconds = (four - one) / 3
            out[name] = prompt / seconds if name == "prompt" else 1e3 * seconds
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--qtypes", nargs="+", default=["Q4_K", "Q8_0"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--dir", type=Path, default=Path("/tmp"))
    p.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    flags = cpu_flags(("avx512f", "avx512_bf16", "avx512_vnni", "avx2"))
    print(f"# {cpu_name()} ({', '.join(flags)}), {a.threads} thread(s)")
    clock = "CPU time" if a.threads == 1 else "wall-clock"
    print(f"# {clock}; decode with {CONTEXT} tokens of context a session; llama.cpp: tg32, pp8")
    head = "| qtype | layer | decode 1 ms | decode 8 ms | prompt tok/s | RSS MiB | file MiB |"
    print(head + " formats |")
    print("|---|---|---|---|---|---|---|---|")
    for qtype in a.qtypes:
        rows, theirs = {}, {}
        for moe in (True, False):
            layer = "MoE 128x768, top-8" if moe else "dense 6144"
            path = a.dir / f"synthetic-{'moe' if moe else 'dense'}-{qtype}.gguf"
            block_bytes = write_layer(path, qtype, moe)
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                r = pool.submit(measure, path, a.repeats, a.prompt, a.threads).result()
            rows[moe] = r
            os.remove(path)
            print(
                f"| {qtype} | {layer} | {r['decode1']:.2f} | {r['decode8']:.2f} |"
                f" {r['prompt']:.0f} | {r['rss'] / 2**20:.0f} | {block_bytes / 2**20:.0f} |"
                f" {r['formats']} |",
                flush=True,
            )
            if a.llama_bench:
                t = theirs[moe] = measure_llama(
                    a.llama_bench, qtype, moe, a.dir, a.prompt, a.threads
                )
                print(
                    f"| {qtype} | {layer}, llama.cpp | {t['decode1']:.2f} | {t['decode8']:.2f} |"
                    f" {t['prompt']:.0f} | | | |",
                    flush=True,
                )
        m, d = rows[True], rows[False]
        print(
            f"| {qtype} | MoE / dense | {m['decode1'] / d['decode1']:.2f}x |"
            f" {m['decode8'] / d['decode8']:.2f}x | {d['prompt'] / m['prompt']:.2f}x | | | |"
        )
        if theirs:
            t = theirs[True]
            print(
                f"| {qtype} | MoE, swarm / llama.cpp | {m['decode1'] / t['decode1']:.2f}x |"
                f" {m['decode8'] / t['decode8']:.2f}x | {t['prompt'] / m['prompt']:.2f}x |"
                " | | |"
            )
    print("(ratios are time over time: below 1 is faster)")


if __name__ == "__main__":
    main()
