"""gpt-oss's fields (transformers `gpt_oss`, llama.cpp architecture `gpt-oss`): attention sinks,
a router with a bias whose softmax runs over the chosen experts' logits only, and experts with
biases and a clamped SwiGLU ((up + 1) * gate * sigmoid(1.702 * gate), gate and up clamped at
the limit). Sliding and full layers alternate (config.json's layer_types; llama.cpp: every
second layer full), and YaRN turns the RoPE (rope_scaling.py).

Checked against transformers' modeling_gpt_oss.py / configuration_gpt_oss.py (5.24) and
gguf-py's GPT_OSS tensor table. config.json keeps each layer's experts stacked, gate and up
interleaved in one tensor (experts.py takes them apart); GGUF keeps them apart, 3-D.
"""

from __future__ import annotations

# config.json names that carry no ".weight" ending
OWN_ENDINGS = (".sinks", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")
LIMIT, ALPHA = 7.0, 1.702  # GptOssConfig's swiglu_limit and swiglu_alpha; llama.cpp's too


def expert_names(gguf: bool) -> dict[str, str]:
    """A gpt-oss layer's router and experts: blocks.py's name -> the file's (biases named)."""
    if gguf:
        out = {"router": "ffn_gate_inp", "router.bias": "ffn_gate_inp.bias"}
        for p in ("gate", "up", "down"):
            out |= {f"experts.{p}": f"ffn_{p}_exps", f"experts.{p}.bias": f"ffn_{p}_exps.bias"}
        return out
    out = {"router": "mlp.router", "router.bias": "mlp.router.bias"}
    for p in ("gate_up", "down"):
        out |= {f"experts.{p}": f"mlp.experts.{p}_proj"}
        out |= {f"experts.{p}.bias": f"mlp.experts.{p}_proj_bias"}
    return out


def hf_fields(family, cfg: dict, where: str) -> dict:
    """The config.json fields of a gpt-oss (none for another family)."""
    if not family.sinks:
        return {}
    if quant := cfg.get("quantization_config"):
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ValueError(
            f"{where}: experts quantized as {method!r} in config.json's format are not read;"
            " serve its GGUF or a dequantized (bfloat16) folder"
        )
    limit, alpha = float(cfg.get("swiglu_limit", LIMIT)), float(cfg.get("swiglu_alpha", ALPHA))
    return dict(sinks=True, router="topk_softmax", swiglu_limit=limit, swiglu_alpha=alpha)


def gguf_fields(family, field, arch: str) -> dict:
    """A gpt-oss GGUF's fields (none for another family): llama.cpp stores no swiglu limit or
    alpha (its code fixes gpt-oss's 7.0 and 1.702), and its router is gpt-oss's."""
    if not family.sinks:
        return {}
    return dict(sinks=True, router="topk_softmax", swiglu_limit=LIMIT, swiglu_alpha=ALPHA)
