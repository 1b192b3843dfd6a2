"""Models the node computes exactly, or refuses: never accepted and silently wrong.

Tiny random models saved by transformers, split over two nodes at float32; greedy tokens equal
transformers' own generate."""

from __future__ import annotations

import json

import pytest
import torch

from swarm.model.config import Llama3Rope, Rope
from swarm.model.rope import Rotary, llama3_frequencies
from swarm.model.source import open_model
from swarm.model.tiny import reference_greedy, save_tiny_llama, save_tiny_tokenizer
from tests.conftest import nodes_greedy
from tests.helpers.tiny import LLAMA3

PROMPT = [5, 50, 150, 250, 350, 450]
TINY_SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def swarm_tokens(path, new_tokens: int) -> list[int]:
    return nodes_greedy(path, [(0, 3), (3, 6)], PROMPT, new_tokens)


@pytest.mark.slow
def test_llama3_rope_scaling_matches_transformers_token_for_token(tmp_path):
    model = save_tiny_llama(tmp_path, rope_parameters=LLAMA3)
    save_tiny_tokenizer(tmp_path)
    assert swarm_tokens(tmp_path, 40) == reference_greedy(model, PROMPT, 40)


def test_llama3_frequencies_are_transformers_own(tmp_path):
    model = save_tiny_llama(tmp_path, rope_parameters=LLAMA3)
    config = open_model(str(tmp_path)).config
    ours = Rotary(config.rope, config.head_dim).inv_freq
    assert torch.equal(ours, model.model.rotary_emb.inv_freq)


def test_frequency_factors_from_a_gguf_divide_the_frequencies():
    rope = Llama3Rope(8.0, 1.0, 4.0, 64)
    plain = Rotary(Rope(10000.0), 16).inv_freq
    factors = tuple((plain / llama3_frequencies(plain, rope)).tolist())
    divided = Rotary(Rope(10000.0, freq_factors=factors), 16).inv_freq
    assert torch.allclose(divided, llama3_frequencies(plain, rope), rtol=1e-6)


def test_a_rope_scaling_not_computed_here_is_refused(tmp_path):
    save_tiny_llama(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="RoPE scaling 'dynamic' is not supported"):
        open_model(str(tmp_path))


def test_a_mistral_window_covers_every_layer_and_not_the_context(tmp_path):
    save_tiny_llama(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg = {**cfg, "model_type": "mistral", "sliding_window": 32}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = open_model(str(tmp_path)).config
    assert config.windows == (32,) * 6 and config.max_position == 512


def relabelled_llama(path, config) -> None:
    """A tiny model of another architecture saved with `model_type` llama, as a mislabelled
    download would be."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))


def test_qwen3_relabelled_llama_is_refused_not_computed_without_its_qk_norms(tmp_path):
    from transformers import Qwen3Config

    relabelled_llama(tmp_path, Qwen3Config(**TINY_SHAPE, head_dim=16))
    with pytest.raises(ValueError, match="q_norm"):
        open_model(str(tmp_path))


def test_phi3_relabelled_llama_is_refused_with_a_clear_error(tmp_path):
    from transformers import Phi3Config

    relabelled_llama(tmp_path, Phi3Config(**TINY_SHAPE, pad_token_id=0))
    with pytest.raises(ValueError, match="lacks .*q_proj|qkv_proj"):
        open_model(str(tmp_path))
