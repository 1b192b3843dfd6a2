"""Convert a small Hugging Face checkpoint to GGUF as llama.cpp's convert_hf_to_gguf.py does.

For test fixtures: the tiny models of swarm.model.tiny, and any checkpoint of the same families
small enough to hold in memory. The per-family conventions are data in gguf_tables.py; this file
applies them. A checkpoint llama.cpp would convert into a different model (a layer pattern or an
attention scale it does not store, a RoPE scaling this does not write) is refused, not converted.

One deliberate difference: llama.cpp drops Mistral's and Mixtral's sliding window (it converts
them as Llamas and computes them without one); this keeps it as `llama.attention.sliding_window`,
so the file describes the model transformers computes.

Mixture-of-experts checkpoints hold one tensor per expert; the file stacks each block's experts
into 3-D tensors (`blk.N.ffn_{gate,up,down}_exps`, [expert, rows, columns], quantized row by row
as any matrix) and keeps the router (`ffn_gate_inp`) F32. `--qtype MXFP4` writes llama.cpp's
MXFP4_MOE: the experts' matrices MXFP4 (gguf-py's quantizer), all else F32.

Usage: python -m devtools.hf_to_gguf HF_DIR OUT.gguf [--qtype F32|F16|BF16|Q8_0|MXFP4]
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import gguf
import numpy as np

from devtools import gguf_gemma4, gguf_gptoss, gguf_qwen35
from devtools.gguf_latent import latent_fields, latent_unwritten, split_kv_b
from devtools.gguf_tables import (
    ALWAYS_F32,
    FAMILIES,
    GEMMA2_ROPE_THETA,
    GEMMA3_LOCAL_ROPE_THETA,
    GEMMA_SWA_PATTERN,
    HF_ARCHITECTURES,
    Family,
    expert_slot,
    gguf_name,
)
from swarm.model.tiny import gemma_layer_types

QTYPES = {
    "F32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "F16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "BF16": (gguf.GGMLQuantizationType.BF16, gguf.LlamaFileType.MOSTLY_BF16),
    "Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "MXFP4": (gguf.GGMLQuantizationType.MXFP4, gguf.LlamaFileType.MOSTLY_MXFP4_MOE),
}
_K = gguf.Keys
YARN_FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "gpt_oss",
)  # whose YaRN llama.cpp's converter writes as keys


class UnsupportedCheckpoint(ValueError):
    """The checkpoint has a feature the GGUF file would not carry: converting it would make
    a file of a different model."""


def write_gguf(hf_dir: str | os.PathLike, out_path: str | os.PathLike, qtype: str = "F32") -> Path:
    """Write the Hugging Face folder `hf_dir` as the GGUF file `out_path`; returns its path.
    2-D weights are stored as `qtype`; 1-D tensors and norms stay F32, as llama.cpp keeps them."""
    if qtype not in QTYPES:
        raise ValueError(f"qtype {qtype!r}: one of {', '.join(QTYPES)}")
    hf_dir, out_path = Path(hf_dir), Path(out_path)
    config = hf_config(hf_dir)
    name = family_of(config)
    family = FAMILIES[name]
    check_convertible(name, config)
    writer = gguf.GGUFWriter(str(out_path), family.arch)
    writer.add_type(gguf.GGUFType.MODEL)
    # llama.cpp's name when the folder has no model card (transformers, given a "llama" file
    # named exactly "mistral", looks for an arch gguf-py lacks, and fails to load it)
    writer.add_name(hf_dir.name)
    writer.add_file_type(QTYPES[qtype][1])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value in {**family_fields(name, config), **tokenizer_fields(hf_dir, config)}.items():
        _add_field(writer, key, value)
    for tensor_name, array in gguf_tensors(family, config, _state_dict(hf_dir)):
        data, kind = encode(tensor_name, array, qtype)
        writer.add_tensor(tensor_name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def hf_config(hf_dir: Path) -> dict:
    """The folder's config with every default filled in, as llama.cpp's converter reads it."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(hf_dir).to_dict()


def family_of(config: dict) -> str:
    arch = (config.get("architectures") or ["?"])[0]
    if arch not in HF_ARCHITECTURES:
        raise UnsupportedCheckpoint(f"architecture {arch}: one of {', '.join(HF_ARCHITECTURES)}")
    return HF_ARCHITECTURES[arch]


def _rope(config: dict, layer_type: str = "full_attention") -> dict:
    rope = config.get("rope_parameters") or {}
    return rope.get(layer_type, rope)


