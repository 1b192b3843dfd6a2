"""Write a random-weight Llama GGUF file with a big model's layer shapes, in one quantized type.

Benchmarks need 8B-sized layers without an 8B download: by default this writes Llama-3-8B's
shapes (hidden 4096, intermediate 14336, 32 heads, 8 KV heads, head_dim 128) with a small
vocabulary, so a 2-layer file is ~0.3 GB as Q4_1. It carries the llama metadata GGUFSource reads
and a placeholder vocabulary (llama.cpp loads no file without one), no real tokenizer. Tensors
are generated, quantized and written one at a time (rows in chunks), so writing never holds more
than one quantized tensor in memory. Q4_0, Q4_1 and Q8_0 are gguf's own
quantizers; Q4_K and Q6_K (gguf has none) are plain ones here: per sub-block min/max or absmax
scales rounded to the format's 6/8-bit grid, no search, valid blocks of the real layout.

Example: .venv/bin/python scripts/synthetic_gguf.py /tmp/llama8b-2.Q4_1.gguf --layers 2 --qtype Q4_1
"""

from __future__ import annotations

import argparse
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

QTYPES = {n: gguf.GGMLQuantizationType[n] for n in ("Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q8_0")}
FILE_TYPES = {
    n: gguf.LlamaFileType[f"MOSTLY_{n}" + ("_M" if n in ("Q4_K", "Q5_K") else "")] for n in QTYPES
}
_CHUNK_ROWS = 512  # rows generated and quantized at once: bounds the float32 temporaries


@dataclass(frozen=True)
class Shapes:
    hidden: int = 4096
    intermediate: int = 14336
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 4096
    layers: int = 2
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    context: int = 8192


def tensor_plan(s: Shapes) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF tensor names and numpy shapes ([out, in] for linears), in file order."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    plan = [("token_embd.weight", (s.vocab, s.hidden))]
    for b in range(s.layers):
        p = f"blk.{b}."
        plan += [
            (p + "attn_norm.weight", (s.hidden,)),
            (p + "attn_q.weight", (q, s.hidden)),
            (p + "attn_k.weight", (kv, s.hidden)),
            (p + "attn_v.weight", (kv, s.hidden)),
            (p + "attn_output.weight", (s.hidden, q)),
            (p + "ffn_norm.weight", (s.hidden,)),
            (p + "ffn_gate.weight", (s.intermediate, s.hidden)),
            (p + "ffn_up.weight", (s.intermediate, s.hidden)),
            (p + "ffn_down.weight", (s.hidden, s.intermediate)),
        ]
    plan.append(("output_norm.weight", (s.hidden,)))
    return plan


