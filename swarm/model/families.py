"""The architectures a node computes, as data: each family's variants of one decoder block, the
names its files give a block's tensors, and how a Hugging Face config.json or a GGUF file's
metadata fills a ModelConfig (with the family's defaults where a file leaves a value out).

References checked against: transformers' modeling_*/configuration_* files (the math, and the
defaults a config.json may omit) and llama.cpp's per-architecture tables (GGUF names, and what
its converter changed: Llama's q/k rows interleaved for its RoPE, Gemma's norms stored as 1 + w).
Anything that changes the math and is not built here is refused by name at load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from swarm.model.config import Llama3Rope, ModelConfig, Rope


@dataclass(frozen=True)
class Family:
    name: str
    hf_types: tuple[str, ...]  # config.json "model_type" values
    gguf_archs: tuple[str, ...]  # GGUF "general.architecture" values
    qk_norm: bool = False
    post_norms: bool = False
    fused: bool = False
    gemma_norms: bool = False  # x * (1 + w); llama.cpp's files already hold 1 + w
    embed_scaled: bool = False  # embeddings times sqrt(hidden)
    activation: str = "silu"
    tied: bool = False  # tie_word_embeddings when a config.json leaves it out
    window_period: int = 0  # windowed layers: all (0), or all but every n-th (Gemma)
    window_opt_in: bool = False  # Qwen: a window only with use_sliding_window, from layer n
    local_theta: float | None = None  # windowed layers' RoPE base when a file omits it
    softcaps: tuple[float | None, float | None] = (None, None)  # attention, final defaults
    gguf_permuted: bool = False  # llama.cpp interleaved q/k rows for its RoPE
    sliding: bool = True  # config.json's sliding_window counts (transformers' Llama ignores it)
    wire_dtype: str = "float16"  # Gemma's residual stream passes float16's 65,504


FAMILIES = {
    f.name: f
    for f in (
        Family("llama", ("llama",), ("llama",), gguf_permuted=True, sliding=False),
        Family("mistral", ("mistral",), ("mistral",), gguf_permuted=True),
        Family("qwen2", ("qwen2",), ("qwen2",), window_opt_in=True),
        Family("qwen3", ("qwen3",), ("qwen3",), qk_norm=True, window_opt_in=True),
        Family("phi3", ("phi3",), ("phi3",), fused=True),
        Family(
            "gemma2",
            ("gemma2",),
            ("gemma2",),
            post_norms=True,
            gemma_norms=True,
            embed_scaled=True,
            activation="gelu_tanh",
            tied=True,
            wire_dtype="bfloat16",
            window_period=2,
            softcaps=(50.0, 30.0),
        ),
        Family(
            "gemma3",
            ("gemma3_text",),
            ("gemma3",),
            qk_norm=True,
            post_norms=True,
            gemma_norms=True,
            embed_scaled=True,
            activation="gelu_tanh",
            tied=True,
            wire_dtype="bfloat16",
            window_period=6,
            local_theta=10_000.0,
        ),
    )
}

LINEARS = ("q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down")

# a block's tensors, by the name blocks.py reads -> (Hugging Face name, GGUF name)
_NAMES = {
    "attn_norm": ("input_layernorm", "attn_norm"),
    "q": ("self_attn.q_proj", "attn_q"),
    "k": ("self_attn.k_proj", "attn_k"),
    "v": ("self_attn.v_proj", "attn_v"),
    "qkv": ("self_attn.qkv_proj", "attn_qkv"),
    "o": ("self_attn.o_proj", "attn_output"),
    "q_norm": ("self_attn.q_norm", "attn_q_norm"),
    "k_norm": ("self_attn.k_norm", "attn_k_norm"),
    "attn_post_norm": ("post_attention_layernorm", "post_attention_norm"),
    "mlp_norm": ("post_attention_layernorm", "ffn_norm"),
    "gate": ("mlp.gate_proj", "ffn_gate"),
    "up": ("mlp.up_proj", "ffn_up"),
    "gate_up": ("mlp.gate_up_proj", "ffn_up"),  # llama.cpp keeps Phi-3's fused one as ffn_up
    "down": ("mlp.down_proj", "ffn_down"),
    "mlp_post_norm": ("post_feedforward_layernorm", "post_ffw_norm"),
}


def block_tensors(c: ModelConfig) -> tuple[str, ...]:
    """The tensors (blocks.py's names) every block of `c` must have; biases are optional."""
    names = ["attn_norm", *(["qkv"] if c.fused else ["q", "k", "v"]), "o", "mlp_norm"]
    names += ["gate_up"] if c.fused else ["gate", "up"]
    names += ["down"]
    names += ["q_norm", "k_norm"] if c.qk_norm else []
    names += ["attn_post_norm", "mlp_post_norm"] if c.post_norms else []
    return tuple(names)


def block_names(c: ModelConfig, gguf: bool) -> dict[str, str]:
    """blocks.py's name -> the file's name within a block ("blk.N." / "model.layers.N." and
    ".weight" left out), biases included for every linear."""
    out = {}
    for name in block_tensors(c):
        hf, gg = _NAMES[name]
        if name == "mlp_norm" and c.post_norms:
            hf = "pre_feedforward_layernorm"  # Gemma: post_attention_layernorm is another norm
        out[name] = gg if gguf else hf
    return out


def family_of(kind: str, gguf: bool, where: str) -> Family:
    for f in FAMILIES.values():
        if kind in (f.gguf_archs if gguf else f.hf_types):
            return f
    said = "architecture" if gguf else "model_type"
    known = sorted(a for f in FAMILIES.values() for a in (f.gguf_archs if gguf else f.hf_types))
    raise ValueError(
        f"{where}: {said} {kind!r} is not one this node computes (it computes {', '.join(known)})"
    )


# ---- Hugging Face config.json ----------------------------------------------------------------


def rope_from_hf(where: str, params: dict, theta: float) -> Rope:
    """A config's RoPE scaling, if built here; ValueError naming any other (YaRN, longrope,
    dynamic: a model computed without it would be silently wrong)."""
    kind = params.get("rope_type", params.get("type")) or "default"
    theta = float(params.get("rope_theta", theta))
    if kind == "default":
        return Rope(theta)
    if kind == "linear":
        return Rope(theta, linear=float(params["factor"]))
    if kind == "llama3":
        llama3 = Llama3Rope(
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]),
        )
        return Rope(theta, llama3=llama3)
    raise ValueError(f"{where}: RoPE scaling {kind!r} is not supported yet")