def check_convertible(name: str, config: dict) -> None:
    """UnsupportedCheckpoint if llama.cpp's file would describe another model than `config`."""
    if FAMILIES[name].latent:
        if unwritten := latent_unwritten(config):
            raise UnsupportedCheckpoint(f"{name}: {', '.join(unwritten)}: llama.cpp writes none")
        return
    if FAMILIES[name].gemma4:
        try:
            return gguf_gemma4.check(config)
        except gguf_gemma4.GemmaUnconvertible as exc:
            raise UnsupportedCheckpoint(f"{name}: {exc}") from exc
    if FAMILIES[name].delta:
        try:
            gguf_qwen35.interval(config)
        except gguf_qwen35.QwenUnconvertible as exc:
            raise UnsupportedCheckpoint(f"{name}: {exc}") from exc
    if FAMILIES[name].sinks:
        try:
            gguf_gptoss.check(config)
        except gguf_gptoss.GptOssUnconvertible as exc:
            raise UnsupportedCheckpoint(f"{name}: {exc}") from exc
    rope_type = _rope(config).get("rope_type", "default")
    allowed = {"default", "llama3"} if name == "llama" else {"default"}
    if rope_type not in allowed | ({"yarn"} if name in YARN_FAMILIES else set()):
        raise UnsupportedCheckpoint(f"{name}: RoPE scaling {rope_type!r} is not written")
    if rope_type == "yarn":
        check_yarn_convertible(name, _rope(config))
    layers, types = config["num_hidden_layers"], config.get("layer_types")
    if name in ("qwen2", "qwen3") and types and "sliding_attention" in types:
        raise UnsupportedCheckpoint(f"{name}: llama.cpp has no sliding window for it")
    if name in GEMMA_SWA_PATTERN:
        n = GEMMA_SWA_PATTERN[name]
        if types != gemma_layer_types(layers, n):
            raise UnsupportedCheckpoint(f"{name}: llama.cpp assumes every {n}th layer is full")
        if config["query_pre_attn_scalar"] != config["head_dim"]:
            raise UnsupportedCheckpoint(f"{name}: llama.cpp scales scores by 1/sqrt(head_dim)")
        if not config.get("tie_word_embeddings", True):
            raise UnsupportedCheckpoint(f"{name}: llama.cpp drops an untied lm_head")
    if name == "gemma2" and _rope(config)["rope_theta"] != GEMMA2_ROPE_THETA:
        raise UnsupportedCheckpoint("gemma2: llama.cpp assumes a RoPE base of 10000")
    if name == "gemma3":
        if _rope(config, "sliding_attention").get("rope_theta") != GEMMA3_LOCAL_ROPE_THETA:
            raise UnsupportedCheckpoint("gemma3: llama.cpp fixes the local RoPE base at 10000")
        if config.get("attn_logit_softcapping") is not None:
            raise UnsupportedCheckpoint("gemma3: llama.cpp has no attention softcap for it")
    if FAMILIES[name].experts is not None:
        check_experts_convertible(name, config)


def check_yarn_convertible(name: str, rope: dict) -> None:
    """What llama.cpp's converter writes no key for: a factor left to be derived, the ramp's
    ends unrounded (but gpt-oss's, which swarm reads so: gguf_gptoss), DeepSeek's mscale pair."""
    unwritten = [k for k in ("mscale", "mscale_all_dim") if rope.get(k)]
    unwritten += ["truncate"] if rope.get("truncate", True) is False and name != "gpt_oss" else []
    unwritten += ["factor"] if rope.get("factor") is None else []
    if unwritten:
        raise UnsupportedCheckpoint(f"{name}: YaRN's {', '.join(unwritten)} is not written")


def check_experts_convertible(name: str, config: dict) -> None:
    """The mixture-of-experts switches llama.cpp fixes per architecture, stores no key for, or
    cannot convert: Qwen's top-k renormalisation (on for Qwen3-MoE, off for Qwen2-MoE), a
    layer with a dense MLP, a sliding window."""
    family = FAMILIES[name]
    if name == "mixtral":
        return  # Mixtral always renormalises, has no dense layers; its window: see above
    top_k_norm = config.get("norm_topk_prob", name == "qwen3_5_moe")  # Qwen3.5's always does
    if bool(top_k_norm) != family.renormalises:
        said = "renormalises" if family.renormalises else "does not renormalise"
        raise UnsupportedCheckpoint(f"{name}: llama.cpp {said} the top-k router weights")
    step, dense = config.get("decoder_sparse_step") or 1, config.get("mlp_only_layers") or []
    if dense or step != 1:
        raise UnsupportedCheckpoint(
            f"{name}: a layer with a dense MLP (mlp_only_layers {dense}, decoder_sparse_step "
            f"{step}): llama.cpp has no tensor name for it, and routes every layer"
        )
    types = config.get("layer_types") or []
    if config.get("sliding_window") and (name == "qwen3_moe" or "sliding_attention" in types):
        raise UnsupportedCheckpoint(f"{name}: llama.cpp has no sliding window for it")


