"""The tiny model of each family, and its GGUF file as llama.cpp's converter would write it.

The models are the fixtures the node's families are tested against: deterministic, not
degenerate, and with each family's distinguishing switch turned on where a short prompt reaches
it. The files are checked without our own reader: transformers reads each back into the exact
weights and logits of the checkpoint, and the keys it ignores are read here from the file."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from devtools import gguf_check, gguf_tables
from devtools.hf_to_gguf import UnsupportedCheckpoint, write_gguf
from swarm.model.gguf_file import GGUFFile
from swarm.model.tiny import FAMILIES, save_tiny
from tests.helpers.tiny import (
    LLAMA3,
    assert_gguf_reads_back,
    assert_greedy_sound,
    logits_of,
    variant,
    written_with,
)

PROMPT = list(range(5, 5 + 30 * 13, 13))  # 30 tokens, past every tiny model's window
LONG = list(range(5, 5 + 70 * 7, 7))  # a prompt and 40 new tokens' worth
GEMMA3_ONE_BASE = {
    "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
}

# the keys each family's file must hold, beside the shape every family has
EXPECTED_KEYS = {
    "llama": {"llama.vocab_size": 512, "llama.rope.dimension_count": 16},
    "mistral": {
        "llama.attention.sliding_window": 16,  # which llama.cpp's converter drops
        "llama.attention.key_length": 32,
        "llama.rope.dimension_count": 32,
    },
    "qwen2": {"qwen2.rope.freq_base": 10000.0},
    "qwen3": {"qwen3.attention.key_length": 32, "qwen3.attention.value_length": 32},
    "gemma2": {
        "gemma2.attention.sliding_window": 8,
        "gemma2.attn_logit_softcapping": 5.0,
        "gemma2.final_logit_softcapping": 3.0,
        "gemma2.attention.key_length": 32,
    },
    "gemma3": {
        "gemma3.attention.sliding_window": 8,
        "gemma3.rope.freq_base": 1_000_000.0,
        "gemma3.rope.freq_base_swa": 10_000.0,
        "gemma3.attention.key_length": 32,
    },
    "phi3": {
        "phi3.attention.sliding_window": 16,
        "phi3.rope.dimension_count": 16,
        "phi3.rope.scaling.original_context_length": 512,
    },
}


@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_saves_the_same_weights_and_another_seed_others(tmp_path, family):
    model = save_tiny(family, tmp_path / "a", seed=3)
    save_tiny(family, tmp_path / "b", seed=3)
    save_tiny(family, tmp_path / "c", seed=4)
    a, b, c = (load_file(tmp_path / d / "model.safetensors") for d in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert not model.training and model.dtype == torch.float32


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_is_finite_varied_and_clear_of_ties(tiny, family):
    model, _, _ = tiny(family)
    assert_greedy_sound(model, PROMPT, margin=1e-4)


@pytest.mark.parametrize(
    "family, change",
    [
        ("mistral", dict(sliding_window=None)),
        ("phi3", dict(sliding_window=None)),
        ("gemma2", dict(sliding_window=4096)),
        ("gemma3", dict(sliding_window=4096)),
        ("gemma2", dict(attn_logit_softcapping=None)),
        ("gemma2", dict(final_logit_softcapping=None)),
        ("gemma3", dict(rope_parameters=GEMMA3_ONE_BASE)),
        ("gemma3", dict(query_pre_attn_scalar=256)),
    ],
)
def test_the_family_switch_changes_what_the_model_computes(tiny, family, change):
    model, _, _ = tiny(family)
    ours, theirs = logits_of(model, LONG), logits_of(variant(model, **change), LONG)
    assert (ours - theirs).abs().max() > 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_norm_weights_and_biases_are_off_their_neutral_values(tiny, family):
    model, _, _ = tiny(family)
    neutral = 0.0 if family.startswith("gemma") else 1.0  # Gemma multiplies by 1 + w
    for name, value in model.state_dict().items():
        if name.endswith("norm.weight"):
            assert (value - neutral).abs().mean() > 0.1, name
        elif name.endswith("bias"):
            assert value.abs().mean() > 0.1, name


@pytest.mark.parametrize("family", ["mistral", "phi3", "gemma2", "gemma3"])
def test_a_window_changes_nothing_before_the_prompt_outgrows_it(tiny, family):
    model, _, _ = tiny(family)
    window = model.config.sliding_window
    other = variant(model, sliding_window=4096)
    assert torch.equal(logits_of(model, LONG[:window]), logits_of(other, LONG[:window]))


def test_gemma3_has_both_sliding_and_full_layers_each_with_its_rope_base(tiny):
    config = tiny("gemma3")[0].config
    assert config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    rope = config.rope_parameters
    assert rope["sliding_attention"]["rope_theta"] != rope["full_attention"]["rope_theta"]


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_qwen2_stores_no_lm_head_in_either_format(tiny, tied):
    _, folder, path = tiny("qwen2", tie_word_embeddings=tied)
    assert ("lm_head.weight" in load_file(folder / "model.safetensors")) is not tied
    assert ("output.weight" in GGUFFile(path).tensors) is not tied


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_reads_the_gguf_back_into_the_same_weights_andlogits_of(tiny, family):
    model, _, path = tiny(family)
    assert_gguf_reads_back(model, path, LONG)


def test_transformers_reads_back_a_llama3_scaled_llama(tiny):
    model, _, path = tiny("llama", rope_parameters=LLAMA3)
    loaded = gguf_check.load_gguf_model(model, path)
    assert gguf_check.logit_gap(model, loaded, LONG) < 1e-5


def test_rope_freqs_divide_the_frequencies_as_transformers_llama3_scaling_does(tiny):
    model, _, path = tiny("llama", rope_parameters=LLAMA3)
    factors = gguf_check.dequantized(path)["rope_freqs.weight"]
    scaled = model.model.rotary_emb.inv_freq.double().numpy()
    plain = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    np.testing.assert_allclose(factors, plain / scaled, rtol=1e-5)
    assert factors.min() == 1.0 and factors.max() == 8.0  # the scaling reaches both ends


@pytest.mark.parametrize("family", FAMILIES)
def test_the_file_holds_the_keys_transformers_ignores(tiny, family):
    fields = gguf.GGUFReader(str(tiny(family)[2])).fields
    for key, value in EXPECTED_KEYS[family].items():
        assert key in fields, key
        assert fields[key].contents() == pytest.approx(value), key


@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_names_are_gguf_py_own(tiny, family):
    model, _, _ = tiny(family)
    table = gguf_tables.FAMILIES[family]
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, table.arch.upper()), 6)
    for hf_name in model.state_dict():
        if table.must_tie and hf_name == "lm_head.weight":
            continue  # llama.cpp has no output tensor for Gemma 2
        ours = gguf_tables.gguf_name(table, hf_name)
        assert ours == names.get_name(hf_name, try_suffixes=(".weight", ".bias")), hf_name


def _undo(family: str, name: str, data: np.ndarray, config) -> np.ndarray:
    """What a reader does to a file's tensor to get the checkpoint's back."""
    if family in ("llama", "mistral") and (".attn_q." in name or ".attn_k." in name):
        heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
        pairs = data.reshape(heads, data.shape[0] // heads // 2, 2, -1)  # [head, pair, x|y, col]
        return pairs.swapaxes(1, 2).reshape(data.shape)
    if family.startswith("gemma") and name.endswith("norm.weight"):
        return data - 1.0
    return data


@pytest.mark.parametrize("family", FAMILIES)
def test_dequantized_tensors_are_the_checkpoint_after_undoing_the_conventions(tiny, family):
    model, _, path = tiny(family)
    tensors = gguf_check.dequantized(path)
    state = model.state_dict()
    expected = {gguf_tables.gguf_name(gguf_tables.FAMILIES[family], k) for k in state}
    assert set(tensors) == expected - ({"output.weight"} if "gemma" in family else set())
    for hf_name, value in state.items():
        name = gguf_tables.gguf_name(gguf_tables.FAMILIES[family], hf_name)
        if name in tensors:
            back = _undo(family, name, tensors[name], model.config)
            np.testing.assert_allclose(back, value.numpy(), atol=1e-6, err_msg=name)


def test_phi3_keeps_its_fused_projections_with_gate_rows_first(tiny):
    model, _, path = tiny("phi3")
    tensors = gguf_check.dequantized(path)
    assert "blk.0.ffn_gate.weight" not in tensors
    up = tensors["blk.0.ffn_up.weight"]
    assert up.shape == (2 * 128, 64)
    gate = model.model.layers[0].mlp.gate_up_proj.weight[:128].detach().numpy()
    np.testing.assert_array_equal(up[:128], gate)
    assert tensors["blk.0.attn_qkv.weight"].shape == (64 + 2 * 2 * 16, 64)


@pytest.mark.parametrize("qtype, bound", [("F16", 2.0**-11), ("BF16", 2.0**-8), ("Q8_0", None)])
def test_quantized_files_hold_the_rounded_weights_and_f32_norms(tiny, tmp_path, qtype, bound):
    model, folder, _ = tiny("gemma3")
    path = write_gguf(folder, tmp_path / "q.gguf", qtype)
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert {n for n, k in kinds.items() if k == "F32"} == {n for n in kinds if "norm" in n}
    loaded = gguf_check.load_gguf_model(model, path)
    for name, value in model.state_dict().items():
        if value.dim() == 2:
            got = loaded.state_dict()[name]
            if bound is None:  # Q8_0: a 32-block's largest value / 127, halved, and its scale
                step = value.abs().reshape(-1, 32).amax(1, keepdim=True) / 127
                err = (step * (0.5 + 2.0**-10 * 127)).expand(-1, 32).reshape(value.shape)
            else:
                err = value.abs() * bound
            assert ((got - value).abs() <= err + 1e-7).all(), name
    assert gguf_check.logit_gap(model, loaded, LONG) < 1.0


@pytest.mark.parametrize(
    "family, change",
    [
        ("llama", dict(permute_qk=False)),
        ("gemma2", dict(norm_plus_one=False)),
    ],
)
def test_the_transformers_check_catches_a_convention_left_out(tiny, tmp_path, family, change):
    model, folder, _ = tiny(family)
    table = gguf_tables.FAMILIES[family]
    path = written_with(
        folder, tmp_path / "wrong.gguf", family, dataclasses.replace(table, **change)
    )
    loaded = gguf_check.load_gguf_model(model, path)
    assert gguf_check.logit_gap(model, loaded, LONG) > 0.1


@pytest.mark.parametrize(
    "family, config",
    [
        ("gemma3", dict(layer_types=["full_attention"] * 6)),
        ("gemma2", dict(query_pre_attn_scalar=256)),
        ("gemma2", dict(rope_theta=20000.0)),
        ("gemma3", dict(rope_parameters=GEMMA3_ONE_BASE)),
        ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2)),
        ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0})),
    ],
)
def test_a_checkpoint_the_file_would_misdescribe_is_refused(tmp_path, family, config):
    save_tiny(family, tmp_path, **config)
    with pytest.raises(UnsupportedCheckpoint):
        write_gguf(tmp_path, tmp_path / "x.gguf")


def test_our_file_reader_sees_the_arch_fields_and_tensor_shapes(tiny):
    _, _, path = tiny("gemma3")
    f = GGUFFile(path)
    assert f.fields["general.architecture"] == "gemma3"
    assert f.fields["gemma3.block_count"] == 6
    assert f.fields["tokenizer.ggml.bos_token_id"] == 1
    assert f.tensors["blk.0.attn_q.weight"].shape == (64, 4 * 32)  # GGUF order: row length first
