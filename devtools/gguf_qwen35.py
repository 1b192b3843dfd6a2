"""Qwen3.5's part of hf_to_gguf.py, as llama.cpp's converter writes it (its conversion package's
qwen.py: Qwen3NextModel, _LinearAttentionVReorderBase, Qwen3_5TextModel / Qwen3_5MoeTextModel,
arches `qwen35` / `qwen35moe`).

Keys: ssm.conv_kernel, ssm.state_size (the q/k head width), ssm.group_count (q/k heads),
ssm.time_step_rank (value heads), ssm.inner_size (value heads x width), full_attention_interval,
rope.dimension_count (a quarter of head_dim), rope.dimension_sections. Tensors: A_log stored as
-exp(A_log) (ssm_a), dt_bias as ssm_dt.bias, the conv [channels, kernel], every RMSNorm's
weight as 1 + w but the DeltaNet's gated one; and where value heads outnumber q/k heads, the
value heads reordered from grouped by q/k head (v0 v1 of k0, then of k1) to tiled (v0 of
every k, then v1 of every k): the v rows of in_proj_qkv and the conv, in_proj_z, in_proj_a/b,
A_log, dt_bias, and out_proj's columns. The layer kinds are not stored: llama.cpp takes every
`full_attention_interval`-th layer as full; this reads the interval off `layer_types`.
"""

from __future__ import annotations

import gguf
import numpy as np

_K = gguf.Keys
MROPE_SECTIONS = [11, 11, 10, 0]  # llama.cpp's default, written when the config has none


class QwenUnconvertible(ValueError):
    """A Qwen3.5 checkpoint whose layer kinds llama.cpp's keys cannot describe."""


def interval(config: dict) -> int:
    """Every n-th layer full attention, the rest linear: n, from `layer_types`."""
    types = config["layer_types"]
    n = types.index("full_attention") + 1 if "full_attention" in types else len(types) + 1
    pattern = ["linear_attention" if (i + 1) % n else "full_attention" for i in range(len(types))]
    if types != pattern:
        raise QwenUnconvertible(f"layer types {types}: not every {n}th layer full")
    return n


def fields(config: dict) -> dict[str, object]:
    """The keys llama.cpp writes beside the common ones (`{arch}` left in)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    rope = config.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    v_heads, v_dim = config["linear_num_value_heads"], config["linear_value_head_dim"]
    return {
        _K.SSM.CONV_KERNEL: config["linear_conv_kernel_dim"],
        _K.SSM.STATE_SIZE: config["linear_key_head_dim"],
        _K.SSM.GROUP_COUNT: config["linear_num_key_heads"],
        _K.SSM.TIME_STEP_RANK: v_heads,
        _K.SSM.INNER_SIZE: v_heads * v_dim,
        _K.LLM.FULL_ATTENTION_INTERVAL: interval(config),
        _K.Rope.DIMENSION_COUNT: int(head_dim * partial),
        _K.Rope.DIMENSION_SECTIONS: list(rope.get("mrope_section") or MROPE_SECTIONS),
        _K.Attention.KEY_LENGTH: head_dim,
        _K.Attention.VALUE_LENGTH: head_dim,
    }


def tiled(array: np.ndarray, axis: int, config: dict, width: int) -> np.ndarray:
    """`array`'s value heads (each `width` long along `axis`) from grouped to tiled order."""
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if k_heads == v_heads:
        return array
    axis %= array.ndim
    shape = array.shape
    split = array.reshape(*shape[:axis], k_heads, v_heads // k_heads, width, *shape[axis + 1 :])
    return np.ascontiguousarray(np.swapaxes(split, axis, axis + 1).reshape(shape))


def tensor(hf_name: str, array: np.ndarray, config: dict) -> tuple[str, np.ndarray]:
    """A checkpoint tensor's name (dt_bias renamed as the converter does) and its array as
    the file holds it."""
    key_rows = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
    v_dim = config["linear_value_head_dim"]
    if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
        return hf_name, array + np.float32(1.0)
    if ".linear_attn." not in hf_name:
        return hf_name, array
    if hf_name.endswith(".A_log"):
        return hf_name, tiled(-np.exp(array), 0, config, 1)
    if hf_name.endswith(".dt_bias"):
        return hf_name.replace(".dt_bias", ".dt_proj.bias"), tiled(array, 0, config, 1)
    if ".conv1d." in hf_name or ".in_proj_qkv." in hf_name:
        rows = array.reshape(array.shape[0], -1) if ".conv1d." in hf_name else array
        v = tiled(rows[key_rows:], 0, config, v_dim)
        return hf_name, np.concatenate((rows[:key_rows], v))
    if ".in_proj_z." in hf_name:
        return hf_name, tiled(array, 0, config, v_dim)
    if ".in_proj_a." in hf_name or ".in_proj_b." in hf_name:
        return hf_name, tiled(array, 0, config, 1)
    if ".out_proj." in hf_name:
        return hf_name, tiled(array, 1, config, v_dim)
    return hf_name, array