def family_fields(name: str, config: dict) -> dict[str, int | float]:
    """The `{arch}.*` keys llama.cpp writes for this family, with their values."""
    family = FAMILIES[name]
    keys = lambda key: key.format(arch=family.arch)  # noqa: E731
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    fields = {
        _K.LLM.CONTEXT_LENGTH: config["max_position_embeddings"],
        _K.LLM.EMBEDDING_LENGTH: hidden,
        _K.LLM.FEED_FORWARD_LENGTH: config["intermediate_size"],
        _K.LLM.BLOCK_COUNT: config["num_hidden_layers"],
        _K.Attention.HEAD_COUNT: heads,
        _K.Attention.HEAD_COUNT_KV: config.get("num_key_value_heads") or heads,
        _K.Attention.LAYERNORM_RMS_EPS: float(config["rms_norm_eps"]),
    }
    wanted = family.fields
    if name != "gemma2":  # llama.cpp writes none for Gemma 2, and assumes 10000
        fields[_K.Rope.FREQ_BASE] = float(_rope(config)["rope_theta"])
    if "head_dim" in wanted and config.get("head_dim") is not None:
        fields |= {_K.Attention.KEY_LENGTH: head_dim, _K.Attention.VALUE_LENGTH: head_dim}
    if "rope_dims" in wanted:
        fraction = _rope(config).get("partial_rotary_factor", 1.0)
        fields[_K.Rope.DIMENSION_COUNT] = (
            head_dim if name != "phi3" else int(fraction * hidden) // heads
        )
    if "vocab_size" in wanted:
        fields[_K.LLM.VOCAB_SIZE] = config["vocab_size"]
    if "sliding_window" in wanted and (config.get("sliding_window") or name == "phi3"):
        fields[_K.Attention.SLIDING_WINDOW] = config.get("sliding_window") or 0
    if "softcaps" in wanted and config.get("attn_logit_softcapping") is not None:
        fields[_K.LLM.ATTN_LOGIT_SOFTCAPPING] = float(config["attn_logit_softcapping"])
    if {"softcaps", "final_softcap"} & wanted and config.get("final_logit_softcapping"):
        fields[_K.LLM.FINAL_LOGIT_SOFTCAPPING] = float(config["final_logit_softcapping"])
    if "rope_swa" in wanted:
        fields[_K.Rope.FREQ_BASE_SWA] = float(_rope(config, "sliding_attention")["rope_theta"])
    if _rope(config).get("rope_type") == "yarn":
        fields |= yarn_fields(_rope(config))
    if "rope_orig_ctx" in wanted:
        fields[_K.Rope.SCALING_ORIG_CTX_LEN] = config["original_max_position_embeddings"]
    fields |= latent_fields(config) if family.latent else expert_fields(name, config)
    fields |= gguf_qwen35.fields(config) if family.delta else {}
    fields |= gguf_gptoss.fields(config) if family.sinks else {}
    fields |= gguf_gemma4.fields(config) if family.gemma4 else {}
    return {keys(key): value for key, value in fields.items()}


def yarn_fields(rope: dict) -> dict[str, str | float | int]:
    """The YaRN keys llama.cpp's converter writes (its base TextModel): those the config sets."""
    fields = {
        _K.Rope.SCALING_TYPE: gguf.RopeScalingType.YARN.value,
        _K.Rope.SCALING_FACTOR: float(rope["factor"]),
        _K.Rope.SCALING_ORIG_CTX_LEN: int(rope["original_max_position_embeddings"]),
    }
    optional = {
        "extrapolation_factor": _K.Rope.SCALING_YARN_EXT_FACTOR,
        "attention_factor": _K.Rope.SCALING_YARN_ATTN_FACTOR,
        "beta_fast": _K.Rope.SCALING_YARN_BETA_FAST,
        "beta_slow": _K.Rope.SCALING_YARN_BETA_SLOW,
    }
    return fields | {key: float(rope[k]) for k, key in optional.items() if rope.get(k) is not None}


