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
from dataclasses import dataclass, replace

from swarm.model import deepseek, gemma4, gemma4_gguf, gptoss, qwen35
from swarm.model.config import ModelConfig, Rope
from swarm.model.expert_fields import gguf_experts, hf_experts
from swarm.model.rope_scaling import gguf_rope, rope_from_hf


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
    moe: bool = False  # a mixture of experts (GGUF: told apart from a dense arch by expert_count)
    topk_norm: bool = True  # renormalise the chosen experts' weights (config.json's default)
    gguf_topk_norm: bool | None = None  # llama.cpp's, where it differs (Qwen3-MoE: it does)
    latent: bool = False  # multi-head latent attention, DeepSeek's router (swarm.model.deepseek)
    sinks: bool = False  # gpt-oss's sinks, router and experts (swarm.model.gptoss)
    delta: bool = False  # Gated DeltaNet layers, gated attention (swarm.model.qwen35)
    # config.json names of a mixture layer's router and expert e's gate, up and down
    hf_experts: tuple[str, ...] = (
        "mlp.gate",
        "mlp.experts.{e}.gate_proj",
        "mlp.experts.{e}.up_proj",
        "mlp.experts.{e}.down_proj",
    )


# what Gemma 2 and 3 share: 1 + w norms, norms after attention and the MLP too, GeGLU, scaled
# and tied embeddings, activations too large for float16 on the wire
_GEMMA = dict(
    post_norms=True,
    gemma_norms=True,
    embed_scaled=True,
    activation="gelu_tanh",
    tied=True,
    wire_dtype="bfloat16",
)

_GEMMA4 = {**_GEMMA, "gemma_norms": False, "qk_norm": True}  # Gemma 3's, but norms x * w
_QWEN35 = dict(qk_norm=True, gemma_norms=True, delta=True)  # Qwen3.5: x * (1 + w) norms

FAMILIES = {
    f.name: f
    for f in (
        Family("llama", ("llama",), ("llama",), gguf_permuted=True, sliding=False),
        Family("mistral", ("mistral",), ("mistral",), gguf_permuted=True),
        Family("qwen2", ("qwen2",), ("qwen2",), window_opt_in=True),
        Family("qwen3", ("qwen3",), ("qwen3",), qk_norm=True, window_opt_in=True),
        Family("phi3", ("phi3",), ("phi3",), fused=True),
        Family(
            "mixtral",
            ("mixtral",),
            ("llama",),  # llama.cpp files Mixtral as llama with experts
            gguf_permuted=True,
            moe=True,
            hf_experts=(
                "block_sparse_moe.gate",
                "block_sparse_moe.experts.{e}.w1",
                "block_sparse_moe.experts.{e}.w3",
                "block_sparse_moe.experts.{e}.w2",
            ),
        ),
        Family(
            "qwen2_moe",
            ("qwen2_moe",),
            ("qwen2moe",),
            window_opt_in=True,
            moe=True,
            topk_norm=False,
        ),
        Family(
            "qwen3_moe",
            ("qwen3_moe",),
            ("qwen3moe",),
            qk_norm=True,
            window_opt_in=True,
            moe=True,
            topk_norm=False,
            gguf_topk_norm=True,
        ),
        Family("deepseek_v3", ("deepseek_v3", "kimi_k2"), ("deepseek2",), moe=True, latent=True),
        # llama.cpp's gpt-oss: every second layer full (config.json names each layer's kind)
        Family("gpt_oss", ("gpt_oss",), ("gpt-oss",), moe=True, sinks=True, window_period=2),
        Family(
            "gemma2", ("gemma2",), ("gemma2",), **_GEMMA, window_period=2, softcaps=(50.0, 30.0)
        ),
        Family("gemma4", ("gemma4_text",), (gemma4_gguf.ARCH,), **_GEMMA4),
        Family(
            "gemma3",
            ("gemma3_text",),
            ("gemma3",),
            **_GEMMA,
            qk_norm=True,
            window_period=6,
            local_theta=10_000.0,
        ),
        Family("qwen3_5", ("qwen3_5_text",), ("qwen35",), **_QWEN35),
        Family("qwen3_5_moe", ("qwen3_5_moe_text",), ("qwen35moe",), **_QWEN35, moe=True),
    )
}

