"""A mixture of experts' fields of a ModelConfig, from a config.json (transformers' names and
defaults) or from GGUF metadata (llama.cpp's), `topk_norm` the family's default for each."""

from __future__ import annotations


def hf_experts(cfg: dict, topk_norm: bool) -> dict:
    """A mixture's fields from config.json (transformers' names and defaults)."""
    layers, step = cfg["num_hidden_layers"], cfg.get("decoder_sparse_step", 1)
    only = set(cfg.get("mlp_only_layers") or ())
    return dict(
        experts=cfg.get("num_local_experts") or cfg["num_experts"],
        experts_used=cfg["num_experts_per_tok"],
        expert_intermediate=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
        shared_intermediate=cfg.get("shared_expert_intermediate_size") or 0,
        topk_norm=bool(cfg.get("norm_topk_prob", topk_norm)),
        dense_layers=tuple(i for i in range(layers) if i in only or (i + 1) % step),
    )


def gguf_experts(field, arch: str, tensors, layers: int, topk_norm: bool) -> dict:
    """A mixture's fields from GGUF metadata; which layers are dense from their tensors."""
    width = field(f"{arch}.expert_feed_forward_length", None)
    shared = 0
    if "blk.0.ffn_up_shexp.weight" in tensors:
        shared = int(field(f"{arch}.expert_shared_feed_forward_length"))
    routed = {i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors}
    return dict(
        experts=int(field(f"{arch}.expert_count")),
        experts_used=int(field(f"{arch}.expert_used_count")),
        expert_intermediate=int(width or field(f"{arch}.feed_forward_length")),
        shared_intermediate=shared,
        topk_norm=bool(field(f"{arch}.expert_weights_norm", topk_norm)),
        dense_layers=tuple(i for i in range(layers) if i not in routed),
    )
