"""What a mixture-of-experts layer costs a node, beside a dense layer with the same active
parameters, in the same run.

Writes one-layer synthetic GGUF files shaped like Qwen3-30B-A3B (hidden 2048, 32 heads / 4 KV
heads of 128, 128 experts of width 768, 8 used per token) and the dense layer computing as many
parameters per token (one MLP of width 8 x 768 = 6144), their matrices as Q4_K or Q8_0 blocks of
random codes (gguf-py cannot quantize to Q4_K; speed does not care what the codes mean). Loads
each as a node would (`--weights auto`) and prints per layer: decode ms for 1 and 8 sessions,
prompt tok/s at 512 tokens, resident MiB against the file's bytes.

  nice .venv/bin/python scripts/bench_experts.py [--qtypes Q4_K Q8_0] [--threads 1]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import checkout  # noqa: F401 (swarm/ from this checkout)
import gguf
import numpy as np
import torch

from swarm.model.blocks import Span
from swarm.model.source import open_model

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, USED, EXPERT_WIDTH = 128, 8, 768
DENSE_WIDTH = USED * EXPERT_WIDTH
VOCAB = 1024


def random_blocks(qtype: str, rows: int, cols: int, rng) -> np.ndarray:
    """[rows, bytes per row] of valid `qtype` blocks: random codes, small positive scales."""
    gq = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[gq]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scales = 2 if qtype == "Q8_0" else 4  # Q8_0: d; Q4_K: d and dmin, f16 each
    d = rng.uniform(1e-3, 4e-3, size=(rows, cols // block, scales // 2)).astype(np.float16)
    data[..., :scales] = d.view(np.uint8).reshape(rows, cols // block, scales)
    return data.reshape(rows, -1)


def tensor_plan(moe: bool) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape, quantized) of a one-layer file."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    plan = [
        ("token_embd.weight", (VOCAB, HIDDEN), True),
        ("output_norm.weight", (HIDDEN,), False),
        ("output.weight", (VOCAB, HIDDEN), True),
        ("blk.0.attn_norm.weight", (HIDDEN,), False),
        ("blk.0.ffn_norm.weight", (HIDDEN,), False),
        ("blk.0.attn_q_norm.weight", (HEAD_DIM,), False),
        ("blk.0.attn_k_norm.weight", (HEAD_DIM,), False),
        ("blk.0.attn_q.weight", (q, HIDDEN), True),
        ("blk.0.attn_k.weight", (kv, HIDDEN), True),
        ("blk.0.attn_v.weight", (kv, HIDDEN), True),
        ("blk.0.attn_output.weight", (HIDDEN, q), True),
    ]
    if not moe:
        return plan + [
            ("blk.0.ffn_gate.weight", (DENSE_WIDTH, HIDDEN), True),
            ("blk.0.ffn_up.weight", (DENSE_WIDTH, HIDDEN), True),
            ("blk.0.ffn_down.weight", (HIDDEN, DENSE_WIDTH), True),
        ]
    return plan + [
        ("blk.0.ffn_gate_inp.weight", (EXPERTS, HIDDEN), False),
        ("blk.0.ffn_gate_exps.weight", (EXPERTS, EXPERT_WIDTH, HIDDEN), True),
        ("blk.0.ffn_up_exps.weight", (EXPERTS, EXPERT_WIDTH, HIDDEN), True),
        ("blk.0.ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_WIDTH), True),
    ]


def write_layer(path: Path, qtype: str, moe: bool, seed: int = 0) -> int:
    """Write the file; returns the block's bytes in it."""
    arch = "qwen3moe" if moe else "qwen3"
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {
        "block_count": 1,
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
    block_bytes = 0
    for name, shape, quantized in tensor_plan(moe):
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


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def measure(path: Path, repeats: int, prompt: int, threads: int) -> dict:
    """In a fresh process (see main), so its RSS is this layer's alone."""
    torch.set_num_threads(threads)
    before = rss()
    span = Span.load(open_model(str(path)), 0, 1, weights="auto")
    held = rss() - before
    gen = torch.Generator().manual_seed(0)
    out = {"rss": held, "formats": span.formats}
    for sessions in (1, 8):
        caches = [span.allocate_cache(0, 1, prompt + repeats + 8) for _ in range(sessions)]
        for cache in caches:  # 100 tokens of context each
            span.forward(torch.randn(1, 100, HIDDEN, generator=gen), cache, 0, 0, 1)
        h = torch.randn(sessions, HIDDEN, generator=gen)

        def step(h=h, caches=caches):
            span.decode(h, caches, [c.length for c in caches], 0, 1)

        out[f"decode{sessions}"] = median_ms(step, repeats)
    x = torch.randn(1, prompt, HIDDEN, generator=gen)
    cache = span.allocate_cache(0, 1, prompt)
    out["prompt"] = prompt / (median_ms(lambda: span.forward(x, cache, 0, 0, 1), 3) / 1000)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--qtypes", nargs="+", default=["Q4_K", "Q8_0"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--dir", type=Path, default=Path("/tmp"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    cpu = next((ln.split(":")[1].strip() for ln in open("/proc/cpuinfo") if "model name" in ln), "")
    flags = [
        f
        for f in ("avx512f", "avx512_bf16", "avx512_vnni", "avx2")
        if f in open("/proc/cpuinfo").read()
    ]
    print(f"# {cpu or platform.processor()} ({', '.join(flags)}), {a.threads} thread(s)")
    head = "| qtype | layer | decode 1 ms | decode 8 ms | prompt tok/s | RSS MiB | file MiB |"
    print(head + " formats |")
    print("|---|---|---|---|---|---|---|---|")
    for qtype in a.qtypes:
        rows = {}
        for moe in (True, False):
            path = a.dir / f"synthetic-{'moe' if moe else 'dense'}-{qtype}.gguf"
            block_bytes = write_layer(path, qtype, moe)
            with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
                r = pool.submit(measure, path, a.repeats, a.prompt, a.threads).result()
            rows[moe] = r
            os.remove(path)
            print(
                f"| {qtype} | {'MoE 128x768, top-8' if moe else 'dense 6144'} |"
                f" {r['decode1']:.2f} | {r['decode8']:.2f} | {r['prompt']:.0f} |"
                f" {r['rss'] / 2**20:.0f} | {block_bytes / 2**20:.0f} | {r['formats']} |",
                flush=True,
            )
        m, d = rows[True], rows[False]
        print(
            f"| {qtype} | MoE / dense | {m['decode1'] / d['decode1']:.2f}x |"
            f" {m['decode8'] / d['decode8']:.2f}x | {m['prompt'] / d['prompt']:.2f}x | | | |"
        )


if __name__ == "__main__":
    main()
