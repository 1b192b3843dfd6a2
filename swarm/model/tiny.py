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
