"""What llama.cpp's converter (its DeepseekV2Model, and TextModel beneath it) does to a
DeepSeek-V3 checkpoint: the deepseek2 keys it writes, the checkpoints whose file would describe
another model (refused), and kv_b_proj split into attn_k_b and attn_v_b."""

from __future__ import annotations

import gguf
import numpy as np

_K = gguf.Keys
LATENT_NORM_EPS = 1e-6  # transformers norms the latents at this, llama.cpp at rms_norm_eps


def latent_unwritten(config: dict) -> list[str]:
    """What llama.cpp's deepseek2 file would not carry of `config`, or compute otherwise."""
    rope = config.get("rope_parameters") or {}
    kind = rope.get("rope_type", "default")
    unwritten = []
    if kind not in ("default", "yarn"):
        unwritten.append(f"RoPE scaling {kind!r}")
    if kind == "yarn":
        # llama.cpp reads mscale_all_dim (as yarn_log_multiplier) and assumes mscale equal to it
        if not rope.get("mscale_all_dim"):
            unwritten.append("YaRN without mscale_all_dim")
        elif rope.get("mscale") not in (None, rope["mscale_all_dim"]):
            unwritten.append("YaRN's mscale apart from mscale_all_dim")
        if rope.get("factor") is None or rope.get("truncate", True) is False:
            unwritten.append("YaRN's factor left out or truncate off")
    if config.get("scoring_func") != "sigmoid":
        unwritten.append("no scoring_func 'sigmoid' (llama.cpp would route by softmax)")
    if config.get("num_key_value_heads") != config["num_attention_heads"]:
        unwritten.append("num_key_value_heads apart from heads (kv_b_proj is split by it)")
    if config.get("attention_bias"):
        unwritten.append("attention biases")
    if not config.get("rope_interleave", True):
        unwritten.append("rope_interleave off")
    if float(config["rms_norm_eps"]) != LATENT_NORM_EPS:
        unwritten.append(f"rms_norm_eps apart from the latents' {LATENT_NORM_EPS}")
    return unwritten


def latent_fields(config: dict) -> dict[str, object]:
    """The keys (without "{arch}.") llama.cpp writes for DeepSeek-V3 beside the common ones."""
    rank, rot = config["kv_lora_rank"], config["qk_rope_head_dim"]
    fields = {
        _K.Attention.HEAD_COUNT_KV: 1,  # MLA as multi-query attention over the latent
        _K.LLM.LEADING_DENSE_BLOCK_COUNT: config["first_k_dense_replace"],
        _K.LLM.VOCAB_SIZE: config["vocab_size"],
        _K.Attention.KV_LORA_RANK: rank,
        _K.Attention.KEY_LENGTH: rank + rot,
        _K.Attention.VALUE_LENGTH: rank,
        _K.Attention.KEY_LENGTH_MLA: config["qk_nope_head_dim"] + rot,
        _K.Attention.VALUE_LENGTH_MLA: config["v_head_dim"],
        _K.LLM.EXPERT_FEED_FORWARD_LENGTH: config["moe_intermediate_size"],
        _K.LLM.EXPERT_COUNT: config["n_routed_experts"],
        _K.LLM.EXPERT_USED_COUNT: config["num_experts_per_tok"],
        _K.LLM.EXPERT_SHARED_COUNT: config.get("n_shared_experts", 0),
        _K.LLM.EXPERT_GATING_FUNC: int(gguf.ExpertGatingFuncType.SIGMOID),
        _K.Rope.DIMENSION_COUNT: rot,
    }
    if config.get("q_lora_rank") is not None:
        fields[_K.Attention.Q_LORA_RANK] = config["q_lora_rank"]
    if config.get("n_group") is not None:
        fields[_K.LLM.EXPERT_GROUP_COUNT] = config["n_group"]
    if config.get("topk_group") is not None:
        fields[_K.LLM.EXPERT_GROUP_USED_COUNT] = config["topk_group"]
    if config.get("routed_scaling_factor") is not None:
        fields[_K.LLM.EXPERT_WEIGHTS_SCALE] = float(config["routed_scaling_factor"])
    if config.get("norm_topk_prob"):
        fields[_K.LLM.EXPERT_WEIGHTS_NORM] = True
    rope = config.get("rope_parameters") or {}
    if rope.get("mscale_all_dim") is not None:  # llama.cpp's loader divides it by 0.1 again
        fields[_K.Rope.SCALING_YARN_LOG_MUL] = 0.1 * float(rope["mscale_all_dim"])
    return fields


def split_kv_b(array: np.ndarray, config: dict) -> tuple[np.ndarray, np.ndarray]:
    """kv_b_proj [heads * (nope + v), rank] as attn_k_b (each head's k rows, transposed:
    [heads, rank, nope]) and attn_v_b ([heads, v, rank])."""
    heads, nope = config["num_key_value_heads"], config["qk_nope_head_dim"]
    kv_b = array.reshape(heads, nope + config["v_head_dim"], array.shape[-1])
    return np.ascontiguousarray(kv_b[:, :nope].swapaxes(1, 2)), np.ascontiguousarray(kv_b[:, nope:])
