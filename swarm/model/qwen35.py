"""Qwen3.5's fields (transformers `qwen3_5_text`, `qwen3_5_moe_text`, and the text model of a
multimodal `qwen3_5` / `qwen3_5_moe` folder): which layers are Gated DeltaNet (swarm.model.
deltanet) and their shape, their tensors' names, and the gate its full-attention layers' q_proj
also makes (attention's output times sigmoid(gate), before o_proj). Its RMSNorms compute
x * (1 + w), as Gemma's; q/k norms; a quarter of each head turned by RoPE (its multimodal RoPE
is plain RoPE for text: every section sees the same position). The MoE's router renormalises
its top k, and a shared expert sits behind a sigmoid gate (Qwen2-MoE's names).

Checked against transformers' modeling_qwen3_5.py / modular_qwen3_5.py and their MoE twins (5.24),
and llama.cpp's converter (its conversion package's qwen.py) for GGUF files (qwen35 / qwen35moe):
its keys, A_log held as -exp(A_log), value heads tiled (v0 of every q/k head, then v1 ...) where
config.json groups them by q/k head. Refused by name: attention biases, other layer types. The
vision tower of a multimodal folder is skipped, as its multi-token-prediction weights (`mtp.*`,
outside the decoder's layers; a GGUF's nextn layers) are.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from swarm.model.config import Delta, ModelConfig
from swarm.model.weights import RawTensor

log = logging.getLogger("swarm.model")

# a linear-attention layer's tensors: blocks.py's name -> (config.json name, GGUF name)
NAMES = {
    "in_qkv": ("linear_attn.in_proj_qkv", "attn_qkv"),
    "in_z": ("linear_attn.in_proj_z", "attn_gate"),
    "in_b": ("linear_attn.in_proj_b", "ssm_beta"),
    "in_a": ("linear_attn.in_proj_a", "ssm_alpha"),
    "conv": ("linear_attn.conv1d", "ssm_conv1d"),
    "A_log": ("linear_attn.A_log", "ssm_a"),
    "dt_bias": ("linear_attn.dt_bias", "ssm_dt.bias"),
    "gated_rms": ("linear_attn.norm", "ssm_norm"),  # not "...norm": weight used as is, not 1 + w
    "o": ("linear_attn.out_proj", "ssm_out"),
    "mlp_norm": ("post_attention_layernorm", "post_attention_norm"),
}

OWN = ("A_log", "ssm_a")  # names without ".weight": config.json's A_log, GGUF's -exp(A_log)
# a multimodal folder's model_type -> its text model's
MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def text_part(cfg: dict, where: str) -> tuple[dict, str]:
    """A config.json's text model and the prefix of its tensors: a multimodal Qwen3.5 folder's
    text_config (under model.language_model., its vision tower skipped), else the config as
    it is (under model.)."""
    if cfg.get("model_type") not in MULTIMODAL or cfg.get("text_config") is None:
        return cfg, "model."
    text = {"model_type": MULTIMODAL[cfg["model_type"]], **cfg["text_config"]}
    text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", False)
    log.info("%s: the text model only; its vision tower (model.visual) is skipped", where)
    return text, "model.language_model."


def block_tensors(moe: bool) -> tuple[str, ...]:
    """A linear-attention block's tensors (blocks.py's names), a mixture's experts aside."""
    return ("attn_norm", *NAMES, *(() if moe else ("gate", "up", "down")))


def names(c: ModelConfig, layer: int) -> dict[str, tuple[str, str]]:
    """Block `layer`'s names (blocks.py's -> config.json's, GGUF's) that are Qwen3.5's own: a
    linear-attention layer's, and the MLP's norm as llama.cpp names it in every layer."""
    if c.delta is None:
        return {}
    return NAMES if c.is_delta(layer) else {"mlp_norm": NAMES["mlp_norm"]}


def hf_fields(family, cfg: dict, where: str) -> dict:
    """ModelConfig fields of a Qwen3.5 text config (transformers' defaults: every 4th layer
    full attention, the rest linear); none for another family."""
    if not family.delta:
        return {}
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or [
        "linear_attention" if (i + 1) % cfg.get("full_attention_interval", 4) else "full_attention"
        for i in range(layers)
    ]
    if unknown := set(types) - {"linear_attention", "full_attention"}:
        raise ValueError(f"{where}: layer types {sorted(unknown)} are not supported")
    if cfg.get("attention_bias"):
        raise ValueError(f"{where}: attention biases are not supported for {cfg['model_type']}")
    delta = Delta(
        layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        k_heads=int(cfg.get("linear_num_key_heads", 16)),
        v_heads=int(cfg.get("linear_num_value_heads", 32)),
        k_dim=int(cfg.get("linear_key_head_dim", 128)),
        v_dim=int(cfg.get("linear_value_head_dim", 128)),
        kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
    )
    if delta.v_heads % delta.k_heads:
        raise ValueError(f"{where}: {delta.v_heads} value heads for {delta.k_heads} key heads")
    return dict(delta=delta, attn_gate=True)


def gguf_fields(family, field, arch: str, layers: int) -> dict:
    """ModelConfig fields of a qwen35 / qwen35moe GGUF file (the keys llama.cpp's converter
    writes; its value heads tiled, its A_log as -exp(A_log)); none for another family."""
    if not family.delta:
        return {}
    every = int(field(f"{arch}.full_attention_interval", 4))
    v_heads = int(field(f"{arch}.ssm.time_step_rank"))
    delta = Delta(
        layers=tuple(i for i in range(layers) if (i + 1) % every),
        k_heads=int(field(f"{arch}.ssm.group_count")),
        v_heads=v_heads,
        k_dim=int(field(f"{arch}.ssm.state_size")),
        v_dim=int(field(f"{arch}.ssm.inner_size")) // v_heads,
        kernel=int(field(f"{arch}.ssm.conv_kernel")),
        llama_cpp=True,
    )
    mtp = int(field(f"{arch}.nextn_predict_layers", 0))
    if mtp:  # llama.cpp counts them in block_count, after the decoder's own
        delta = replace(delta, layers=tuple(i for i in delta.layers if i < layers - mtp))
    return dict(delta=delta, attn_gate=True, mtp_layers=mtp, num_layers=layers - mtp)


def split_gate(raw, heads: int) -> tuple[RawTensor, ...]:
    """A gated attention's q, k, v and gate matrices: q_proj [heads * 2 * head_dim, hidden]
    holds each head's query rows then its gate rows (any file's rows: torch or GGUF bytes)."""
    q = raw["q"]
    data = q.data.reshape(heads, 2, -1, q.data.shape[-1])
    query, gate = (
        RawTensor(q.name, q.kind, data[:, i].reshape(-1, data.shape[-1])) for i in (0, 1)
    )
    return query, raw["k"], raw["v"], gate