def synthetic_rows(
    name: str, shape: tuple[int, ...], seed: int, lo: int, hi: int, std: float = 0.02
) -> np.ndarray:
    """Rows [lo, hi) of a tensor's float32 values; the same on every call (chunk-seeded).

    Norm weights are ones, as a trained model's are near; linears are N(0, std), which keeps
    activations of 8B-sized layers finite (std 0.02 as Llama's initializer).
    """
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)
    assert lo % _CHUNK_ROWS == 0, "rows are generated in whole chunks"
    parts = []
    for r0 in range(lo, hi, _CHUNK_ROWS):
        r1 = min(r0 + _CHUNK_ROWS, hi)
        rng = np.random.default_rng([seed, zlib.crc32(name.encode()), r0 // _CHUNK_ROWS])
        parts.append(rng.standard_normal((r1 - r0, *shape[1:]), dtype=np.float32) * np.float32(std))
    return np.concatenate(parts)


def synthetic_tensor(name: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """The whole float32 tensor the writer quantized (for checks on small files)."""
    return synthetic_rows(name, shape, seed, 0, shape[0])


def _quantized(name: str, shape: tuple[int, ...], qtype, seed: int) -> np.ndarray:
    rows = shape[0]
    out = None
    for r0 in range(0, rows, _CHUNK_ROWS):
        r1 = min(r0 + _CHUNK_ROWS, rows)
        q = quantize(synthetic_rows(name, shape, seed, r0, r1), qtype.name)
        if out is None:
            out = np.empty((rows, q.shape[1]), dtype=np.uint8)
        out[r0:r1] = q
    return out


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """float32 [rows, cols] -> the GGUF blocks of `qtype`, uint8 [rows, bytes per row]."""
    if qtype in ("Q4_K", "Q5_K"):
        return _qk(w, 4 if qtype == "Q4_K" else 5)
    if qtype == "Q6_K":
        return _q6_k(w)
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype(np.float16)[..., None]).view(np.uint8)


def _qk(w: np.ndarray, bits: int) -> np.ndarray:
    # super-blocks of 256: w = d * sc[j] * q - dmin * m[j] over eight sub-blocks j of 32, with
    # 6-bit sc and m, 4-bit q (Q4_K, layout as swarm/model/quant.py reads it) or 5-bit (Q5_K: the
    # fifth bits of sub-block j are bit j of 32 bytes qh before the low nibbles)
    rows = w.shape[0]
    top = (1 << bits) - 1
    g = w.reshape(rows, -1, 8, 32)
    lo = np.minimum(g.min(-1), 0.0)
    scale = np.maximum(g.max(-1) - lo, 1e-12) / top
    d = scale.max(-1) / 63.0
    dmin = np.maximum((-lo).max(-1) / 63.0, 1e-12)
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d[..., None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(-lo / dmin[..., None]), 0, 63).astype(np.uint8)
    step = (d[..., None] * sc)[..., None]
    q = np.clip(np.rint((g + (dmin[..., None] * m)[..., None]) / step), 0, top).astype(np.uint8)
    packed = np.empty((*d.shape, 12), dtype=np.uint8)
    packed[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    runs = (q & 0xF).reshape(*d.shape, 4, 2, 32)  # four runs of 64: low nibbles, then high
    qs = (runs[..., 0, :] | (runs[..., 1, :] << 4)).reshape(*d.shape, 128)
    high = (
        []
        if bits == 4
        else [((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(-2, dtype=np.uint8)]
    )
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, *high, qs], axis=-1)
    return blocks.reshape(rows, -1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    # super-blocks of 256: w = d * sc[k] * (q - 32) over sixteen sub-blocks k of 16, int8 sc,
    # 6-bit q split in low nibbles (ql) and high pairs (qh); d (float16) last
    rows = w.shape[0]
    g = w.reshape(rows, -1, 16, 16)
    scale = np.maximum(np.abs(g).max(-1), 1e-12) / 31.0
    d = (scale.max(-1) / 127.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / d[..., None]), 1, 127)
    q = np.clip(np.rint(g / (d[..., None] * sc)[..., None]), -32, 31) + 32
    q = q.astype(np.uint8).reshape(*d.shape, 2, 4, 32)  # [half, quarter, l]: element 128h+32k+l
    ql = np.concatenate(
        [
            q[..., 0, :] & 0xF | (q[..., 2, :] & 0xF) << 4,
            q[..., 1, :] & 0xF | (q[..., 3, :] & 0xF) << 4,
        ],
        axis=-1,
    )  # [.., half, 64]
    qh = (
        (q[..., 0, :] >> 4)
        | (q[..., 1, :] >> 4) << 2
        | (q[..., 2, :] >> 4) << 4
        | (q[..., 3, :] >> 4) << 6
    )
    blocks = np.concatenate(
        [
            ql.reshape(*d.shape, 128),
            qh.reshape(*d.shape, 64),
            sc.astype(np.int8).view(np.uint8),
            _f16_bytes(d),
        ],
        axis=-1,
    )
    return blocks.reshape(rows, -1)


def add_vocab(w: gguf.GGUFWriter, size: int) -> None:
    """A placeholder SentencePiece vocabulary (unk, bos, eos, 256 byte tokens, then "t<i>"): no
    real tokenizer, but llama.cpp's loader (llama-bench, the yardstick) requires one."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [f"t{i}" for i in range(size - len(tokens))]
    types = [2, 3, 3, *([6] * 256)] + [1] * (size - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens[:size])
    w.add_token_scores([0.0] * size)
    w.add_token_types(types[:size])


def write_synthetic_gguf(
    path: str | Path, shapes: Shapes = Shapes(), qtype: str = "Q4_1", seed: int = 0
) -> Path:
    """Write the file; 2-D weights as `qtype`, norms as F32. Returns the path."""
    path = Path(path)
    gq = QTYPES[qtype]
    block, type_size = gguf.GGML_QUANT_SIZES[gq]
    s = shapes
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"synthetic-llama-{s.hidden}x{s.layers}-{qtype}")
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.intermediate)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(s.rms_eps)
    w.add_vocab_size(s.vocab)
    w.add_file_type(FILE_TYPES[qtype])
    add_vocab(w, s.vocab)
    plan = tensor_plan(s)
    for name, shape in plan:
        if len(shape) == 1:
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
        else:
            if shape[-1] % block:
                raise ValueError(f"{name}: {shape[-1]} columns are not a multiple of {block}")
            row_bytes = shape[-1] // block * type_size
            w.add_tensor_info(
                name, (shape[0], row_bytes), np.dtype(np.uint8), shape[0] * row_bytes, raw_dtype=gq
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape in plan:
        if len(shape) == 1:
            w.write_tensor_data(synthetic_tensor(name, shape, seed))
        else:
            w.write_tensor_data(_quantized(name, shape, gq, seed))
    w.close()
    return path


def l8b_file(folder: str | Path, layers: int) -> Path:
    """folder/l8b-LAYERS.Q4_K.gguf: LAYERS Llama-3-8B-shaped Q4_K blocks, written the first
    time only (a benchmark's later runs reuse it)."""
    path = Path(folder) / f"l8b-{layers}.Q4_K.gguf"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        write_synthetic_gguf(path, Shapes(layers=layers), "Q4_K")
    return path


def _add_field(w: gguf.GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value[0], bool):  # gguf's add_array stores bools as ints
        w.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL)
    else:
        w.add_array(key, list(value))


def _plan_tensor(name: str, shape: tuple[int, ...], qtype: str, seed: int, memo: dict):
    """A plan tensor's data; matrices (3-D: stacked experts, as [experts * rows, columns])
    quantized. Generated once per name with its block number left out and kept in `memo`:
    every layer of a benchmark file holds the same random values, which cost nothing in speed
    and save minutes of writing expert-sized layers."""
    key = (re.sub(r"^blk\.\d+\.", "blk.*.", name), shape, qtype)
    if key not in memo:
        if qtype == "F32":
            memo[key] = synthetic_rows(key[0], shape, seed, 0, shape[0]).reshape(shape)
        else:
            flat = (int(np.prod(shape[:-1])), shape[-1])
            q = _quantized(key[0], flat, gguf.GGMLQuantizationType[qtype], seed)
            memo[key] = q.reshape(*shape[:-1], q.shape[-1])
    return memo[key]


def write_plan(
    path: str | Path, plan, seed: int = 0, memo: dict | None = None, qtype: str | None = None
) -> Path:
    """Write a family's plan (scripts/bench/family_plans.py: architecture, metadata keys
    without the "{arch}." prefix, tensors with their types; `qtype`, where given, for every
    matrix instead of the plan's). `memo` keeps generated tensors between files of one family
    (see _plan_tensor)."""
    path, memo = Path(path), {} if memo is None else memo
    tensors = [(n, s, t if t == "F32" or qtype is None else qtype) for n, s, t in plan.tensors]
    w = gguf.GGUFWriter(str(path), plan.arch)
    w.add_name(plan.name)
    for key, value in plan.fields.items():
        _add_field(w, key if key.startswith("general.") else f"{plan.arch}.{key}", value)
    add_vocab(w, plan.vocab)
    for name, shape, kind in tensors:
        if kind == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
            continue
        gq = gguf.GGMLQuantizationType[kind]
        block, type_size = gguf.GGML_QUANT_SIZES[gq]
        if shape[-1] % block:
            raise ValueError(f"{name}: {shape[-1]} columns are not a multiple of {block}")
        raw = (*shape[:-1], shape[-1] // block * type_size)
        w.add_tensor_info(name, raw, np.dtype(np.uint8), int(np.prod(raw)), raw_dtype=gq)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, kind in tensors:
        w.write_tensor_data(_plan_tensor(name, shape, kind, seed, memo))
    w.close()
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--qtype", choices=sorted(QTYPES), default="Q4_1")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    path = write_synthetic_gguf(a.out, Shapes(layers=a.layers, vocab=a.vocab), a.qtype, a.seed)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
