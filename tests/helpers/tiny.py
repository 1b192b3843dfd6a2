"""What the tiny-model tests share: Llama 3's rope scaling, a model under a changed config,
and its logits."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

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


def changed_copy(folder, to, config_change=None, state_change=None):
    """A copy of the model folder `folder` in `to`, its config.json updated with
    `config_change`, its weights replaced by `state_change(weights)`."""
    for f in folder.iterdir():
        if f.is_file():
            (to / f.name).write_bytes(f.read_bytes())
    if config_change:
        cfg = json.loads((folder / "config.json").read_text())
        (to / "config.json").write_text(json.dumps({**cfg, **config_change}))
    if state_change:
        state = load_file(folder / "model.safetensors")
        save_file(state_change(state), to / "model.safetensors")
    return to
