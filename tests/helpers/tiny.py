"""What the tiny-model tests share: Llama 3's rope scaling, a model under a changed config,
and its logits."""

from __future__ import annotations

import torch

# Llama 3's rope scaling on the tiny models: their 64 positions make it touch the head's bands
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# YaRN on the tiny models: an original context of 32, so a 30-token prompt and 40 new tokens
# run past it (the 64 positions of a tiny model's default context and beyond)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
}


def variant(model, **change):
    """The same weights under a config with `change`."""
    config = type(model.config)(**{**model.config.to_dict(), **change})
    other = type(model)(config).float().eval()
    other.load_state_dict(model.state_dict())
    return other


def logits_of(model, ids: list[int]) -> torch.Tensor:
    """[tokens, vocab] logits of `model` after `ids`."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]
