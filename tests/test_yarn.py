"""YaRN RoPE scaling: transformers' frequencies and attention factor, bit for bit, read from a
config and from llama.cpp's GGUF keys. (The tiny models' greedy tokens under YaRN, from both
formats and split, are tests/test_families.py's "llama-yarn" and "qwen3-yarn" variants.)"""

from __future__ import annotations

import gguf
import pytest
import torch

from devtools.hf_to_gguf import UnsupportedCheckpoint, write_gguf
from swarm.model.rope import Rotary
from swarm.model.rope_scaling import gguf_rope
from swarm.model.source import open_model
from swarm.model.tiny import reference_greedy, save_tiny
from tests.helpers.tiny import YARN, variant

LONG = list(range(5, 5 + 30 * 13, 13))


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"beta_fast": 8.0, "beta_slow": 2.0},
        {"attention_factor": 1.25},
        {"truncate": False},
        {"mscale": 0.8, "mscale_all_dim": 0.5},
        {"factor": None},  # from max_position_embeddings / the original's
    ],
)
def test_cos_and_sin_are_transformers_own_scaled_by_its_attention_factor(tmp_path, change):
    model = save_tiny("qwen3", tmp_path, rope_parameters={**YARN, **change})
    config = open_model(str(tmp_path)).config
    ours = Rotary(config.rope, config.head_dim)
    x = torch.zeros(1, 1, config.head_dim)
    cos, sin = model.model.rotary_emb(x, torch.arange(100)[None])
    assert torch.equal(ours.inv_freq, model.model.rotary_emb.inv_freq)
    assert ours.scale == model.model.rotary_emb.attention_scaling != 1.0
    assert torch.equal(ours.cos_sin(0, 100)[0], cos[0]) and torch.equal(
        ours.at([99])[1], sin[0, 99:]
    )


def test_yarn_changes_the_tiny_models_tokens(tmp_path):
    model = save_tiny("llama", tmp_path, rope_parameters=YARN)
    plain = variant(model, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert reference_greedy(model, LONG, 40) != reference_greedy(plain, LONG, 40)


def test_the_gguf_holds_the_keys_llama_cpps_converter_writes(tmp_path):
    save_tiny("qwen3", tmp_path / "hf", rope_parameters={**YARN, "beta_fast": 16.0})
    fields = gguf.GGUFReader(str(write_gguf(tmp_path / "hf", tmp_path / "m.gguf"))).fields
    got = {k: fields[k].contents() for k in fields if k.startswith("qwen3.rope.scaling.")}
    assert got == {
        "qwen3.rope.scaling.type": "yarn",
        "qwen3.rope.scaling.factor": 4.0,
        "qwen3.rope.scaling.original_context_length": 32,
        "qwen3.rope.scaling.yarn_beta_fast": 16.0,
    }


def test_a_gguf_reads_into_the_configs_own_rope(tmp_path):
    change = {"beta_fast": 16.0, "attention_factor": 1.25}
    save_tiny("llama", tmp_path / "hf", rope_parameters={**YARN, **change})
    path = write_gguf(tmp_path / "hf", tmp_path / "m.gguf")
    assert open_model(str(path)).config.rope == open_model(str(tmp_path / "hf")).config.rope


def test_a_yarn_llama_cpp_writes_no_key_for_is_not_converted(tmp_path):
    save_tiny("qwen3", tmp_path, rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})
    with pytest.raises(UnsupportedCheckpoint, match="mscale"):
        write_gguf(tmp_path, tmp_path / "m.gguf")


@pytest.mark.parametrize("key", ["yarn_log_multiplier", "yarn_ext_factor"])
def test_a_gguf_yarn_not_computed_here_is_refused_by_name(key):
    fields = {"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 4.0}
    fields[f"qwen3.rope.scaling.{key}"] = 0.5

    def field(name, default=...):
        if name not in fields and default is ...:
            raise ValueError(name)
        return fields.get(name, default)

    with pytest.raises(ValueError, match="extrapolation factor or log multiplier"):
        gguf_rope(field, "qwen3", "m.gguf", {}, lambda: ())
