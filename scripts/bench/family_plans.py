"""Per family, a GGUF file's plan at a real model's layer shapes: the architecture, the metadata
keys and the tensors (names, numpy shapes, types) as llama.cpp's converter writes them, for
scripts/synthetic_gguf.py's write_plan to fill with random weights. Each plan takes the file's
layer count and a `shrink` that divides widths and head counts (tests write small files).

Shapes are the named model's (Llama-3-8B, Qwen3-8B, Gemma-3-12B, Phi-3-medium, Mixtral-8x7B,
DeepSeek-V3's attention with 8 of its experts, gpt-oss-20b; Qwen3.5 and Gemma 4 at widths their
docstrings give); the vocabulary is small (the benchmark times layers). Matrices are Q4_K (what
Q4_K_M gives most of them; it puts Q6_K on some attn_v and ffn_down, not here), norms and
routers F32; a matrix whose rows are not a multiple of 256 takes Q8_0, as llama.cpp's quantizer
falls back; gpt-oss's as its published file. The output head is left out (tied to the
embeddings) where llama.cpp allows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Q, F32 = "Q4_K", "F32"
VOCAB = 4096


@dataclass(frozen=True)
class Plan:
    name: str
    arch: str
    fields: dict  # keys without the "{arch}." prefix (but "general.*")
    tensors: list[tuple[str, tuple[int, ...], str]] = field(default_factory=list)
    vocab: int = VOCAB
    note: str = ""  # what the benchmark's layer is, where the family has several kinds
    sizes: tuple[int, int] = (1, 2)  # the benchmark's files' layer counts: it times the last


def _shrunk(shrink: int, *widths: int) -> tuple[int, ...]:
    """Widths and head counts divided by `shrink` (at least 1 each; head widths stay), for
    the plans' tests: small files of the same names and kinds of shape."""
    return tuple(max(1, w // shrink) for w in widths)


def _common(layers: int, hidden: int, inter: int, heads: int, kv: int, head_dim: int, **more):
    return {
        "block_count": layers,
        "context_length": 8192,
        "embedding_length": hidden,
        "feed_forward_length": inter,
        "attention.head_count": heads,
        "attention.head_count_kv": kv,
        "rope.dimension_count": head_dim,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "vocab_size": VOCAB,
        "general.file_type": 15,  # MOSTLY_Q4_K_M
        **more,
    }


def _attention(p: str, hidden: int, heads: int, kv: int, head_dim: int, qk_norm: bool):
    out = [
        (p + "attn_norm.weight", (hidden,), F32),
        (p + "attn_q.weight", (heads * head_dim, hidden), Q),
        (p + "attn_k.weight", (kv * head_dim, hidden), Q),
        (p + "attn_v.weight", (kv * head_dim, hidden), Q),
        (p + "attn_output.weight", (hidden, heads * head_dim), Q),
    ]
    if qk_norm:
        out += [(p + "attn_q_norm.weight", (head_dim,), F32)]
        out += [(p + "attn_k_norm.weight", (head_dim,), F32)]
    return out


def _mlp(p: str, hidden: int, inter: int):
    return [
        (p + "ffn_norm.weight", (hidden,), F32),
        (p + "ffn_gate.weight", (inter, hidden), Q),
        (p + "ffn_up.weight", (inter, hidden), Q),
        (p + "ffn_down.weight", (hidden, inter), Q),
    ]


def _experts(p: str, hidden: int, inter: int, experts: int, suffix: str = "exps"):
    return [
        (p + f"ffn_gate_{suffix}.weight", (experts, inter, hidden), Q),
        (p + f"ffn_up_{suffix}.weight", (experts, inter, hidden), Q),
        (p + f"ffn_down_{suffix}.weight", (experts, hidden, inter), Q),
    ]


def _ends(hidden: int, blocks: list) -> list:
    return [
        ("token_embd.weight", (VOCAB, hidden), Q),
        *blocks,
        ("output_norm.weight", (hidden,), F32),
    ]


def llama(layers: int, shrink: int = 1) -> Plan:
    h, i, heads, kv, d = *_shrunk(shrink, 4096, 14336, 32, 8), 128
    blocks = []
    for b in range(layers):
        blocks += _attention(f"blk.{b}.", h, heads, kv, d, False) + _mlp(f"blk.{b}.", h, i)
    fields = _common(layers, h, i, heads, kv, d, **{"rope.freq_base": 500000.0})
    return Plan("llama-3-8b", "llama", fields, _ends(h, blocks))


def qwen3(layers: int, shrink: int = 1) -> Plan:
    h, i, heads, kv, d = *_shrunk(shrink, 4096, 12288, 32, 8), 128
    blocks = []
    for b in range(layers):
        blocks += _attention(f"blk.{b}.", h, heads, kv, d, True) + _mlp(f"blk.{b}.", h, i)
    more = {"rope.freq_base": 1e6, "attention.key_length": d, "attention.value_length": d}
    fields = _common(layers, h, i, heads, kv, d, **more)
    fields["attention.layer_norm_rms_epsilon"] = 1e-6
    return Plan("qwen3-8b", "qwen3", fields, _ends(h, blocks))


def gemma3(layers: int, shrink: int = 1) -> Plan:
    h, i, heads, kv, d = *_shrunk(shrink, 3840, 15360, 16, 8), 256
    blocks = []
    for b in range(layers):
        p = f"blk.{b}."
        blocks += _attention(p, h, heads, kv, d, True)
        blocks += [(p + "post_attention_norm.weight", (h,), F32)]
        blocks += _mlp(p, h, i) + [(p + "post_ffw_norm.weight", (h,), F32)]
    more = {
        "rope.freq_base": 1e6,
        "attention.key_length": d,
        "attention.value_length": d,
        "attention.sliding_window": 1024,
    }
    fields = _common(layers, h, i, heads, kv, d, **more)
    fields["attention.layer_norm_rms_epsilon"] = 1e-6
    note = "a sliding layer (every 6th is full; at short context they cost the same)"
    return Plan("gemma-3-12b", "gemma3", fields, _ends(h, blocks), note=note)


def phi3(layers: int, shrink: int = 1) -> Plan:
    h, i, heads, kv, d = *_shrunk(shrink, 5120, 17920, 40, 10), 128
    blocks = []
    for b in range(layers):
        p = f"blk.{b}."
        blocks += [
            (p + "attn_norm.weight", (h,), F32),
            (p + "attn_qkv.weight", ((heads + 2 * kv) * d, h), Q),
            (p + "attn_output.weight", (h, heads * d), Q),
            (p + "ffn_norm.weight", (h,), F32),
            (p + "ffn_up.weight", (2 * i, h), Q),  # gate and up, fused
            (p + "ffn_down.weight", (h, i), Q),
        ]
    more = {"rope.freq_base": 10000.0, "rope.scaling.original_context_length": 4096}
    fields = _common(layers, h, i, heads, kv, d, **more)
    fields["context_length"] = 4096
    # not "phi-3"/"phi3": llama.cpp then looks up Phi-3's special tokens in the vocabulary
    return Plan("Phi 3 medium shaped", "phi3", fields, _ends(h, blocks))


def mixtral(layers: int, shrink: int = 1) -> Plan:
    h, i, heads, kv, d, experts = *_shrunk(shrink, 4096, 14336, 32, 8), 128, 8
    blocks = []
    for b in range(layers):
        p = f"blk.{b}."
        blocks += _attention(p, h, heads, kv, d, False) + [(p + "ffn_norm.weight", (h,), F32)]
        blocks += [(p + "ffn_gate_inp.weight", (experts, h), F32)]
        blocks += _experts(p, h, i, experts)
    more = {"rope.freq_base": 1e6, "expert_count": experts, "expert_used_count": 2}
    fields = _common(layers, h, i, heads, kv, d, **more)
    return Plan("mixtral-8x7b", "llama", fields, _ends(h, blocks), note="top 2 of 8 experts")


def deepseek(layers: int, shrink: int = 1) -> Plan:
    """DeepSeek-V3's layer (hidden 7168, 128 heads, q rank 1536, latent 512 + 64 rotated, nope
    128, v 128) with 8 routed experts of 2048 (V3 has 256), top 8 in one group, 1 shared: a
    token runs as many experts as in V3, every one of the 8 here. Every layer a mixture
    (leading dense blocks 0). Keys as devtools/gguf_latent.py writes them."""
    h, heads, q_rank, inter, moe_inter = _shrunk(shrink, 7168, 128, 1536, 18432, 2048)
    rank, rope, nope, v, experts, used = 512, 64, 128, 128, 8, 8
    blocks = []
    for b in range(layers):
        p = f"blk.{b}."
        blocks += [
            (p + "attn_norm.weight", (h,), F32),
            (p + "attn_q_a.weight", (q_rank, h), Q),
            (p + "attn_q_a_norm.weight", (q_rank,), F32),
            (p + "attn_q_b.weight", (heads * (nope + rope), q_rank), Q),
            (p + "attn_kv_a_mqa.weight", (rank + rope, h), Q),
            (p + "attn_kv_a_norm.weight", (rank,), F32),
            (p + "attn_k_b.weight", (heads, rank, nope), "Q8_0"),  # rows of 128
            (p + "attn_v_b.weight", (heads, v, rank), Q),
            (p + "attn_output.weight", (h, heads * v), Q),
            (p + "ffn_norm.weight", (h,), F32),
            (p + "ffn_gate_inp.weight", (experts, h), F32),
            (p + "exp_probs_b.bias", (experts,), F32),
            *_experts(p, h, moe_inter, experts),
            *_experts(p, h, moe_inter, 1, "shexp"),
        ]
    # shared experts are 2-D in llama.cpp's files: [rows, columns]
    blocks = [(n, s[1:] if "shexp" in n else s, t) for n, s, t in blocks]
    fields = _common(layers, h, inter, heads, 1, rope, **{"rope.freq_base": 10000.0})
    fields |= {
        "attention.layer_norm_rms_epsilon": 1e-6,
        "leading_dense_block_count": 0,
        "attention.kv_lora_rank": rank,
        "attention.q_lora_rank": q_rank,
        "attention.key_length": rank + rope,
        "attention.value_length": rank,
        "attention.key_length_mla": nope + rope,
        "attention.value_length_mla": v,
        "expert_feed_forward_length": moe_inter,
        "expert_count": experts,
        "expert_used_count": used,
        "expert_shared_count": 1,
        "expert_gating_func": 2,  # sigmoid
        "expert_group_count": 1,
        "expert_group_used_count": 1,
        "expert_weights_scale": 2.5,
        "expert_weights_norm": True,
    }
    note = "latent attention, top 8 of 8 experts + 1 shared"
    return Plan("deepseek-v3-layer", "deepseek2", fields, _ends(h, blocks), note=note)


def gpt_oss(layers: int, shrink: int = 1) -> Plan:
    """gpt-oss-20b's layer (hidden 2880, 64 heads of 64, 8 kv heads, 32 experts of 2880, top
    4, q/k/v/o and expert biases, sinks; sliding and full by turns) as its published GGUF holds
    it: experts MXFP4, the rest Q8_0 (2880 is no multiple of Q4_K's 256); an output head, which
    llama.cpp requires for this architecture."""
    h, heads, kv, experts, used = *_shrunk(shrink, 2880, 64, 8), 32, 4
    d, i = 64, h
    blocks = []
    for b in range(layers):
        p = f"blk.{b}."
        blocks += [(p + "attn_norm.weight", (h,), F32)]
        for n, rows in (("q", heads * d), ("k", kv * d), ("v", kv * d)):
            blocks += [(p + f"attn_{n}.weight", (rows, h), "Q8_0")]
            blocks += [(p + f"attn_{n}.bias", (rows,), F32)]
        blocks += [
            (p + "attn_output.weight", (h, heads * d), "Q8_0"),
            (p + "attn_output.bias", (h,), F32),
            (p + "attn_sinks.weight", (heads,), F32),
            (p + "post_attention_norm.weight", (h,), F32),
            (p + "ffn_gate_inp.weight", (experts, h), F32),
            (p + "ffn_gate_inp.bias", (experts,), F32),
        ]
        for n, shape in _ffn_shapes(h, i):
            blocks += [(p + f"ffn_{n}_exps.weight", (experts, *shape), "MXFP4")]
            blocks += [(p + f"ffn_{n}_exps.bias", (experts, shape[0]), F32)]
    fields = _common(layers, h, i, heads, kv, d, **{"rope.freq_base": 150000.0})
    fields |= {
        "attention.key_length": d,
        "attention.value_length": d,
        "attention.sliding_window": 128,
        "expert_count": experts,
        "expert_used_count": used,
        "expert_feed_forward_length": i,
        "rope.scaling.type": "yarn",
        "rope.scaling.factor": 32.0,
        "rope.scaling.original_context_length": 4096,
        "general.file_type": 38,  # MOSTLY_MXFP4_MOE
    }
    tensors = [*_ends(h, blocks), ("output.weight", (VOCAB, h), "Q8_0")]
    tensors[0] = ("token_embd.weight", (VOCAB, h), "Q8_0")
    note = "a full layer, top 4 of 32 MXFP4 experts"
    return Plan("gpt-oss-20b-layer", "gpt-oss", fields, tensors, note=note)


def gemma4(layers: int, shrink: int = 1) -> Plan:
    """Gemma 4's pieces at Gemma-3-12B's widths (hidden 3840, MLP 15360, 16 heads, 8 kv heads
    of 256; the full layers' heads 512 wide): per-layer inputs 256 wide (their table, the
    embeddings' projection and each layer's gate, projection and norm), a layer output scale.
    The first layer is full (llama.cpp refuses a file whose rope_freqs no layer uses), the rest
    sliding; the files are of 2 and 3 layers, the third, sliding, timed; no KV is shared. Keys
    and names as devtools/gguf_gemma4.py writes them (per-layer arrays, rope_freqs)."""
    h, i, heads, kv = _shrunk(shrink, 3840, 15360, 16, 8)
    d, d_full, pl = 256, 512, 256
    blocks = []
    for b in range(layers):
        p = f"blk.{b}."
        blocks += _attention(p, h, heads, kv, d if b else d_full, True)
        blocks += [(p + "post_attention_norm.weight", (h,), F32)]
        blocks += _mlp(p, h, i) + [(p + "post_ffw_norm.weight", (h,), F32)]
        blocks += [
            (p + "inp_gate.weight", (pl, h), Q),
            (p + "proj.weight", (h, pl), Q),
            (p + "post_norm.weight", (h,), F32),
            (p + "layer_output_scale.weight", (1,), F32),
        ]
    fields = _common(layers, h, i, heads, kv, d_full, **{"rope.freq_base": 1e6})
    fields |= {
        "feed_forward_length": [i] * layers,
        "attention.head_count_kv": [kv] * layers,
        "attention.layer_norm_rms_epsilon": 1e-6,
        "attention.key_length": d_full,
        "attention.value_length": d_full,
        "attention.key_length_swa": d,
        "attention.value_length_swa": d,
        "rope.dimension_count_swa": d,
        "rope.freq_base_swa": 10000.0,
        "attention.shared_kv_layers": 0,
        "embedding_length_per_layer_input": pl,
        "attention.sliding_window_pattern": [False] + [True] * (layers - 1),
        "attention.sliding_window": 1024,
        "final_logit_softcapping": 30.0,
    }
    tensors = _ends(h, blocks) + [
        ("per_layer_token_embd.weight", (VOCAB, layers * pl), Q),
        ("per_layer_model_proj.weight", (layers * pl, h), Q),
        ("per_layer_proj_norm.weight", (pl,), F32),
        ("rope_freqs.weight", (d_full // 2,), F32),
    ]
    note = "a sliding layer with its per-layer input"
    return Plan("gemma4-12b-widths", "gemma4", fields, tensors, note=note, sizes=(2, 3))


def _delta_block(p: str, h: int, k_heads: int, v_heads: int, k_dim: int, v_dim: int, kernel: int):
    channels = 2 * k_heads * k_dim + v_heads * v_dim
    return [
        (p + "attn_qkv.weight", (channels, h), Q),
        (p + "attn_gate.weight", (v_heads * v_dim, h), Q),
        (p + "ssm_beta.weight", (v_heads, h), F32),
        (p + "ssm_alpha.weight", (v_heads, h), F32),
        (p + "ssm_conv1d.weight", (channels, kernel), F32),
        (p + "ssm_a", (v_heads,), F32),
        (p + "ssm_dt.bias", (v_heads,), F32),
        (p + "ssm_norm.weight", (v_dim,), F32),
        (p + "ssm_out.weight", (h, v_heads * v_dim), Q),
    ]


def qwen3_5(layers: int, shrink: int = 1) -> Plan:
    """Gated DeltaNet layers at hidden 4096 with Qwen3-Next's linear widths (16 q/k heads of
    128, 32 value heads of 128, conv 4). Every 2nd layer full (gated) attention, not every 4th
    as the real models: llama.cpp cannot run a file with no attention layer (its hybrid cache
    has no KV buffer), so the files are of 2 layers (DeltaNet, full) and 3, and the third, a
    DeltaNet layer, is timed. Keys as devtools/gguf_qwen35.py writes them."""
    h, i, heads, kv, k_heads, v_heads = _shrunk(shrink, 4096, 12288, 16, 4, 16, 32)
    d = 256
    blocks = []
    for b in range(layers):
        p = f"blk.{b}."
        blocks += [(p + "attn_norm.weight", (h,), F32)]
        if (b + 1) % 2:
            blocks += _delta_block(p, h, k_heads, v_heads, 128, 128, 4)
        else:  # q_proj makes each head's query and its output gate
            blocks += [
                (p + "attn_q.weight", (heads * d * 2, h), Q),
                (p + "attn_k.weight", (kv * d, h), Q),
                (p + "attn_v.weight", (kv * d, h), Q),
                (p + "attn_output.weight", (h, heads * d), Q),
                (p + "attn_q_norm.weight", (d,), F32),
                (p + "attn_k_norm.weight", (d,), F32),
            ]
        blocks += [(p + "post_attention_norm.weight", (h,), F32)]
        blocks += [(p + f"ffn_{n}.weight", s, Q) for n, s in _ffn_shapes(h, i)]
    fields = _common(layers, h, i, heads, kv, d // 4, **{"rope.freq_base": 1e7})
    fields |= {
        "attention.layer_norm_rms_epsilon": 1e-6,
        "ssm.conv_kernel": 4,
        "ssm.state_size": 128,
        "ssm.group_count": k_heads,
        "ssm.time_step_rank": v_heads,
        "ssm.inner_size": v_heads * 128,
        "full_attention_interval": 2,
        "rope.dimension_sections": [11, 11, 10, 0],
        "attention.key_length": d,
        "attention.value_length": d,
    }
    note = "a Gated DeltaNet layer"
    return Plan("qwen3.5-delta", "qwen35", fields, _ends(h, blocks), note=note, sizes=(2, 3))


def _ffn_shapes(h: int, i: int):
    return [("gate", (i, h)), ("up", (i, h)), ("down", (h, i))]


PLANS = {
    "llama": llama,
    "qwen3": qwen3,
    "gemma3": gemma3,
    "phi3": phi3,
    "mixtral": mixtral,
    "deepseek_v3": deepseek,
    "qwen3_5": qwen3_5,
    "gpt_oss": gpt_oss,
    "gemma4": gemma4,
}