LINEARS = ("q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down", "q_a", "q_b", "kv_a", "kv_b")

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
    # latent attention (llama.cpp splits kv_b in two: attn_k_b, attn_v_b)
    "q_a": ("self_attn.q_a_proj", "attn_q_a"),
    "q_a_norm": ("self_attn.q_a_layernorm", "attn_q_a_norm"),
    "q_b": ("self_attn.q_b_proj", "attn_q_b"),
    "kv_a": ("self_attn.kv_a_proj_with_mqa", "attn_kv_a_mqa"),
    "kv_a_norm": ("self_attn.kv_a_layernorm", "attn_kv_a_norm"),
    "kv_b": ("self_attn.kv_b_proj", "attn_kv_b"),
    "sinks": ("self_attn.sinks", "attn_sinks"),
}


def file_name(name: str) -> str:
    """A block tensor's full name in its file: name + ".weight", but for names that carry their
    own ending (DeepSeek's e_score_correction_bias, exp_probs_b.bias; gpt-oss's sinks and
    stacked experts in config.json; Qwen3.5's A_log, ssm_a; Gemma 4's, whole components: its
    "experts.down_proj" is not DeepSeek's "shared_experts.down_proj")."""
    own = name.endswith(("bias", *qwen35.OWN, *gptoss.OWN_ENDINGS))
    own = own or any(name == e or name.endswith("." + e) for e in gemma4.OWN_ENDINGS)
    return name if own else f"{name}.weight"


def _attention_tensors(c: ModelConfig) -> list[str]:
    if c.latent is None:
        return ["qkv"] if c.fused else ["q", "k", "v"]
    q = ["q_a", "q_a_norm", "q_b"] if c.latent.q_rank else ["q"]
    return [*q, "kv_a", "kv_a_norm", "kv_b"]


def block_tensors(c: ModelConfig, layer: int) -> tuple[str, ...]:
    """The tensors (blocks.py's names) block `layer` of `c` must have, a mixture's experts
    aside (`block_names` adds them); biases are optional."""
    if c.is_delta(layer):  # Gated DeltaNet's instead of attention's
        return qwen35.block_tensors(c.moe(layer))
    if c.layer_scalars:
        return gemma4.block_tensors(c, layer)
    names = ["attn_norm", *_attention_tensors(c), "o", "mlp_norm"]
    if not c.moe(layer):
        names += ["gate_up", "down"] if c.fused else ["gate", "up", "down"]
    names += ["q_norm", "k_norm"] if c.qk_norm else []
    names += ["attn_post_norm", "mlp_post_norm"] if c.post_norms else []
    return tuple(names + ["sinks"] if c.sinks else names)


def block_names(c: ModelConfig, gguf: bool, layer: int) -> dict[str, str]:
    """blocks.py's name -> the file's name within block `layer` ("blk.N." / "model.layers.N."
    and ".weight" left out)."""
    out = {}
    for name in block_tensors(c, layer):
        hf, gg = qwen35.names(c, layer).get(name) or (
            _NAMES[name] if name in _NAMES else gemma4.BLOCK_NAMES[name]
        )
        if name == "mlp_norm" and c.post_norms:
            hf = "pre_feedforward_layernorm"  # Gemma: post_attention_layernorm is another norm
        if name == "mlp_norm" and gguf and c.sinks:
            gg = "post_attention_norm"  # llama.cpp's gpt-oss name for the MLP's norm
        if name == "kv_b" and gguf:
            out |= {"k_b": "attn_k_b", "v_b": "attn_v_b"}
            continue
        out[name] = gg if gguf else hf
    if c.moe(layer) and not c.layer_scalars:  # Gemma 4's are in block_tensors
        out |= _expert_names(c, gguf)
    return out


