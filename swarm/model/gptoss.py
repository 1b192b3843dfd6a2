"""gpt-oss's fields (transformers `gpt_oss`, llama.cpp architecture `gpt-oss`): attention sinks,
a router with a bias whose softmax runs over the chosen experts' logits only, and experts with
biases and a clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 * gate), gate and up clamped at
the limit). Sliding and full layers alternate (config.json's layer_types; llama.cpp: every
second layer full), and YaRN turns the RoPE (rope_scaling.py).

Checked against transformers' modeling_gpt_oss.py / configuration_gpt_oss.py (5.24) and
gguf-py's GPT_OSS tensor table. config.json keeps each layer's experts stacked, gate and up
interleaved in one tensor (experts.py takes them apart); GGUF keeps them apart, 3-D. The
released config.json folders keep the experts in MXFP4 (`quantization_config`, `*_blocks` and
`*_scales`): `ggml_mxfp4` repacks them into GGUF's MXFP4 blocks as llama.cpp's converter does.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

# config.json names that carry no ".weight" ending
OWN_ENDINGS = (".sinks", "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "_blocks", "_scales")
LIMIT, ALPHA = 7.0, 1.702  # GptOssConfig's swiglu_limit and swiglu_alpha; llama.cpp's too


def expert_names(gguf: bool, mxfp4: bool = False) -> dict[str, str]:
    """A gpt-oss layer's router and experts: blocks.py's name -> the file's (biases named;
    `mxfp4`: config.json's experts as MXFP4 codes and exponents)."""
    if gguf:
        out = {"router": "ffn_gate_inp", "router.bias": "ffn_gate_inp.bias"}
        for p in ("gate", "up", "down"):
            out |= {f"experts.{p}": f"ffn_{p}_exps", f"experts.{p}.bias": f"ffn_{p}_exps.bias"}
        return out
    out = {"router": "mlp.router", "router.bias": "mlp.router.bias"}
    for p in ("gate_up", "down"):
        if mxfp4:
            out |= {f"experts.{p}.{t}": f"mlp.experts.{p}_proj_{t}" for t in ("blocks", "scales")}
        else:
            out |= {f"experts.{p}": f"mlp.experts.{p}_proj"}
        out |= {f"experts.{p}.bias": f"mlp.experts.{p}_proj_bias"}
    return out


def ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """config.json's MXFP4 rows, codes [rows, n, 16] (two a byte, the even element's in the low
    nibble) and exponents [rows, n], as GGUF's MXFP4 blocks: uint8 [rows, n * 17], each the
    exponent, then elements 0-15 in the low nibbles and 16-31 in the high ones (llama.cpp's
    converter's repack_mxfp4)."""
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], qs], axis=-1).reshape(blocks.shape[0], -1)


def hf_fields(family, cfg: dict, where: str) -> dict:
    """The config.json fields of a gpt-oss (none for another family)."""
    if not family.sinks:
        return {}
    quant = cfg.get("quantization_config")
    method = (quant.get("quant_method", "?") if isinstance(quant, dict) else quant) or None
    if method not in (None, "mxfp4"):
        raise ValueError(
            f"{where}: experts quantized as {method!r} in config.json's format are not read;"
            " serve its GGUF or a dequantized (bfloat16) folder"
        )
    limit, alpha = float(cfg.get("swiglu_limit", LIMIT)), float(cfg.get("swiglu_alpha", ALPHA))
    fields = dict(sinks=True, router="topk_softmax", swiglu_limit=limit, swiglu_alpha=alpha)
    return fields | dict(mxfp4_experts=method == "mxfp4")


def gguf_fields(family, field, arch: str, rope) -> dict:
    """A gpt-oss GGUF's fields (none for another family): llama.cpp stores no swiglu limit or
    alpha (its code fixes gpt-oss's 7.0 and 1.702), and its router is gpt-oss's. Nor does it
    store YaRN's `truncate`: gpt-oss's YaRN leaves the ramp's ends unrounded (every released
    config.json, and OpenAI's reference code), which `rope` (the file's YaRN as other families'
    are read, rounded as ggml always rounds) is given back; llama.cpp computes it rounded."""
    if not family.sinks:
        return {}
    out = dict(sinks=True, router="topk_softmax", swiglu_limit=LIMIT, swiglu_alpha=ALPHA)
    if rope.yarn is not None:
        out["rope"] = replace(rope, yarn=replace(rope.yarn, truncate=False))
    return out
