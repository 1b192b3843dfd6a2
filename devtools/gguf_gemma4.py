"""Gemma 4's part of hf_to_gguf.py, as llama.cpp's converter writes it (its conversion package's
gemma.py: Gemma4Model over Gemma3Model and TextModel, arch `gemma4`).

Keys beside the common ones: the full layers' head width as key_length / value_length /
rope.dimension_count and the sliding layers' as the *_swa ones; head_count_kv one a layer
where the full layers have their own kv heads; feed_forward_length one a layer where the
KV-sharing layers' MLP is double wide; attention.shared_kv_layers,
embedding_length_per_layer_input, attention.sliding_window_pattern (true: sliding), the
experts' width and count. Tensors: norms as they are (x * w: no shift), `layer_scalar` as
blk.N.layer_output_scale, the router's scale as ffn_gate_inp.scale, the per-expert scales as
ffn_down_exps.scale, the stacked experts as they are, and rope_freqs: 1 for each of the full
layers' frequencies that turns under the proportional RoPE, 1e30 for the others.
"""

from __future__ import annotations

import gguf
import numpy as np

_K = gguf.Keys


class GemmaUnconvertible(ValueError):
    """A Gemma 4 checkpoint llama.cpp's converter would refuse or convert into another model."""


def _full_layer(config: dict, key: str, fallback: str):
    """config[fallback] where set, else the first full layer's `key` in per_layer_config, as
    the converter looks it up."""
    if config.get(fallback) is not None:
        return config[fallback]
    types = config.get("layer_types") or []
    for layer, own in (config.get("per_layer_config") or {}).items():
        if int(layer) < len(types) and types[int(layer)] == "full_attention" and key in own:
            return own[key]
    return None


def check(config: dict) -> None:
    """GemmaUnconvertible where the converter asserts (a full layer's RoPE not proportional,
    an attention softcap) or writes a file of another model (the sliding layers' RoPE over part
    of a head: transformers' text model turns all of it)."""
    rope = config.get("rope_parameters") or {}
    if (rope.get("full_attention") or {}).get("rope_type") != "proportional":
        raise GemmaUnconvertible("the full layers' RoPE is not 'proportional'")
    if config.get("attn_logit_softcapping") is not None:
        raise GemmaUnconvertible("an attention softcap: llama.cpp asserts there is none")
    if _full_layer(config, "head_dim", "global_head_dim") is None:
        raise GemmaUnconvertible("no full layer's head width")


def fields(config: dict) -> dict[str, object]:
    """The keys llama.cpp writes beside (or instead of) the common ones (`{arch}` left in)."""
    layers, shared = config["num_hidden_layers"], config["num_kv_shared_layers"]
    sliding = [t == "sliding_attention" for t in config["layer_types"]]
    full_dim = _full_layer(config, "head_dim", "global_head_dim")
    swa_dim = config["head_dim"]
    swa_rope = config["rope_parameters"].get("sliding_attention") or {}
    out: dict[str, object] = {
        _K.Rope.FREQ_BASE_SWA: float(swa_rope.get("rope_theta", 10_000.0)),
        _K.Attention.SHARED_KV_LAYERS: shared,
        _K.LLM.EMBD_LENGTH_PER_LAYER_INP: config.get("hidden_size_per_layer_input") or 0,
        _K.Attention.SLIDING_WINDOW_PATTERN: sliding,
        _K.Attention.KEY_LENGTH: full_dim,
        _K.Attention.VALUE_LENGTH: full_dim,
        _K.Attention.KEY_LENGTH_SWA: swa_dim,
        _K.Attention.VALUE_LENGTH_SWA: swa_dim,
        _K.Rope.DIMENSION_COUNT: full_dim,
        # the converter reads partial_rotary_factor beside the per-kind dicts: never there
        _K.Rope.DIMENSION_COUNT_SWA: swa_dim,
        _K.Attention.SLIDING_WINDOW: config["sliding_window"],
    }
    if config.get("final_logit_softcapping"):
        out[_K.LLM.FINAL_LOGIT_SOFTCAPPING] = float(config["final_logit_softcapping"])
    if config.get("use_double_wide_mlp"):
        ffn = config["intermediate_size"]
        out[_K.LLM.FEED_FORWARD_LENGTH] = [ffn] * (layers - shared) + [2 * ffn] * shared
    kv_full = _full_layer(config, "num_key_value_heads", "num_global_key_value_heads")
    if kv_full is not None and config.get("num_key_value_heads") is not None:
        kv = config["num_key_value_heads"]
        out[_K.Attention.HEAD_COUNT_KV] = [kv if s else kv_full for s in sliding]
    if config.get("enable_moe_block") or config.get("num_experts"):
        out[_K.LLM.EXPERT_COUNT] = config["num_experts"]
        out[_K.LLM.EXPERT_USED_COUNT] = config["top_k_experts"]
        out[_K.LLM.EXPERT_FEED_FORWARD_LENGTH] = config["moe_intermediate_size"]
    return out


def rename(hf_name: str) -> str:
    """A checkpoint tensor's name as the converter renames it before its tables: ".weight" on
    the layer scalar and the stacked experts; the per-expert scales as the down experts'."""
    if hf_name.endswith(("layer_scalar", "experts.gate_up_proj", "experts.down_proj")):
        return hf_name + ".weight"
    return hf_name.replace("router.per_expert_scale", "experts.down_proj.scale")


def rope_freqs(config: dict) -> np.ndarray:
    """rope_freqs.weight: the proportional RoPE of the full layers as llama.cpp computes it
    (its neox RoPE turns the first dims: the frequencies past the share divided by 1e30)."""
    full_dim = _full_layer(config, "head_dim", "global_head_dim")
    share = config["rope_parameters"]["full_attention"]["partial_rotary_factor"]
    turned = int(full_dim * share / 2)
    return np.asarray([1.0] * turned + [1e30] * (full_dim // 2 - turned), dtype=np.float32)