def _expert_names(c: ModelConfig, gguf: bool) -> dict[str, str]:
    """A mixture layer's router and experts: GGUF stacks each kind of expert matrix in one 3-D
    tensor, config.json folders keep one per expert."""
    if c.sinks:
        return gptoss.expert_names(gguf, c.mxfp4_experts)
    if gguf:
        out = {"router": "ffn_gate_inp"}
        out |= {f"experts.{p}": f"ffn_{p}_exps" for p in ("gate", "up", "down")}
        if c.shared_intermediate:
            out |= {f"shared.{p}": f"ffn_{p}_shexp" for p in ("gate", "up", "down")}
            if c.shared_gated:
                out["shared_gate"] = "ffn_gate_inp_shexp"
        if c.router == "sigmoid":
            out["router_bias"] = "exp_probs_b.bias"
        return out
    router, *parts = FAMILIES[c.family].hf_experts
    out = {"router": router}
    for e in range(c.experts):
        out |= {f"expert.{e}.{p}": n.format(e=e) for p, n in zip(("gate", "up", "down"), parts)}
    if c.shared_intermediate and c.shared_gated:
        out |= {f"shared.{p}": f"mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")}
        out["shared_gate"] = "mlp.shared_expert_gate"
    elif c.shared_intermediate:  # DeepSeek's, without a gate
        out |= {f"shared.{p}": f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")}
    if c.router == "sigmoid":
        out["router_bias"] = f"{router}.e_score_correction_bias"
    return out


def family_of(kind: str, gguf: bool, where: str, moe: bool = False) -> Family:
    for f in FAMILIES.values():
        if kind in (f.gguf_archs if gguf else f.hf_types) and (not gguf or f.moe == moe):
            return f
    said = "architecture" if gguf else "model_type"
    known = sorted(a for f in FAMILIES.values() for a in (f.gguf_archs if gguf else f.hf_types))
    raise ValueError(
        f"{where}: {said} {kind!r} is not one this node computes (it computes {', '.join(known)})"
    )


# ---- Hugging Face config.json ----------------------------------------------------------------


def _hf_ropes(f: Family, cfg: dict, where: str) -> tuple[Rope, Rope | None]:
    """The full layers' RoPE and the windowed layers' own, from transformers 5's
    `rope_parameters` (one dict, or one per layer type) or 4.x's rope_theta + rope_scaling."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta", 10000.0))
    longest = int(cfg.get("max_position_embeddings") or 0)
    if "full_attention" in params or "sliding_attention" in params:
        full = rope_from_hf(where, params.get("full_attention") or {}, theta, longest)
        local = params.get("sliding_attention")
        return full, None if local is None else rope_from_hf(where, local, theta, longest)
    rope = rope_from_hf(where, params or cfg.get("rope_scaling") or {}, theta, longest)
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
    deepseek.refuse_hf(cfg, where)
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
    config = replace(config, **qwen35.hf_fields(f, cfg, where))
    if f.latent:
        config = replace(config, **deepseek.hf_fields(cfg))
    elif f.moe:
        config = replace(config, **hf_experts(cfg, f.topk_norm), **gptoss.hf_fields(f, cfg, where))
    elif f.name == "gemma4":
        config = replace(config, **gemma4.hf_fields(cfg, where))
    return config, bool(cfg.get("tie_word_embeddings", f.tied))


# ---- GGUF metadata ---------------------------------------------------------------------------


def config_from_gguf(
    field: Callable, tensors: dict, name: str, freq_factors: Callable[[], tuple[float, ...]]
) -> tuple[ModelConfig, Family]:
    """A GGUF file's ModelConfig from its metadata (`field(key, default)`; a missing key
    without a default raises) and tensor names; `freq_factors` reads rope_freqs.weight."""
    arch, given = field("general.architecture"), field  # Gemma 4: one row, dense or not
    moe = int(field(f"{arch}.expert_count", 0)) > 0 and arch != gemma4_gguf.ARCH
    f = family_of(arch, gguf=True, where=name, moe=moe)
    field = gemma4_gguf.scalars(field) if arch == gemma4_gguf.ARCH else field
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
        intermediate=int(field(f"{arch}.feed_forward_length", 0)),
        heads=heads,
        kv_heads=int(field(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope=gguf_rope(field, arch, name, tensors, freq_factors, f.latent),
        rms_eps=float(field(f"{arch}.attention.layer_norm_rms_epsilon")),
        vocab=int(
            tensors["token_embd.weight"].shape[-1]
            if "token_embd.weight" in tensors  # absent from a node's shards of a split model
            else field(f"{arch}.vocab_size")
        ),
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
    if f.latent:
        config = replace(
            config, **deepseek.gguf_fields(field, arch, tensors, name, config.rope, layers)
        )
    elif f.moe:
        fields = gptoss.gguf_fields(f, field, arch, config.rope)
        norm = f.topk_norm if f.gguf_topk_norm is None else f.gguf_topk_norm
        config = replace(config, **gguf_experts(field, arch, tensors, layers, norm), **fields)
    if arch == gemma4_gguf.ARCH:
        config = replace(config, **gemma4_gguf.gguf_fields(given, tensors, name, freq_factors))
    return replace(config, **qwen35.gguf_fields(f, field, arch, layers)), f
