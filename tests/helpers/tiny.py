"""What the tiny-model tests share: Llama 3's rope scaling, a model under a changed config,
and its logits."""

from __future__ import annotations

import json

import pytest
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


def written_with(folder, path, family: str, table):
    """`folder` written as a GGUF file at `path` by a converter whose row for `family` is
    `table`: a convention left out, to show the checks notice it."""
    from devtools import hf_to_gguf

    families = {**hf_to_gguf.FAMILIES, family: table}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_to_gguf, "FAMILIES", families)
        return hf_to_gguf.write_gguf(folder, path)


def assert_greedy_sound(model, prompt: list[int], margin: float) -> None:
    """40 greedy tokens after `prompt`: finite logits, at least 10 distinct tokens, and no step
    within `margin` of a tie (which float noise between two runs could break either way)."""
    from swarm.model.tiny import min_greedy_margin, reference_greedy

    tokens = reference_greedy(model, prompt, 40)
    assert torch.isfinite(logits_of(model, prompt + tokens)).all()
    assert len(set(tokens)) >= 10, tokens
    assert min_greedy_margin(model, prompt, 40) > margin


def assert_gguf_reads_back(model, path, prompt: list[int]) -> None:
    """transformers reads the GGUF file at `path` back into `model`'s config, weights and
    logits after `prompt`."""
    from devtools import gguf_check

    assert gguf_check.config_mismatches(model.config, path) == {}
    loaded = gguf_check.load_gguf_model(model, path)
    assert max(gguf_check.weight_gaps(model, loaded).values()) < 1e-6
    assert gguf_check.logit_gap(model, loaded, prompt) < 1e-5


def four_prompts(prompt: list[int]) -> list[list[int]]:
    """Four sessions' prompts of different lengths from one: it, its start, a middle cut, it
    reversed."""
    return [prompt, prompt[:7], prompt[5:26], prompt[::-1]]


def assert_four_sessions_batch_alike(model, path, prompt: list[int], spans) -> None:
    """The four_prompts of `prompt` through `spans` of the model at `path` in this process,
    their decode steps batched as a node batches them: each gets 24 greedy tokens as `model`
    gives them alone."""
    from swarm.model.tiny import reference_greedy
    from tests.conftest import split_greedy

    prompts = four_prompts(prompt)
    want = [reference_greedy(model, p, 24) for p in prompts]
    assert split_greedy(path, spans, prompts, 24) == want