def _hf_ropes(f: Family, cfg: dict, where: str) -> tuple[Rope, Rope | None]:
    """The full layers' RoPE and the windowed layers' own, from transformers 5's
    `rope_parameters` (one dict, or one per layer type) or 4.x's rope_theta + rope_scaling."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", 10000.0))
    if "full_attention" in params or "sliding_attention" in params:
        full = rope_from_hf(where, params.get("full_attention") or {}, theta)
        local = params.get("sliding_attention")
        return full, None if local is None else rope_from_hf(where, local, theta)
    rope = rope_from_hf(where, params or cfg.get("rope_scaling") or {}, theta)
    local_theta = cfg.get("rope_local_base_freq", f.local_theta)
    return rope, None if local_theta is None else Rope(float(local_theta))


def _hf_windows(f: Family, cfg: dict, layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window") if f.sliding else None
    if f.window_opt_in and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return ()
    if types := cfg.get("layer_types"):
        return tuple(window if t == "sliding_attention" else None for t in types)
    if f.window_opt_in:
        first = cfg.get("max_window_layers", 0)
        return tuple(window if i >= first else None for i in range(layers))
    return _periodic(window, cfg.get("sliding_window_pattern", f.window_period), layers)


def _periodic(window: int, period: int, layers: int) -> tuple[int | None, ...]:
    """Every layer windowed (period 0), or all but every period-th (Gemma: 2, 6)."""
    return tuple(window if not period or (i + 1) % period else None for i in range(layers))


def _activation(f: Family, act: str | None, where: str) -> str:
    names = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
    if act is None:
        return f.activation
    if act not in names:
        raise ValueError(f"{where}: activation {act!r} is not supported")
    return names[act]


def config_from_hf(cfg: dict, name: str, where: str) -> tuple[ModelConfig, bool]:
    """A config.json's ModelConfig, and whether its LM head is the embedding table."""
    if cfg.get("text_config") is not None:
        raise ValueError(f"{where}: a multimodal folder; serve its text model's own folder")
    f = family_of(cfg.get("model_type"), gguf=False, where=where)
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"{where}: bidirectional attention is not supported")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    rope, local = _hf_ropes(f, cfg, where)
    partial = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
    partial = partial or cfg.get("partial_rotary_factor", 1.0)
    eos = cfg.get("eos_token_id")
    attn_cap = cfg.get("attn_logit_softcapping", f.softcaps[0])
    final_cap = cfg.get("final_logit_softcapping", f.softcaps[1])
    scalar = cfg.get("query_pre_attn_scalar") if f.gemma_norms else None
    config = ModelConfig(
        name=name,
        family=f.name,
        num_layers=cfg["num_hidden_layers"],
        hidden=hidden,
        intermediate=cfg["intermediate_size"],
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rope=rope,
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        vocab=cfg["vocab_size"],
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
        max_position=cfg.get("max_position_embeddings", 4096),
        rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
        local_rope=local,
        windows=_hf_windows(f, cfg, cfg["num_hidden_layers"]),
        norm_offset=1.0 if f.gemma_norms else 0.0,
        qk_norm=f.qk_norm,
        post_norms=f.post_norms,
        fused=f.fused,
        activation=_activation(f, cfg.get("hidden_activation") or cfg.get("hidden_act"), where),
        attention_scale=float(scalar) ** -0.5 if scalar else 0.0,
        attn_softcap=attn_cap,
        final_softcap=final_cap,
        embed_scale=float(hidden) ** 0.5 if f.embed_scaled else None,
        wire_dtype=f.wire_dtype,
    )
    return config, bool(cfg.get("tie_word_embeddings", f.tied))


