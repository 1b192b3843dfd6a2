"""The tiny mixture-of-experts models, and their GGUF files as llama.cpp's converter writes them.

Mixtral, Qwen3-MoE and Qwen2-MoE: their folders hold one tensor per expert (as transformers
saves them and Hub checkpoints have them), their files one 3-D tensor per block and projection.
The routers are specified here in plain torch, from the folder's tensors; the files are checked
without our own reader, as in test_tiny_families.py."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from devtools import gguf_check, gguf_tables
from devtools.hf_to_gguf import UnsupportedCheckpoint, write_gguf
from swarm.model.gguf_file import GGUFFile
from swarm.model.tiny import (
    MOE_FAMILIES,
    min_router_margin,
    save_tiny,
)
from tests.helpers.tiny import (
    assert_gguf_reads_back,
    assert_greedy_sound,
    logits_of,
    variant,
    written_with,
)

PROMPT = list(range(5, 5 + 30 * 13, 13))  # 30 tokens, past Mixtral's window
LONG = list(range(5, 5 + 70 * 7, 7))

# layer 0's tensors in the folder (expert 0 of 8 shown) and in the file, GGUF order (row length
# first: [columns, rows, expert]); every block has the same
FOLDER = {
    "mixtral": {
        "block_sparse_moe.gate.weight": (8, 64),
        "block_sparse_moe.experts.0.w1.weight": (128, 64),  # gate
        "block_sparse_moe.experts.0.w3.weight": (128, 64),  # up
        "block_sparse_moe.experts.0.w2.weight": (64, 128),  # down
    },
    "qwen3_moe": {
        "mlp.gate.weight": (8, 64),
        "mlp.experts.0.gate_proj.weight": (96, 64),
        "mlp.experts.0.up_proj.weight": (96, 64),
        "mlp.experts.0.down_proj.weight": (64, 96),
    },
    "qwen2_moe": {
        "mlp.gate.weight": (8, 64),
        "mlp.experts.0.gate_proj.weight": (32, 64),
        "mlp.experts.0.up_proj.weight": (32, 64),
        "mlp.experts.0.down_proj.weight": (64, 32),
        "mlp.shared_expert.gate_proj.weight": (96, 64),
        "mlp.shared_expert.up_proj.weight": (96, 64),
        "mlp.shared_expert.down_proj.weight": (64, 96),
        "mlp.shared_expert_gate.weight": (1, 64),
    },
}
FILE = {
    "mixtral": {
        "ffn_gate_inp": (64, 8),
        "ffn_gate_exps": (64, 128, 8),
        "ffn_up_exps": (64, 128, 8),
        "ffn_down_exps": (128, 64, 8),
    },
    "qwen3_moe": {
        "ffn_gate_inp": (64, 8),
        "ffn_gate_exps": (64, 96, 8),
        "ffn_up_exps": (64, 96, 8),
        "ffn_down_exps": (96, 64, 8),
    },
    "qwen2_moe": {
        "ffn_gate_inp": (64, 8),
        "ffn_gate_exps": (64, 32, 8),
        "ffn_up_exps": (64, 32, 8),
        "ffn_down_exps": (32, 64, 8),
        "ffn_gate_shexp": (64, 96),
        "ffn_up_shexp": (64, 96),
        "ffn_down_shexp": (96, 64),
        "ffn_gate_inp_shexp": (64, 1),  # the checkpoint's [1, hidden]; older files have (64,)
    },
}
# the keys the file has for its experts, and those it must not: llama.cpp writes no
# renormalisation switch (it fixes one per architecture), and Mixtral's experts are
# feed_forward_length wide
EXPECTED_KEYS = {
    "mixtral": {
        "llama.expert_count": 8,
        "llama.expert_used_count": 2,
        "llama.feed_forward_length": 128,
        "llama.attention.sliding_window": 16,  # which llama.cpp's converter drops
    },
    "qwen3_moe": {
        "qwen3moe.expert_count": 8,
        "qwen3moe.expert_used_count": 3,
        "qwen3moe.expert_feed_forward_length": 96,
        "qwen3moe.attention.key_length": 32,
    },
    "qwen2_moe": {
        "qwen2moe.expert_count": 8,
        "qwen2moe.expert_used_count": 4,
        "qwen2moe.expert_feed_forward_length": 32,
        "qwen2moe.expert_shared_feed_forward_length": 96,
    },
}
ABSENT_KEYS = {
    "mixtral": ("llama.expert_feed_forward_length", "llama.expert_weights_norm"),
    "qwen3_moe": ("qwen3moe.expert_shared_feed_forward_length", "qwen3moe.expert_weights_norm"),
    "qwen2_moe": ("qwen2moe.expert_weights_norm", "qwen2moe.expert_gating_func"),
}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_same_seed_saves_the_same_experts_and_another_seed_others(tmp_path, family):
    save_tiny(family, tmp_path / "a", seed=3)
    save_tiny(family, tmp_path / "b", seed=3)
    save_tiny(family, tmp_path / "c", seed=4)
    a, b, c = (load_file(tmp_path / d / "model.safetensors") for d in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    expert = next(k for k in a if ".experts.0." in k)
    assert not torch.equal(a[expert], c[expert])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_folder_holds_one_tensor_per_expert_as_hub_checkpoints_do(tiny, family):
    _, folder, _ = tiny(family)
    state = load_file(folder / "model.safetensors")
    for local, shape in FOLDER[family].items():
        for block in range(6):
            assert tuple(state[f"model.layers.{block}.{local}"].shape) == shape, local
    experts = {k.split(".experts.")[1].split(".")[0] for k in state if ".experts." in k}
    assert experts == {str(x) for x in range(8)}
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in state)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_greedy_decoding_is_finite_varied_and_clear_of_ties(tiny, family):
    model, _, _ = tiny(family)
    assert_greedy_sound(model, PROMPT, margin=1e-3)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_no_router_is_near_a_tie_that_float32_rounding_could_swap(tiny, family):
    # float32 moves these models' router logits by ~1e-5 (against float64)
    model, _, _ = tiny(family)
    assert min_router_margin(model, PROMPT, 40) > 5e-4


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_routers_spread_a_prompt_over_the_experts(tiny, family):
    model, _, _ = tiny(family)
    with torch.inference_mode():
        out = model(torch.tensor([PROMPT]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    chosen = [logits.topk(k, dim=-1).indices.unique().numel() for logits in out.router_logits]
    assert len(chosen) == 6 and max(chosen) >= 6 and min(chosen) >= 4, chosen


def _experts_by_hand(state: dict, family: str, config, block: int, x: torch.Tensor):
    """A block's MLP from the folder's tensors, in plain torch: the routers' specification.
    Softmax over every expert's logit, then the top k; Mixtral always rescales those k weights
    to sum to 1, Qwen where norm_topk_prob says; each chosen expert is a SwiGLU; Qwen2-MoE adds
    its shared expert, scaled by sigmoid(its gate's one logit), whatever the router chose."""
    p = f"model.layers.{block}."
    if family == "mixtral":
        router, expert, names = (
            p + "block_sparse_moe.gate",
            p + "block_sparse_moe.experts.",
            "w1 w3 w2",
        )
    else:
        router, expert, names = p + "mlp.gate", p + "mlp.experts.", "gate_proj up_proj down_proj"
    probs = torch.softmax(x @ state[router + ".weight"].T, dim=-1)  # [tokens, experts]
    weights, chosen = probs.topk(config.num_experts_per_tok, dim=-1)  # [tokens, k]
    if family == "mixtral" or config.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)

    def swiglu(prefix: str, rows: torch.Tensor) -> torch.Tensor:
        gate, up, down = (state[f"{prefix}{n}.weight"] for n in names.split())
        return (F.silu(rows @ gate.T) * (rows @ up.T)) @ down.T

    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, e in zip(weights[t], chosen[t].tolist(), strict=True):
            out[t] += weight * swiglu(f"{expert}{e}.", x[t])
    if family == "qwen2_moe":
        names = "gate_proj up_proj down_proj"
        gate = torch.sigmoid(x @ state[p + "mlp.shared_expert_gate.weight"].T)  # [tokens, 1]
        out += gate * swiglu(p + "mlp.shared_expert.", x)
    return out


