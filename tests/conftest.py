"""Shared fixtures: a tiny random Llama on disk, the default model's unsplit reference, swarms."""

from __future__ import annotations

import warnings

import pytest
import torch

from swarm.launch import start_swarm, stop_all

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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-weight Llama saved as a Hugging Face safetensors folder."""
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    # random init is tiny; scale up so greedy decoding is not dominated by near-ties
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path, safe_serialization=True)
    return path


def reference_greedy(model, ids: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="session")
def tiny_reference(tiny_model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_reference():
    """The unsplit default model, loaded by transformers from the same GGUF file; its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from swarm.model.source import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    return model, tok


@pytest.fixture(scope="module")
def tiny_swarm(tiny_model_dir):
    """Uneven, overlapping spans of the tiny model: 0:2, 1:5, 4:6."""
    nodes = start_swarm(
        [(0, 2), (1, 5), (4, 6)],
        model=str(tiny_model_dir),
        extra=["--wire-dtype", "float32", "--announce-ttl", "10"],
    )
    yield nodes
    stop_all(nodes)