def expert_fields(name: str, config: dict) -> dict[str, int]:
    """The expert keys llama.cpp writes: the counts for any checkpoint that has experts, and
    Qwen's expert widths (Mixtral's experts are `feed_forward_length` wide). None says whether
    the top-k weights are renormalised: llama.cpp fixes that per architecture."""
    experts = _find(config, "num_local_experts", "num_experts")
    if experts is None:
        return {}
    fields = {_K.LLM.EXPERT_COUNT: experts}
    if (used := config.get("num_experts_per_tok")) is not None:
        fields[_K.LLM.EXPERT_USED_COUNT] = used
    if "expert_widths" in FAMILIES[name].fields:
        for key, field in (
            (_K.LLM.EXPERT_FEED_FORWARD_LENGTH, "moe_intermediate_size"),
            (_K.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, "shared_expert_intermediate_size"),
        ):
            if config.get(field) is not None:
                fields[key] = config[field]
    return fields


def _find(config: dict, *names: str):
    """The first of `names` the config has, as llama.cpp's find_hparam reads it."""
    return next((config[n] for n in names if n in config), None)


def tokenizer_fields(hf_dir: Path, config: dict) -> dict[str, object]:
    """A minimal `tokenizer.ggml.*`: the vocabulary (the folder's tokenizer.json if it has
    one, placeholders if not; transformers sizes the model by it) and the special ids."""
    vocab = config["vocab_size"]
    tokens = [f"[PAD{i}]" for i in range(vocab)]
    types = [gguf.TokenType.UNUSED] * vocab
    path = hf_dir / "tokenizer.json"
    if path.is_file():
        spec = json.loads(path.read_text())
        entries = [(i, t, gguf.TokenType.NORMAL) for t, i in spec["model"]["vocab"].items()]
        entries += [(a["id"], a["content"], gguf.TokenType.CONTROL) for a in spec["added_tokens"]]
        for i, token, kind in entries:
            tokens[i], types[i] = token, kind
    fields: dict[str, object] = {
        _K.Tokenizer.MODEL: "llama",
        _K.Tokenizer.LIST: tokens,
        _K.Tokenizer.SCORES: [0.0] * vocab,
        _K.Tokenizer.TOKEN_TYPE: [int(t) for t in types],
    }
    ids = {"bos_token_id": _K.Tokenizer.BOS_ID, "eos_token_id": _K.Tokenizer.EOS_ID}
    ids["pad_token_id"] = _K.Tokenizer.PAD_ID
    for field, key in ids.items():
        value = config.get(field)
        if isinstance(value, list):  # several eos ids: GGUF keeps one
            value = value[0]
        if value is not None:
            fields[key] = int(value)
    return fields


def _add_field(writer: gguf.GGUFWriter, key: str, value) -> None:
    """Ints as uint32, floats as float32, as llama.cpp writes these keys; lists as arrays of
    their items' type (int32 token types, float32 scores, strings)."""
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    else:
        writer.add_array(key, value)