@pytest.mark.parametrize(
    "family, config",
    [
        ("mixtral", {}),
        ("qwen3_moe", {}),
        ("qwen3_moe", dict(norm_topk_prob=False)),
        ("qwen2_moe", {}),
        ("qwen2_moe", dict(norm_topk_prob=True)),
    ],
)
def test_the_routed_mlp_is_the_specification_over_the_folder_tensors(tmp_path, family, config):
    model = save_tiny(family, tmp_path, **config)
    state = load_file(tmp_path / "model.safetensors")
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(0))  # [tokens, hidden]
    for block in (0, 5):
        with torch.inference_mode():
            got = model.model.layers[block].mlp(x[None])[0]
        want = _experts_by_hand(state, family, model.config, block, x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(
    "family, change",
    [
        ("mixtral", dict(sliding_window=None)),
        ("mixtral", dict(num_experts_per_tok=3)),
        ("qwen3_moe", dict(norm_topk_prob=False)),
        ("qwen3_moe", dict(num_experts_per_tok=2)),
        ("qwen2_moe", dict(norm_topk_prob=True)),
    ],
)
def test_the_family_switch_changes_what_the_model_computes(tiny, family, change):
    model, _, _ = tiny(family)
    ours, theirs = logits_of(model, LONG), logits_of(variant(model, **change), LONG)
    assert (ours - theirs).abs().max() > 0.1


def test_mlp_only_layers_makes_a_dense_layer_that_the_file_cannot_hold(tmp_path):
    save_tiny("qwen2_moe", tmp_path, mlp_only_layers=[0])
    state = load_file(tmp_path / "model.safetensors")
    assert tuple(state["model.layers.0.mlp.gate_proj.weight"].shape) == (128, 64)
    assert not any(k.startswith("model.layers.0.mlp.experts.") for k in state)
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in state
    with pytest.raises(UnsupportedCheckpoint, match="dense"):
        write_gguf(tmp_path, tmp_path / "x.gguf")


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_transformers_reads_the_gguf_back_into_the_same_weights_andlogits_of(tiny, family):
    model, _, path = tiny(family)
    assert_gguf_reads_back(model, path, LONG)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_file_holds_the_expert_keys_and_no_renormalisation_switch(tiny, family):
    fields = gguf.GGUFReader(str(tiny(family)[2])).fields
    for key, value in EXPECTED_KEYS[family].items():
        assert key in fields, key
        assert fields[key].contents() == pytest.approx(value), key
    assert not set(ABSENT_KEYS[family]) & set(fields)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_our_reader_sees_each_block_s_experts_stacked(tiny, family):
    f = GGUFFile(tiny(family)[2])
    for block in range(6):
        for name, shape in FILE[family].items():
            assert f.tensors[f"blk.{block}.{name}.weight"].shape == shape, name
    kinds = {name.split(".")[2] for name in f.tensors if name.startswith("blk.")}
    assert not kinds & {"ffn_gate", "ffn_up", "ffn_down"}  # no dense MLP in any block


def _stacked_names(family: str, block: int) -> list[str]:
    """The merged names llama.cpp's converter maps through gguf-py's table."""
    if family == "mixtral":
        return [f"layers.{block}.feed_forward.experts.{w}" for w in ("w1", "w2", "w3")]
    return [f"model.layers.{block}.mlp.experts.{w}" for w in ("down_proj", "gate_proj", "up_proj")]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_tensor_names_are_gguf_py_own(tiny, family):
    model, folder, _ = tiny(family)
    table = gguf_tables.FAMILIES[family]
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, table.arch.upper()), 6)
    for hf_name in load_file(folder / "model.safetensors"):
        if gguf_tables.expert_slot(table, hf_name) is None:
            ours = gguf_tables.gguf_name(table, hf_name)
            assert ours == names.get_name(hf_name, try_suffixes=(".weight", ".bias")), hf_name
    for merged, (_, ours) in zip(_stacked_names(family, 2), table.experts.stacked, strict=True):
        assert names.get_name(merged) == f"blk.2.{ours}"


