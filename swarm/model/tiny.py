"""Tiny random-weight models for tests, fuzzing and benchmarks (no download; seconds to make).

`save_tiny_llama` is the Llama every swarm test uses; `save_tiny` makes one of each family the
node computes, each with the switches that set its family apart turned on (sliding windows that
short prompts run past, softcaps, q/k norms, fused projections), and one of each
mixture-of-experts family (MOE_FAMILIES: 8 experts, routers that spread a prompt over them)."""

from __future__ import annotations

import warnings
from os import PathLike

import torch

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def save_tiny_llama(directory: str | PathLike, seed: int = 0, **config):
    """Save a random tiny Llama as a Hugging Face safetensors folder; returns the model.
    `config` overrides TINY's fields (a longer context, say).

    Random init is tiny, so its 2-D weights are scaled up 8x: greedy decoding is then not
    dominated by near-ties, and token-for-token comparisons are meaningful."""
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **config}))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    model.save_pretrained(directory, safe_serialization=True)
    return model.eval()


def reference_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation of `ids` by an unsplit transformers model, EOS ignored."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(ids) :].tolist()


# the chat template of the tiny model: roles in plain text, so prompts tokenize to known pieces
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def save_tiny_tokenizer(directory: str | PathLike, seed: int = 0) -> None:
    """Save a BPE tokenizer of exactly TINY's vocabulary (with a chat template) beside a tiny
    model, so the text paths (chat template, stop strings, the HTTP API) run on it.

    Trained on made-up words: every id decodes to printable text, so a random model's reply
    is readable text, never a broken byte sequence."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    syllables = [a + b for a in "bdfgklmnprstvz" for b in "aeiou"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(400)]
    corpus = [" ".join(rng.choices(words, k=12)) + rng.choice(".,!?") for _ in range(400)]
    corpus.append("<|system|>\n<|user|>\n<|assistant|>\n0123456789 abcdefghijklmnopqrstuvwxyz")
    corpus.append("ABCDEFGHIJKLMNOPQRSTUVWXYZ '\"-:;()/")
    specials = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: TINY's bos and eos
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=TINY["vocab_size"], special_tokens=specials)
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() == TINY["vocab_size"], tok.get_vocab_size()
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=TINY_CHAT_TEMPLATE,
    ).save_pretrained(directory)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")
LATENT_FAMILIES = ("deepseek_v3",)
SINK_FAMILIES = ("gpt_oss",)
DELTA_FAMILIES = ("qwen3_5", "qwen3_5_moe")
PER_LAYER_FAMILIES = ("gemma4",)

# Shared by every family: TINY's shape, and the ids of save_tiny_tokenizer's <unk>, <s>, </s>.
_SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def gemma_layer_types(layers: int, pattern: int = 6) -> list[str]:
    """Gemma's layers: `pattern - 1` sliding ones, then a full one, over and over. llama.cpp
    assumes exactly this (pattern 2 for Gemma 2, 6 for Gemma 3) and stores no per-layer list."""
    return [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
    ]


def _family_config(family: str, layers: int) -> dict:
    """What sets the family apart, on top of _SHAPE; every value here is a switch its GGUF
    conversion has to carry (or that llama.cpp assumes, as Gemma's attention scale)."""
    if family == "llama":
        return dict(rope_theta=10000.0, rms_norm_eps=1e-5)
    if family == "gemma4":
        return _gemma4_config()
    if family == "mistral":
        # head_dim apart from hidden/heads, as Mistral Nemo has; a window short prompts pass
        return dict(head_dim=32, sliding_window=16, rope_theta=10000.0, rms_norm_eps=1e-5)
    if family == "qwen2":
        return dict(rope_theta=10000.0, rms_norm_eps=1e-6, use_sliding_window=False)
    if family == "qwen3":
        return dict(head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-6, use_sliding_window=False)
    gemma = dict(
        head_dim=32,
        # llama.cpp scales Gemma's scores by 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the
        # 27B only) and stores no scalar: the tiny models use that one
        query_pre_attn_scalar=32,
        sliding_window=8,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    )
    if family == "gemma2":
        # caps low enough to bite on the tiny model's scores and logits
        return gemma | dict(
            rope_theta=10000.0, attn_logit_softcapping=5.0, final_logit_softcapping=3.0
        )
    if family == "gemma3":
        rope = {
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        }
        return gemma | dict(rope_parameters=rope, layer_types=gemma_layer_types(layers))
    if family == "phi3":
        return dict(
            sliding_window=16,
            original_max_position_embeddings=512,  # short context: no longrope factors
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
        )
    if family in MOE_FAMILIES:
        return _moe_config(family)
    if family == "deepseek_v3":
        return _deepseek_config()
    if family == "gpt_oss":
        return _gptoss_config()
    if family in DELTA_FAMILIES:
        return _qwen35_config(family)
    known = FAMILIES + MOE_FAMILIES + LATENT_FAMILIES + SINK_FAMILIES + DELTA_FAMILIES
    known += PER_LAYER_FAMILIES
    raise ValueError(f"unknown family {family!r}; one of {', '.join(known)}")


def _deepseek_config() -> dict:
    """DeepSeek-V3's switches, small: a q bottleneck, a latent of 32 beside 8 rotated dims,
    nope (16), v (24) and the bottlenecks' widths all apart, so a reader that takes one for
    another fails on a shape; 4 layers, the first dense; 8 experts in 4 groups (the best 2
    groups kept), top 3 renormalised and scaled by 2.5; 2 shared experts; YaRN past an original
    context of 32 with DeepSeek's mscale pair (what llama.cpp's converter writes: mscale ==
    mscale_all_dim); the router's scoring as config.json states it (llama.cpp reads it)."""
    yarn = dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=32,
        mscale=1.0,
        mscale_all_dim=1.0,
        beta_fast=32.0,
        beta_slow=1.0,
    )
    return dict(
        num_hidden_layers=4,
        num_key_value_heads=4,  # DeepSeek's: every head its own k and v
        q_lora_rank=40,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        n_routed_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters=yarn,
        rms_norm_eps=1e-6,  # transformers norms the latents at 1e-6 whatever it says
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        num_nextn_predict_layers=0,
    )


