"""DeepSeek-V3's fields (and Kimi K2's, the same architecture) from a config.json or from the
GGUF keys llama.cpp's converter writes for it (architecture `deepseek2`): latent attention's
shape, its softmax scale under YaRN, and the router (sigmoid scores, a bias for the choice,
grouped top-k, a routed scale, shared experts without a gate, dense first layers).

Checked against transformers' modeling_deepseek_v3.py / configuration_deepseek_v3.py (5.24)
and llama.cpp's DeepseekV2Model converter and its deepseek2 loader and graph. What neither
computes here is refused by name: DeepSeek-V3.2's sparse attention indexer, DeepSeek-V2's
softmax router; multi-token-prediction layers are skipped, as transformers and llama.cpp do.
"""

from __future__ import annotations

import numpy as np

from swarm.model.config import Latent, Rope
from swarm.model.rope_scaling import yarn_mscale

# DeepseekV3Config's defaults, for a config.json that leaves a key out
_HF_DEFAULTS = dict(
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    n_group=8,
    topk_group=4,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    rope_interleave=True,
)
SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def refuse_hf(cfg: dict, where: str) -> None:
    """ValueError for what a DeepSeek config.json carries and nothing here computes."""
    if cfg.get("model_type") == "deepseek_v32" or "index_topk" in cfg:
        raise ValueError(
            f"{where}: DeepSeek-V3.2's sparse attention (its indexer, index_topk) is not supported"
        )


def hf_fields(cfg: dict) -> dict:
    """ModelConfig fields of a deepseek_v3 config.json (transformers' reading and defaults)."""
    get = lambda key: cfg.get(key, _HF_DEFAULTS[key])  # noqa: E731
    latent = Latent(
        q_rank=int(get("q_lora_rank") or 0),
        kv_rank=int(get("kv_lora_rank")),
        nope=int(get("qk_nope_head_dim")),
        rope=int(get("qk_rope_head_dim")),
        v=int(get("v_head_dim")),
        interleaved=bool(get("rope_interleave")),
    )
    layers, experts = cfg["num_hidden_layers"], cfg["n_routed_experts"]
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    scale = (latent.nope + latent.rope) ** -0.5
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind != "default" and params.get("mscale_all_dim"):  # transformers' yarn_apply_mscale
        scale *= yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"])) ** 2
    dense = min(int(get("first_k_dense_replace")), layers)
    return dict(
        latent=latent,
        head_dim=latent.nope + latent.rope,
        rotary_dim=latent.rope,
        attention_scale=scale,
        experts=experts,
        experts_used=cfg["num_experts_per_tok"],
        expert_intermediate=cfg["moe_intermediate_size"],
        shared_intermediate=cfg["moe_intermediate_size"] * int(get("n_shared_experts")),
        shared_gated=False,
        topk_norm=bool(get("norm_topk_prob")),
        router="sigmoid",
        groups=int(get("n_group") or 1),
        groups_used=int(get("topk_group") or 1),
        routed_scale=float(get("routed_scaling_factor")),
        dense_layers=tuple(range(dense)),
        mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
    )


def gguf_fields(field, arch: str, tensors, name: str, rope: Rope, layers: int) -> dict:
    """ModelConfig fields of a deepseek2 GGUF file (llama.cpp's keys and its defaults);
    ValueError naming what llama.cpp computes otherwise than transformers, or not at all."""
    key = f"{arch}.attention."
    if field(f"{key}key_length_mla", None) is None:
        raise ValueError(
            f"{name}: a deepseek2 file without attention.key_length_mla (written before llama.cpp"
            " split attn_kv_b into attn_k_b and attn_v_b): convert it again"
        )
    if indexer := [n for n in tensors if ".indexer." in n]:
        raise ValueError(f"{name}: a sparse attention indexer ({indexer[0]}) is not supported")
    if int(field(f"{arch}.expert_gating_func", 0)) != SIGMOID:
        raise ValueError(f"{name}: softmax routing (DeepSeek-V2's) is not supported yet")
    rot = int(field(f"{arch}.rope.dimension_count"))
    head = int(field(f"{key}key_length_mla"))
    latent = Latent(
        q_rank=int(field(f"{key}q_lora_rank", 0)),
        kv_rank=int(field(f"{key}kv_lora_rank")),
        nope=head - rot,
        rope=rot,
        v=int(field(f"{key}value_length_mla")),
    )
    scale = head**-0.5
    if rope.yarn is not None:
        scale *= yarn_mscale(rope.yarn.factor, _mscale_all_dim(field, arch, name)) ** 2
    width = int(field(f"{arch}.expert_feed_forward_length"))
    return dict(
        latent=latent,
        head_dim=head,
        rotary_dim=rot,
        attention_scale=scale,
        experts=int(field(f"{arch}.expert_count")),
        experts_used=int(field(f"{arch}.expert_used_count")),
        expert_intermediate=width,
        shared_intermediate=width * int(field(f"{arch}.expert_shared_count", 0)),
        shared_gated=False,
        topk_norm=bool(field(f"{arch}.expert_weights_norm", False)),
        router="sigmoid",
        groups=int(field(f"{arch}.expert_group_count", 0) or 1),
        groups_used=int(field(f"{arch}.expert_group_used_count", 0) or 1),
        routed_scale=float(field(f"{arch}.expert_weights_scale", 0.0) or 1.0),
        dense_layers=tuple(range(min(int(field(f"{arch}.leading_dense_block_count", 0)), layers))),
    )


def _mscale_all_dim(field, arch: str, name: str) -> float:
    """transformers' mscale_all_dim from llama.cpp's yarn_log_multiplier, which its converter
    writes as 0.1 x mscale_all_dim and its loader divides back in float32. Without it llama.cpp
    scales cos and sin and the scores both, where transformers scales only cos and sin."""
    log_mul = field(f"{arch}.rope.scaling.yarn_log_multiplier", None)
    if not log_mul:
        raise ValueError(f"{name}: deepseek2 YaRN without rope.scaling.yarn_log_multiplier")
    return float(np.float32(log_mul) / np.float32(0.1))