def _undo_permute(name: str, data: np.ndarray, config) -> np.ndarray:
    if ".attn_q." in name or ".attn_k." in name:
        heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
        pairs = data.reshape(heads, data.shape[0] // heads // 2, 2, -1)  # [head, pair, x|y, col]
        return pairs.swapaxes(1, 2).reshape(data.shape)
    return data


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_dequantized_tensors_are_the_folder_s_with_experts_stacked_in_order(tiny, family):
    model, folder, path = tiny(family)
    tensors = gguf_check.dequantized(path)
    table = gguf_tables.FAMILIES[family]
    stacked = dict(table.experts.stacked)
    seen = set()
    for hf_name, value in load_file(folder / "model.safetensors").items():
        if (slot := gguf_tables.expert_slot(table, hf_name)) is not None:
            block, expert, w = slot
            name = f"blk.{block}.{stacked[w]}.weight"
            got = tensors[name][expert]  # [expert, rows, columns]: expert's own matrix
        else:
            name = gguf_tables.gguf_name(table, hf_name)
            got = tensors[name].reshape(value.shape)
            if family == "mixtral":
                got = _undo_permute(name, got, model.config)
        np.testing.assert_array_equal(got, value.numpy(), err_msg=hf_name)
        seen.add(name)
    assert seen == set(tensors)


def test_q8_0_quantizes_each_expert_s_rows_and_keeps_routers_f32(tiny, tmp_path):
    model, folder, _ = tiny("qwen2_moe")
    path = write_gguf(folder, tmp_path / "q.gguf", "Q8_0")
    kinds = {
        t.name[6:]: t.tensor_type.name
        for t in gguf.GGUFReader(str(path)).tensors
        if t.name.startswith("blk.0.")
    }
    assert kinds["ffn_gate_inp.weight"] == kinds["ffn_gate_inp_shexp.weight"] == "F32"
    assert {kinds[f"{n}.weight"] for n in FILE["qwen2_moe"] if "inp" not in n} == {"Q8_0"}
    state = load_file(folder / "model.safetensors")
    down = gguf_check.dequantized(path)["blk.3.ffn_down_exps.weight"]
    for expert in range(8):
        value = state[f"model.layers.3.mlp.experts.{expert}.down_proj.weight"]
        step = value.abs().reshape(-1, 32).amax(1, keepdim=True) / 127  # per 32-block of a row
        err = (step * (0.5 + 2.0**-10 * 127)).expand(-1, 32).reshape(value.shape)
        assert (torch.from_numpy(down[expert]) - value).abs().le(err + 1e-7).all(), expert
    # logits jump wherever rounding swaps an expert: the greedy choices mostly survive
    loaded = gguf_check.load_gguf_model(model, path)
    ours, theirs = logits_of(model, LONG).argmax(-1), logits_of(loaded, LONG).argmax(-1)
    assert (ours == theirs).float().mean() > 0.8


def test_expert_rows_that_do_not_split_into_q8_0_blocks_are_f16(tmp_path):
    save_tiny("qwen2_moe", tmp_path, moe_intermediate_size=48)
    path = write_gguf(tmp_path, tmp_path / "q.gguf", "Q8_0")
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert kinds["blk.0.ffn_down_exps.weight"] == "F16"  # rows of 48
    assert kinds["blk.0.ffn_up_exps.weight"] == "Q8_0"  # rows of 64


def test_the_transformers_check_catches_experts_stacked_as_the_wrong_projection(tiny, tmp_path):
    model, folder, _ = tiny("qwen3_moe")
    table = gguf_tables.FAMILIES["qwen3_moe"]
    swapped = (
        ("down_proj", "ffn_down_exps"),
        ("gate_proj", "ffn_up_exps"),
        ("up_proj", "ffn_gate_exps"),
    )
    experts = dataclasses.replace(table.experts, stacked=swapped)
    wrong = dataclasses.replace(table, experts=experts)
    path = written_with(folder, tmp_path / "wrong.gguf", "qwen3_moe", wrong)
    loaded = gguf_check.load_gguf_model(model, path)
    assert gguf_check.logit_gap(model, loaded, LONG) > 0.1


@pytest.mark.parametrize(
    "family, config, said",
    [
        ("qwen3_moe", dict(norm_topk_prob=False), "renormalises"),
        ("qwen2_moe", dict(norm_topk_prob=True), "does not renormalise"),
        ("qwen3_moe", dict(decoder_sparse_step=2), "dense"),
        ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8), "sliding window"),
        (
            "qwen2_moe",
            dict(use_sliding_window=True, sliding_window=8, max_window_layers=2),
            "sliding",
        ),
        (
            "mixtral",
            dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}),
            "RoPE",
        ),
    ],
)
def test_a_checkpoint_the_file_would_misdescribe_is_refused(tmp_path, family, config, said):
    save_tiny(family, tmp_path, **config)
    with pytest.raises(UnsupportedCheckpoint, match=said):
        write_gguf(tmp_path, tmp_path / "x.gguf")


def test_a_block_missing_an_expert_is_refused(tiny, tmp_path):
    _, folder, _ = tiny("mixtral")
    state = load_file(folder / "model.safetensors")
    del state["model.layers.4.block_sparse_moe.experts.5.w3.weight"]
    for other in folder.glob("*.json"):
        (tmp_path / other.name).write_text(other.read_text())
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedCheckpoint, match="block 4"):
        write_gguf(tmp_path, tmp_path / "x.gguf")