def gptoss_yarn() -> dict:
    """The tiny gpt-oss's YaRN: past an original context of 32, its ramp's ends unrounded as
    gpt-oss's own are (truncate false)."""
    return dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=4.0,
        original_max_position_embeddings=32,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
    )


def _gptoss_config() -> dict:
    """gpt-oss's switches, small: 4 layers, sliding (window 8, which the prompt passes) and full
    by turns; head_dim apart from hidden/heads; top 3 of 8 experts 32 wide; the clamp low
    enough to bite (2.0: the tiny model's gates reach past it); YaRN past an original
    context of 32, not truncated (gpt-oss's)."""
    return dict(
        num_hidden_layers=4,
        head_dim=32,
        num_local_experts=8,
        num_experts_per_tok=3,
        intermediate_size=32,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters=gptoss_yarn(),
        swiglu_limit=2.0,
        rms_norm_eps=1e-5,
    )


def _qwen35_config(family: str) -> dict:
    """Qwen3.5's switches, small: 6 layers, Gated DeltaNet but for every third (full, gated
    attention, a quarter of each head turned by RoPE); 2 q/k heads of 16 serving 4 value heads
    of 24 (every width apart); the MoE's 8 experts top 3 beside a gated shared expert."""
    out = dict(
        head_dim=32,
        full_attention_interval=3,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=24,
        rms_norm_eps=1e-6,
    )
    if family == "qwen3_5_moe":
        out |= dict(
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
        )
    return out


def _gemma4_config() -> dict:
    """Gemma 4's switches, small: 6 layers, sliding (window 8) and full by turns, the full ones
    with their own head width (48) and one kv head, keys as values; the last 2 layers reading
    layers 2's and 3's KV, their MLP double wide; per-layer inputs 16 wide; a final softcap
    low enough to bite; transformers' default RoPE (proportional on the full layers)."""
    return dict(
        num_hidden_layers=6,
        head_dim=32,
        global_head_dim=48,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=512,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 3,
        final_logit_softcapping=10.0,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    )


def _moe_config(family: str) -> dict:
    """Qwen's widths (routed experts, shared expert, dense `intermediate_size` 128) all
    differ, so a reader that takes one for another fails on a shape; Mixtral's experts are
    `intermediate_size` wide. Every layer routes, as in every such checkpoint on the Hub and as
    llama.cpp computes them: `mlp_only_layers=[i]` makes a Qwen's layer i a dense MLP in
    transformers (a checkpoint write_gguf refuses)."""
    if family == "mixtral":
        # top-2 of 8, renormalised; experts as wide as `intermediate_size`; a short window
        return dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=16,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
        )
    if family == "qwen3_moe":
        # renormalised top-k as Qwen3-30B-A3B has it (transformers' default is not to)
        return dict(
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=96,
            norm_topk_prob=True,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
        )
    # qwen2_moe: top-4 of 8 as Qwen1.5-MoE (4 of 60), not renormalised; a gated shared expert
    return dict(
        num_experts=8,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=96,
        norm_topk_prob=False,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
    )