# ---- GGUF metadata ---------------------------------------------------------------------------


def config_from_gguf(
    field: Callable, tensors: dict, name: str, freq_factors: Callable[[], tuple[float, ...]]
) -> tuple[ModelConfig, Family]:
    """A GGUF file's ModelConfig from its metadata (`field(key, default)`; a missing key
    without a default raises) and tensor names; `freq_factors` reads rope_freqs.weight."""
    arch = field("general.architecture")
    f = family_of(arch, gguf=True, where=name)
    per_layer = [
        k
        for k in ("attention.head_count", "feed_forward_length")
        if isinstance(field(f"{arch}.{k}", 0), (list, tuple))
    ]
    if per_layer:
        raise ValueError(f"{name}: per-layer {', '.join(per_layer)} is not supported")
    if any(n.startswith(("rope_factors_long", "rope_factors_short")) for n in tensors):
        raise ValueError(f"{name}: RoPE scaling 'longrope' is not supported yet")
    heads = int(field(f"{arch}.attention.head_count"))
    hidden = int(field(f"{arch}.embedding_length"))
    layers = int(field(f"{arch}.block_count"))
    head_dim = int(field(f"{arch}.attention.key_length", hidden // heads))
    rotary = int(field(f"{arch}.rope.dimension_count", head_dim))
    # read for every architecture: llama.cpp files Mistral under "llama", and a file that
    # states a window means it (llama.cpp's own converter drops Mistral's, then computes none)
    window = field(f"{arch}.attention.sliding_window", None)
    period = int(field(f"{arch}.attention.sliding_window_pattern", f.window_period))
    windows = ()
    if window:
        windows = tuple(
            int(window) if not period or (i + 1) % period else None for i in range(layers)
        )
    eos = field("tokenizer.ggml.eos_token_id", None)
    scale = field(f"{arch}.attention.scale", None)
    if scale is None and f.gemma_norms and layers in (46, 62):
        scale = (hidden / heads) ** -0.5  # llama.cpp: Gemma 2/3 27B scale by hidden / heads
    config = ModelConfig(
        name=name,
        family=f.name,
        num_layers=layers,
        hidden=hidden,
        intermediate=int(field(f"{arch}.feed_forward_length")),
        heads=heads,
        kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope=_gguf_rope(field, arch, name, tensors, freq_factors),
        rms_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        vocab=int(tensors["token_embd.weight"].shape[-1]),
        bos_token_id=field("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=() if eos is None else (int(eos),),
        max_position=int(field(f"{arch}.context_length", 4096)),
        rotary_dim=rotary if rotary != head_dim else 0,
        local_rope=None if f.local_theta is None else Rope(f.local_theta),
        windows=windows,
        qk_norm=f.qk_norm,
        post_norms=f.post_norms,
        fused=f.fused,
        activation=f.activation,
        attention_scale=float(scale or 0.0),
        attn_softcap=field(f"{arch}.attn_logit_softcapping", None),
        final_softcap=field(f"{arch}.final_logit_softcapping", None),
        embed_scale=float(hidden) ** 0.5 if f.embed_scaled else None,
        wire_dtype=f.wire_dtype,
    )
    return config, f


def _gguf_rope(field, arch: str, name: str, tensors, freq_factors) -> Rope:
    theta = float(field(f"{arch}.rope.freq_base", 10000.0))
    kind = field(f"{arch}.rope.scaling.type", "none") or "none"
    if "rope_freqs.weight" in tensors:  # llama.cpp keeps Llama 3.1's scaling as these
        return Rope(theta, freq_factors=freq_factors())
    if kind == "linear":
        return Rope(theta, linear=float(field(f"{arch}.rope.scaling.factor")))
    if kind != "none":
        raise ValueError(f"{name}: RoPE scaling {kind!r} is not supported yet")
    return Rope(theta)
