"""What llama.cpp's converter does to each family's Hugging Face checkpoint, as data.

Read from llama.cpp's convert_hf_to_gguf.py (its conversion/ modules: base.py's TextModel, llama.py,
qwen.py, gemma.py, phi.py) and gguf-py's tensor tables; hf_to_gguf.py applies these tables.
Names are without their `.weight` / `.bias` suffix, which carries over unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# tensors outside the blocks; lm_head is absent from a tied checkpoint, and then from the GGUF
TOP_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    # Gemma 4's per-layer inputs
    "model.embed_tokens_per_layer": "per_layer_token_embd",
    "model.per_layer_model_projection": "per_layer_model_proj",
    "model.per_layer_projection_norm": "per_layer_proj_norm",
}

# per block: the Hugging Face name after `model.layers.{i}.`, the GGUF one after `blk.{i}.`
_ATTENTION = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
}
_MLP = {"mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
# Llama's "post_attention_layernorm" is the norm before the MLP ...
_LLAMA_NORMS = {"post_attention_layernorm": "ffn_norm"}
# ... Gemma's is a norm after attention, and its pre-MLP norm has another name
_GEMMA_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_QK_NORMS = {"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
# Phi-3 fuses q|k|v (rows in that order) and gate|up (gate's rows first) in its checkpoint,
# and llama.cpp keeps them fused: ffn_up holds both halves, and there is no ffn_gate
_PHI3 = {
    "input_layernorm": "attn_norm",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


# Mixture-of-experts: the router, and Qwen2-MoE's shared expert and its sigmoid gate
_MIXTRAL_ROUTER = {"block_sparse_moe.gate": "ffn_gate_inp"}
_QWEN_ROUTER = {"mlp.gate": "ffn_gate_inp"}
_SHARED_EXPERT = {
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",  # [1, hidden]: one gate logit per token
}
# DeepSeek-V3 (llama.cpp's deepseek2): latent attention, a router with a bias for the choice
# (the converter renames e_score_correction_bias to e_score_correction.bias first), shared
# experts without a gate; its kv_b_proj is split in two (see hf_to_gguf.split_kv_b)
_DEEPSEEK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",
    "mlp.gate.e_score_correction": "exp_probs_b",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
# Qwen3.5 (llama.cpp's qwen35, qwen35moe): Gated DeltaNet layers beside gated attention, its
# MLP's norm named as Gemma's; devtools.gguf_qwen35 changes the tensors first
_QWEN35 = {
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_proj": "ssm_dt",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
    "post_attention_layernorm": "post_attention_norm",
}
# Gemma 4 (llama.cpp's gemma4): per-layer inputs, a layer scalar, the mixture's second norms,
# router (its scale: ffn_gate_inp.scale) and stacked experts; devtools.gguf_gemma4 renames first
_GEMMA4 = {
    "per_layer_input_gate": "inp_gate",
    "per_layer_projection": "proj",
    "post_per_layer_input_norm": "post_norm",
    "layer_scalar": "layer_output_scale",
    "post_feedforward_layernorm_1": "post_ffw_norm_1",
    "pre_feedforward_layernorm_2": "pre_ffw_norm_2",
    "post_feedforward_layernorm_2": "post_ffw_norm_2",
    "router.proj": "ffn_gate_inp",
    "router": "ffn_gate_inp",
    "experts.gate_up_proj": "ffn_gate_up_exps",
    "experts.down_proj": "ffn_down_exps",
}
# llama.cpp keeps these F32 whatever the file's type (as llama-quantize does)
ALWAYS_F32 = frozenset({"ffn_gate_inp", "ffn_gate_inp_shexp"})


@dataclass(frozen=True)
class Experts:
    """A checkpoint's routed experts, one tensor per expert under `model.layers.{i}.{prefix}.
    {x}.{w}.weight`, and the 3-D tensors llama.cpp stacks them into ([expert, rows, columns],
    expert 0 first), in the order it writes them: once the block's last expert tensor is read."""

    prefix: str
    stacked: tuple[tuple[str, str], ...]  # (w, GGUF name)


_MIXTRAL_EXPERTS = Experts(
    "block_sparse_moe.experts",
    (("w1", "ffn_gate_exps"), ("w2", "ffn_down_exps"), ("w3", "ffn_up_exps")),
)
_QWEN_EXPERTS = Experts(
    "mlp.experts",
    (("down_proj", "ffn_down_exps"), ("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps")),
)


@dataclass(frozen=True)
class Family:
    arch: str  # general.architecture
    block_names: dict[str, str]
    # llama.cpp's "normal" RoPE rotates adjacent pairs where Hugging Face rotates the two
    # halves of a head; the converter interleaves q/k rows (weights and biases) to match
    permute_qk: bool = False
    # Gemma's RMSNorm multiplies by (1 + w); llama.cpp stores 1 + w, every `*norm.weight`
    norm_plus_one: bool = False
    # llama.cpp drops lm_head for Gemma (it always ties it to the embedding)
    must_tie: bool = False
    # which optional keys llama.cpp writes for this family (see hf_to_gguf.family_fields)
    fields: frozenset[str] = field(default_factory=frozenset)
    experts: Experts | None = None
    # whether llama.cpp rescales the top-k router weights to sum to 1; it stores no key for it
    # but fixes it per architecture, so a checkpoint that differs is refused
    renormalises: bool | None = None
    latent: bool = False  # DeepSeek's latent attention: kv_b_proj split, its own keys
    delta: bool = False  # Qwen3.5's Gated DeltaNet: devtools.gguf_qwen35's keys and tensors
    sinks: bool = False  # gpt-oss: devtools.gguf_gptoss's checks, key and tensors
    gemma4: bool = False  # devtools.gguf_gemma4's keys and tensors


FAMILIES = {
    "llama": Family(
        "llama",
        _ATTENTION | _LLAMA_NORMS | _MLP,
        permute_qk=True,
        fields=frozenset({"head_dim", "rope_dims", "vocab_size", "llama3_rope"}),
    ),
    # llama.cpp converts Mistral as a Llama (and drops its sliding window: see hf_to_gguf)
    "mistral": Family(
        "llama",
        _ATTENTION | _LLAMA_NORMS | _MLP,
        permute_qk=True,
        fields=frozenset({"head_dim", "rope_dims", "vocab_size", "sliding_window"}),
    ),
    "qwen2": Family("qwen2", _ATTENTION | _LLAMA_NORMS | _MLP, fields=frozenset({"head_dim"})),
    "qwen3": Family(
        "qwen3", _ATTENTION | _QK_NORMS | _LLAMA_NORMS | _MLP, fields=frozenset({"head_dim"})
    ),
    "gemma2": Family(
        "gemma2",
        _ATTENTION | _GEMMA_NORMS | _MLP,
        norm_plus_one=True,
        must_tie=True,
        fields=frozenset({"head_dim", "sliding_window", "softcaps"}),
    ),
    "gemma3": Family(
        "gemma3",
        _ATTENTION | _QK_NORMS | _GEMMA_NORMS | _MLP,
        norm_plus_one=True,
        must_tie=True,
        fields=frozenset({"head_dim", "sliding_window", "final_softcap", "rope_swa"}),
    ),
    "phi3": Family(
        "phi3", _PHI3, fields=frozenset({"rope_dims", "sliding_window", "rope_orig_ctx"})
    ),
    # llama.cpp converts Mixtral as a Llama with experts (and drops its window, as Mistral's)
    "mixtral": Family(
        "llama",
        _ATTENTION | _LLAMA_NORMS | _MIXTRAL_ROUTER,
        permute_qk=True,
        fields=frozenset({"head_dim", "rope_dims", "vocab_size", "sliding_window"}),
        experts=_MIXTRAL_EXPERTS,
        renormalises=True,
    ),
    "qwen3_moe": Family(
        "qwen3moe",
        _ATTENTION | _QK_NORMS | _LLAMA_NORMS | _QWEN_ROUTER,
        fields=frozenset({"head_dim", "expert_widths"}),
        experts=_QWEN_EXPERTS,
        renormalises=True,
    ),
    "qwen2_moe": Family(
        "qwen2moe",
        _ATTENTION | _LLAMA_NORMS | _QWEN_ROUTER | _SHARED_EXPERT,
        fields=frozenset({"head_dim", "expert_widths"}),
        experts=_QWEN_EXPERTS,
        renormalises=False,
    ),
    "deepseek_v3": Family(
        "deepseek2", _DEEPSEEK | _MLP, fields=frozenset(), experts=_QWEN_EXPERTS, latent=True
    ),
    "gemma4": Family(
        "gemma4",
        _ATTENTION | _QK_NORMS | _GEMMA_NORMS | _MLP | _GEMMA4,
        must_tie=True,
        fields=frozenset({"head_dim"}),
        gemma4=True,
    ),
    "qwen3_5": Family("qwen35", _ATTENTION | _QK_NORMS | _MLP | _QWEN35, delta=True),
    "qwen3_5_moe": Family(
        "qwen35moe",
        _ATTENTION | _QK_NORMS | _QWEN35 | _QWEN_ROUTER | _SHARED_EXPERT,
        fields=frozenset({"expert_widths"}),
        experts=_QWEN_EXPERTS,
        renormalises=True,
        delta=True,
    ),
    # gpt-oss: the MLP's norm named as Gemma's post-attention one; experts: gguf_gptoss
    "gpt_oss": Family(
        "gpt-oss",
        _ATTENTION | {"post_attention_layernorm": "post_attention_norm"},
        fields=frozenset({"head_dim", "sliding_window"}),
        sinks=True,
    ),
}

# a checkpoint's config.json `architectures[0]` -> family
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Gemma4ForCausalLM": "gemma4",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "GptOssForCausalLM": "gpt_oss",
}

# llama.cpp fixes these and stores none of them; a checkpoint that differs is refused
GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}  # every n-th layer is full, the others slide
GEMMA2_ROPE_THETA = 10_000.0
GEMMA3_LOCAL_ROPE_THETA = 10_000.0


def gguf_name(family: Family, hf_name: str) -> str:
    """The GGUF name of a Hugging Face tensor; KeyError for one llama.cpp does not convert."""
    hf_name = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
    stem, _, suffix = hf_name.rpartition(".")
    if suffix == "A_log":  # Qwen3.5's, llama.cpp's blk.N.ssm_a: no suffix either
        stem, suffix = hf_name, ""
    if stem in TOP_NAMES:
        return f"{TOP_NAMES[stem]}.{suffix}"
    prefix, _, rest = stem.partition(".layers.")
    block, _, local = rest.partition(".")
    if prefix != "model" or not block.isdigit() or local not in family.block_names:
        raise KeyError(f"{hf_name}: no GGUF name for it in family {family.arch!r}")
    return f"blk.{block}.{family.block_names[local]}" + (f".{suffix}" if suffix else "")


def expert_slot(family: Family, hf_name: str) -> tuple[int, int, str] | None:
    """(block, expert, w) of a per-expert checkpoint tensor of `family`, None for any other."""
    if family.experts is None or not hf_name.startswith("model.layers."):
        return None
    block, _, local = hf_name.removeprefix("model.layers.").partition(".")
    rest = local.removeprefix(family.experts.prefix + ".")
    expert, _, w = rest.removesuffix(".weight").partition(".")
    known = {w for w, _ in family.experts.stacked}
    if rest == local or not (block.isdigit() and expert.isdigit()) or w not in known:
        return None
    return int(block), int(expert), w