def _family_classes(family: str):
    import transformers as t

    return {
        "llama": (t.LlamaConfig, t.LlamaForCausalLM),
        "mistral": (t.MistralConfig, t.MistralForCausalLM),
        "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM),
        "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM),
        "gemma2": (t.Gemma2Config, t.Gemma2ForCausalLM),
        "gemma3": (t.Gemma3TextConfig, t.Gemma3ForCausalLM),
        "phi3": (t.Phi3Config, t.Phi3ForCausalLM),
        "mixtral": (t.MixtralConfig, t.MixtralForCausalLM),
        "qwen3_moe": (t.Qwen3MoeConfig, t.Qwen3MoeForCausalLM),
        "qwen2_moe": (t.Qwen2MoeConfig, t.Qwen2MoeForCausalLM),
        "deepseek_v3": (t.DeepseekV3Config, t.DeepseekV3ForCausalLM),
        "gpt_oss": (t.GptOssConfig, t.GptOssForCausalLM),
        "qwen3_5": (t.Qwen3_5TextConfig, t.Qwen3_5ForCausalLM),
        "qwen3_5_moe": (t.Qwen3_5MoeTextConfig, t.Qwen3_5MoeForCausalLM),
        "gemma4": (t.Gemma4TextConfig, t.Gemma4ForCausalLM),
    }[family]


def tiny_config(family: str, **config):
    """The transformers config `save_tiny` builds: _SHAPE, the family's switches, `config`."""
    layers = config.get("num_hidden_layers", _SHAPE["num_hidden_layers"])
    fields = {**_SHAPE, **_family_config(family, layers), **config}
    if family in ("gemma2", "gemma3") and "query_pre_attn_scalar" not in config:
        fields["query_pre_attn_scalar"] = fields["head_dim"]  # see _family_config
    config_class, _ = _family_classes(family)
    return config_class(**fields)


def save_tiny(family: str, directory: str | PathLike, seed: int = 0, **config):
    """Save a random tiny model of `family` (one of FAMILIES or MOE_FAMILIES) as a Hugging Face
    safetensors folder; returns it in eval mode, float32. `config` overrides any config field.

    As in save_tiny_llama, 2-D weights are scaled up 8x so greedy decoding is not near-ties, and
    so are the experts, 3-D [expert, rows, columns] in the model (the folder holds one tensor
    per expert, as transformers saves them and as Hub checkpoints have them).
    Norm weights and biases are random too (not 1 and 0), so a reader that drops one is caught."""
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    _, model_class = _family_classes(family)
    torch.manual_seed(seed)
    model = model_class(tiny_config(family, **config)).float()
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and not (gemma and "embed_tokens" in name):
                p.mul_(8.0)
            elif name.endswith("norm.weight"):
                mean = _norm_weight(name, gemma) + (family == "gemma4")  # its norms: x * w
                p.copy_(mean + 0.3 * torch.randn_like(p))
            elif name.endswith(("router.scale", "per_expert_scale")):  # Gemma 4's: ones
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(("bias", ".sinks")):  # gpt-oss's sinks: empty when made
                p.copy_(0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek's: zero when initialized
                b.copy_(0.3 * torch.randn_like(b))
            elif name.endswith("layer_scalar"):  # Gemma 4's: one when initialized
                b.copy_(1.0 + 0.3 * torch.randn_like(b))
    model.save_pretrained(directory, safe_serialization=True)
    return model.eval()


def _norm_weight(name: str, gemma: bool) -> float:
    """The mean of a norm's weight. Gemma multiplies by (1 + weight), and ties an lm_head to the
    embedding it scales by sqrt(hidden): that embedding scaled 8x, each token's own embedding
    would win the next step and greedy decoding repeat one token. So Gemma's embedding stays as
    initialized, post-norms double what each layer adds, and the final norm scales the logits."""
    if not gemma:
        return 1.0
    if name == "model.norm.weight":
        return 7.0
    return 1.0 if ".post_" in name else 0.0


def min_greedy_margin(model, ids: list[int], new_tokens: int) -> float:
    """The smallest gap between the best and second-best logit along the greedy continuation of
    `ids`: token-for-token comparisons at float32 need it well above float32 rounding."""
    tokens = reference_greedy(model, ids, new_tokens)
    with torch.inference_mode():
        logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1]
    top2 = logits.float().topk(2, dim=-1).values
    return float((top2[:, 0] - top2[:, 1]).min())


def min_router_margin(model, ids: list[int], new_tokens: int) -> float:
    """For a mixture of experts: the smallest gap, over every routed layer and every position
    of the greedy continuation of `ids`, between the router logit of the k-th expert chosen
    and of the best one left out. A rounding error larger than that swaps an expert, and the
    logits jump (so, unlike a dense model's, they are not close at float16 or Q8_0)."""
    tokens = reference_greedy(model, ids, new_tokens)
    with torch.inference_mode():
        out = model(torch.tensor([ids + tokens]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    tops = [logits.float().topk(k + 1, dim=-1).values for logits in out.router_logits]
    return float(min((top[:, k - 1] - top[:, k]).min() for top in tops))