def _state_dict(hf_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file

    state = {}
    for part in sorted(hf_dir.glob("model*.safetensors")):
        state |= {k: v.float().numpy() for k, v in load_file(part).items()}
    if not state:
        raise FileNotFoundError(f"{hf_dir}: no model*.safetensors")
    return state


def gguf_tensors(family: Family, config: dict, state: dict[str, np.ndarray]):
    """(GGUF name, float32 array) for every tensor of the file, in the checkpoint's order, then
    the ones llama.cpp derives from the config (Llama 3's rope_freqs)."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    experts: dict[int, dict[tuple[int, str], np.ndarray]] = {}  # block -> its experts read so far
    for hf_name, array in state.items():
        if family.must_tie and hf_name == "lm_head.weight":
            continue
        if (slot := expert_slot(family, hf_name)) is not None:
            yield from stack_experts(family, config, experts, slot, array)
            continue
        if family.latent and _block_of(hf_name) >= config["num_hidden_layers"]:
            continue  # multi-token prediction: llama.cpp's converter skips it
        if family.latent and hf_name.endswith("self_attn.kv_b_proj.weight"):
            block = hf_name.split(".")[2]
            k_b, v_b = split_kv_b(array, config)
            yield f"blk.{block}.attn_k_b.weight", k_b
            yield f"blk.{block}.attn_v_b.weight", v_b
            continue
        if family.delta:
            hf_name, array = gguf_qwen35.tensor(hf_name, array, config)
        if family.sinks and (split := gguf_gptoss.tensors(hf_name, array)) is not None:
            yield from ((n, np.ascontiguousarray(a, dtype=np.float32)) for n, a in split)
            continue
        hf_name = gguf_gemma4.rename(hf_name) if family.gemma4 else hf_name
        name = gguf_name(family, hf_name)
        if family.permute_qk and ".attn_q." in name:
            array = interleave_rope_rows(array, heads)
        elif family.permute_qk and ".attn_k." in name:
            array = interleave_rope_rows(array, kv_heads)
        if family.norm_plus_one and hf_name.endswith("norm.weight"):
            array = array + np.float32(1.0)
        yield name, np.ascontiguousarray(array, dtype=np.float32)
    if "llama3_rope" in family.fields and _rope(config).get("rope_type") == "llama3":
        yield "rope_freqs.weight", llama3_rope_factors(config)
    if family.gemma4:
        yield "rope_freqs.weight", gguf_gemma4.rope_freqs(config)
    if any(experts.values()):
        left = {f"block {b} expert {x} {w}" for b, d in experts.items() for x, w in d}
        raise UnsupportedCheckpoint(f"experts without the rest of their block: {sorted(left)[:4]}")


def _block_of(hf_name: str) -> int:
    """The block of a `model.layers.N.` tensor, -1 for the others."""
    parts = hf_name.split(".")
    return int(parts[2]) if hf_name.startswith("model.layers.") else -1


def stack_experts(family: Family, config: dict, read: dict, slot: tuple, array: np.ndarray):
    """Keep one expert tensor; once its block has all of them, yield the block's 3-D tensors
    ([expert, rows, columns]) as llama.cpp does, and forget them."""
    block, expert, w = slot
    count = _find(config, "num_local_experts", "num_experts", "n_routed_experts")
    if expert >= count:
        raise UnsupportedCheckpoint(f"block {block}: expert {expert} of {count}")
    have = read.setdefault(block, {})
    have[expert, w] = array
    if len(have) < count * len(family.experts.stacked):
        return
    for w, name in family.experts.stacked:
        stacked = np.stack([have.pop((x, w)) for x in range(count)])
        yield f"blk.{block}.{name}.weight", np.ascontiguousarray(stacked, dtype=np.float32)


def interleave_rope_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """A q or k projection's rows (or bias) as llama.cpp's Llama stores them: within each head,
    Hugging Face's rotated halves [x0..x(d/2-1) | y0..y(d/2-1)] become pairs x0 y0 x1 y1 ..."""
    half = rows.shape[0] // heads // 2
    split = rows.reshape(heads, 2, half, *rows.shape[1:])  # [head, half-index, row, ...]
    return split.swapaxes(1, 2).reshape(rows.shape)


def llama3_rope_factors(config: dict) -> np.ndarray:
    """rope_freqs.weight: what llama.cpp divides each RoPE frequency by under Llama 3.1's
    scaling (1 for short wavelengths, `factor` for long ones, a blend between)."""
    rope = _rope(config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    freqs = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    factors = []
    for wavelength in 2 * math.pi / freqs:
        if wavelength < context / high:
            factors.append(1.0)
        elif wavelength > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def encode(
    name: str, array: np.ndarray, qtype: str
) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """The tensor's bytes in the file: F32 for 1-D tensors, norms, routers and anything not a
    `.weight` (gpt-oss's 2-D expert biases), `qtype` for the rest (a 3-D tensor of experts too:
    its rows are quantized as any matrix's), F16 where the rows do not split into its blocks."""
    kind = QTYPES[qtype][0]
    f32 = name.endswith("_norm.weight") or not name.endswith(".weight")
    f32 |= qtype == "MXFP4" and "_exps." not in name
    if array.ndim <= 1 or f32 or name.split(".")[-2] in ALWAYS_F32:
        kind = gguf.GGMLQuantizationType.F32
    try:
        return gguf.quants.quantize(array, kind), kind
    except gguf.QuantError:  # rows not a whole number of blocks: F16, as llama.cpp falls back
        kind = gguf.GGMLQuantizationType.F16
        return gguf.quants.quantize(array, kind), kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf_dir")
    parser.add_argument("out")
    parser.add_argument("--qtype", default="F32", choices=sorted(QTYPES))
    args = parser.parse_args()
    print(write_gguf(args.hf_dir, args.out, args.qtype))


if __name__ == "__main__":
    main()
