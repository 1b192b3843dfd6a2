"""A tiny random-weight Llama for tests, fuzzing and benchmarks (no download; seconds to make)."""

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


def save_tiny_llama(directory: str | PathLike, seed: int = 0):
    """Save a random tiny Llama as a Hugging Face safetensors folder; returns the model.

    Random init is tiny, so its 2-D weights are scaled up 8x: greedy decoding is then not
    dominated by near-ties, and token-for-token comparisons are meaningful."""
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
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
