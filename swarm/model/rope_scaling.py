"""A model's RoPE scaling, read from a Hugging Face config or a GGUF file's keys: linear,
Llama 3.1's (in GGUF, its rope_freqs table), YaRN, Gemma 4's proportional one. Any other is
refused by name: a model computed without it would be silently wrong past its original context."""

from __future__ import annotations

import math

from swarm.model.config import Llama3Rope, Rope, YarnRope


def rope_from_hf(where: str, params: dict, theta: float, max_position: int = 0) -> Rope:
    """A config's RoPE scaling, if built here; ValueError naming any other (longrope, dynamic:
    a model computed without it would be silently wrong)."""
    kind = params.get("rope_type", params.get("type")) or "default"
    theta = float(params.get("rope_theta", theta))
    if kind == "yarn":
        return Rope(theta, yarn=_hf_yarn(where, params, max_position))
    if kind == "default":
        return Rope(theta)
    if kind == "linear":
        return Rope(theta, linear=float(params["factor"]))
    if kind == "proportional":  # Gemma 4's full layers
        share = float(params.get("partial_rotary_factor", 1.0))
        return Rope(theta, linear=float(params.get("factor", 1.0)), proportion=share)
    if kind == "llama3":
        llama3 = Llama3Rope(
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]),
        )
        return Rope(theta, llama3=llama3)
    raise ValueError(f"{where}: RoPE scaling {kind!r} is not supported yet")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context `factor` times the original (the paper's)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _hf_yarn(where: str, params: dict, max_position: int) -> YarnRope:
    """transformers' reading of a YaRN config (_compute_yarn_parameters)."""
    if "original_max_position_embeddings" not in params:
        raise ValueError(f"{where}: YaRN without original_max_position_embeddings")
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or max_position / original
    attention = params.get("attention_factor")
    if attention is None:
        mscale, all_dims = params.get("mscale"), params.get("mscale_all_dim")
        attention = yarn_mscale(factor)
        if mscale and all_dims:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dims)
    return YarnRope(
        float(factor),
        original,
        float(params.get("beta_fast") or 32),
        float(params.get("beta_slow") or 1),
        float(attention),
        bool(params.get("truncate", True)),
    )


def gguf_rope(field, arch: str, name: str, tensors, freq_factors, latent: bool = False) -> Rope:
    """A GGUF file's RoPE (`field(key, default)` its metadata, `tensors` its tensor names,
    `freq_factors` reads rope_freqs.weight); ValueError naming a scaling not built here.
    `latent`: DeepSeek's, whose YaRN mscale llama.cpp reads from yarn_log_multiplier."""
    theta = float(field(f"{arch}.rope.freq_base", 10000.0))
    kind = field(f"{arch}.rope.scaling.type", "none") or "none"
    if "rope_freqs.weight" in tensors:  # llama.cpp keeps Llama 3.1's scaling as these
        return Rope(theta, freq_factors=freq_factors())
    if kind == "linear":
        return Rope(theta, linear=float(field(f"{arch}.rope.scaling.factor")))
    if kind == "yarn":
        return Rope(theta, yarn=_gguf_yarn(field, arch, name, latent))
    if kind != "none":
        raise ValueError(f"{name}: RoPE scaling {kind!r} is not supported yet")
    return Rope(theta)


def _gguf_yarn(field, arch: str, name: str, latent: bool = False) -> YarnRope:
    """llama.cpp's YaRN keys as its converter writes them from a config's (those it leaves
    out at their defaults, as llama.cpp reads them: betas 32 and 1, the ramp's ends rounded)."""
    key = f"{arch}.rope.scaling."
    log_mul = field(f"{key}yarn_log_multiplier", 0)
    if float(field(f"{key}yarn_ext_factor", 1.0)) != 1.0 or (log_mul and not latent):
        raise ValueError(f"{name}: YaRN with an extrapolation factor or log multiplier: not yet")
    factor = float(field(f"{key}factor"))
    # the config's attention_factor where it had one (llama.cpp's llama reader ignores the
    # key and uses the default: transformers' reading of the checkpoint is followed here)
    attention = field(f"{key}yarn_attn_factor", None)
    attention = yarn_mscale(factor) if attention is None else float(attention)
    if latent:  # llama.cpp's deepseek2: cos and sin unscaled, the scores by mscale^2
        attention = 1.0
    return YarnRope(
        factor,
        int(field(f"{key}original_context_length", field(f"{arch}.context_length"))),
        float(field(f"{key}yarn_beta_fast", 32.0)),
        float(field(f"{key}yarn_beta_slow", 1.0)),
        attention * (1.0 if latent else float(field(f"{key}attn_factor", 1.0))),
    )
