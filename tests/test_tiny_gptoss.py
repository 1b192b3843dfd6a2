"""A tiny random gpt-oss (sinks, sliding and full layers by turns, YaRN, 8 biased experts with
a clamped SwiGLU) gives transformers' greedy tokens at float32, split or not, batched, and
through real nodes, from its safetensors folder and from a GGUF written as llama.cpp's converter
writes it; each of its switches changes what it computes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from devtools import gguf_check
from devtools.gguf_gptoss import mxfp4_checkpoint
from devtools.hf_to_gguf import UnsupportedCheckpoint, write_gguf
from swarm.model.source import open_model
from swarm.model.tiny import gptoss_yarn, reference_greedy, save_tiny, save_tiny_tokenizer
from tests.conftest import FAMILY_NEW_TOKENS, FAMILY_PROMPT, nodes_greedy, split_greedy
from tests.helpers.tiny import assert_four_sessions_batch_alike, changed_copy, variant

PROMPT, NEW_TOKENS = FAMILY_PROMPT, FAMILY_NEW_TOKENS
# layers 0 and 2 slide (window 8), 1 and 3 see all: the 3-way split cuts between the kinds
SPLITS = {1: [(0, 4)], 2: [(0, 1), (1, 4)], 3: [(0, 1), (1, 2), (2, 4)]}


# the tiny model's YaRN, its ramp's ends unrounded as gpt-oss's are (truncate false)
YARN = gptoss_yarn()
# what a GGUF cannot say otherwise: the clamp at 7, llama.cpp's code's constant
AS_LLAMA_CPP = dict(swiglu_limit=7.0)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(reference model, safetensors folder, the model's greedy tokens after PROMPT)."""
    folder = tmp_path_factory.mktemp("gpt_oss")
    model = save_tiny("gpt_oss", folder)
    return model, folder, reference_greedy(model, PROMPT, NEW_TOKENS)


@pytest.fixture(scope="module")
def as_gguf(tmp_path_factory):
    """(reference model, its F32 GGUF written as llama.cpp writes it, the greedy tokens, the
    folder) of a tiny gpt-oss with llama.cpp's clamp (AS_LLAMA_CPP); its experts' gate/up
    doubled, so that a clamp at 7 changes the tokens here too."""
    folder = tmp_path_factory.mktemp("gpt_oss_gguf")
    model = save_tiny("gpt_oss", folder, **AS_LLAMA_CPP)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gate_up_proj" in name:
                p.mul_(2.0)
    model.save_pretrained(folder, safe_serialization=True)
    save_tiny_tokenizer(folder)
    path = write_gguf(folder, tmp_path_factory.mktemp("gguf") / "gpt_oss.gguf")
    return model, path, reference_greedy(model, PROMPT, NEW_TOKENS), folder


@pytest.fixture(scope="module")
def as_mxfp4(as_gguf, tmp_path_factory):
    """(transformers model with the experts' MXFP4-rounded weights, the MXFP4_MOE GGUF, its
    greedy tokens): the file's experts dequantized by gguf-py and put back in config.json's
    layout (gate in the even columns of gate_up, up in the odd; down transposed)."""
    model, _, _, folder = as_gguf
    path = write_gguf(folder, tmp_path_factory.mktemp("mxfp4") / "gpt_oss.gguf", "MXFP4")
    tensors = gguf_check.dequantized(path)
    rounded = variant(model)
    state = rounded.state_dict()
    for i in range(rounded.config.num_hidden_layers):
        gate, up, down = (
            torch.from_numpy(tensors[f"blk.{i}.ffn_{p}_exps.weight"]).transpose(1, 2)
            for p in ("gate", "up", "down")
        )
        experts = f"model.layers.{i}.mlp.experts"
        state[f"{experts}.gate_up_proj"][..., ::2] = gate
        state[f"{experts}.gate_up_proj"][..., 1::2] = up
        state[f"{experts}.down_proj"].copy_(down)
    rounded.load_state_dict(state)
    return rounded, path, reference_greedy(rounded, PROMPT, NEW_TOKENS)


def test_the_config_has_sinks_windows_by_turns_and_the_clamped_router(made):
    _, folder, _ = made
    c = open_model(str(folder)).config
    assert (c.family, c.sinks, c.router) == ("gpt_oss", True, "topk_softmax")
    assert c.windows == (8, None, 8, None)
    assert (c.experts, c.experts_used, c.swiglu_limit, c.swiglu_alpha) == (8, 3, 2.0, 1.702)
    assert c.rope.yarn is not None and not c.rope.yarn.truncate


@pytest.mark.parametrize("ways", [1, 2, 3])
def test_a_split_gives_transformers_greedy_tokens(made, ways):
    _, folder, want = made
    assert len(PROMPT) + NEW_TOKENS > 8  # past the window
    assert split_greedy(folder, SPLITS[ways], [PROMPT], NEW_TOKENS) == [want]


def test_four_batched_sessions_each_get_their_own_tokens(made):
    model, folder, _ = made
    assert_four_sessions_batch_alike(model, folder, PROMPT, SPLITS[3])


def _no_sinks(state):
    return {k: v.fill_(-1e9) if k.endswith(".sinks") else v for k, v in state.items()}


@pytest.mark.parametrize(
    "change",
    [
        dict(state_change=_no_sinks),
        dict(config_change={"swiglu_limit": 1e6}),
        dict(config_change={"swiglu_alpha": 1.0}),
    ],
    ids=["sinks", "clamp", "alpha"],
)
def test_each_switch_changes_what_the_tiny_model_computes(made, tmp_path, change):
    _, folder, want = made
    other = changed_copy(folder, tmp_path, **change)
    assert split_greedy(other, SPLITS[2], [PROMPT], NEW_TOKENS) != [want]


def test_a_config_json_quantized_other_than_mxfp4_is_refused_by_name(made, tmp_path):
    _, folder, _ = made
    other = changed_copy(
        folder, tmp_path, config_change={"quantization_config": {"quant_method": "fp8"}}
    )
    with pytest.raises(ValueError, match="fp8"):
        open_model(str(other))


def test_every_tensor_of_every_block_is_consumed(made):
    from swarm.model.blocks import Block

    _, folder, _ = made
    source = open_model(str(folder))
    for i in range(source.config.num_layers):
        raw = source.block_raw(i)
        Block.load(source.config, i, raw, "float32", None)
        assert not raw.unread()


@pytest.mark.slow
def test_three_nodes_split_between_sliding_and_full_layers_give_transformers_tokens(made):
    _, folder, want = made
    assert nodes_greedy(str(folder), SPLITS[3], PROMPT, NEW_TOKENS) == want


def test_a_gguf_reads_as_gpt_oss_s_config(as_gguf):
    _, path, _, _ = as_gguf
    c = open_model(str(path)).config
    assert (c.family, c.sinks, c.router) == ("gpt_oss", True, "topk_softmax")
    assert c.windows == (8, None, 8, None)  # llama.cpp: every second layer full
    assert (c.experts, c.experts_used, c.swiglu_limit, c.swiglu_alpha) == (8, 3, 7.0, 1.702)
    assert c.rope.yarn is not None and not c.rope.yarn.truncate  # gpt-oss's; llama.cpp rounds


@pytest.mark.parametrize("ways", [1, 2, 3])
def test_a_gguf_split_gives_transformers_greedy_tokens(as_gguf, ways):
    _, path, want, _ = as_gguf
    assert split_greedy(path, SPLITS[ways], [PROMPT], NEW_TOKENS) == [want]


def test_four_batched_sessions_from_a_gguf_each_get_their_own_tokens(as_gguf):
    model, path, _, _ = as_gguf
    assert_four_sessions_batch_alike(model, path, PROMPT, SPLITS[3])


@pytest.mark.parametrize(
    "change",
    [dict(rope_parameters={**YARN, "truncate": True}), dict(swiglu_limit=1e6)],
    ids=["yarn-rounded", "no-clamp"],
)
def test_what_a_gguf_leaves_unsaid_changes_the_gguf_fixture_s_tokens(as_gguf, change):
    model, _, want, _ = as_gguf
    assert reference_greedy(variant(model, **change), PROMPT, NEW_TOKENS) != want


def test_every_tensor_of_every_gguf_block_is_consumed(as_gguf):
    from swarm.model.blocks import Block

    _, path, _, _ = as_gguf
    source = open_model(str(path))
    for i in range(source.config.num_layers):
        raw = source.block_raw(i)
        Block.load(source.config, i, raw, "float32", None)
        assert not raw.unread()


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(swiglu_limit=2.0), "swiglu limit 2.0"),
        (dict(rope_parameters={**YARN, "truncate": True}), "truncate"),
        (dict(layer_types=["full_attention", "sliding_attention"] * 2), "layer types"),
    ],
)
def test_a_checkpoint_its_gguf_would_describe_otherwise_is_not_converted(
    made, tmp_path, change, named
):
    _, folder, _ = made
    other = changed_copy(folder, tmp_path, config_change={**AS_LLAMA_CPP, **change})
    with pytest.raises(UnsupportedCheckpoint, match=named):
        write_gguf(other, tmp_path / "x.gguf")


@pytest.mark.slow
def test_three_nodes_from_a_gguf_give_transformers_tokens(as_gguf):
    _, path, want, _ = as_gguf
    assert nodes_greedy(str(path), SPLITS[3], PROMPT, NEW_TOKENS) == want


def test_the_mxfp4_file_keeps_the_experts_in_mxfp4_and_rounds_them(as_gguf, as_mxfp4):
    import gguf

    rounded, path, _ = as_mxfp4
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert {k for n, k in kinds.items() if n.endswith("_exps.weight")} == {"MXFP4"}
    assert {k for n, k in kinds.items() if not n.endswith("_exps.weight")} == {"F32"}
    before = as_gguf[0].state_dict()["model.layers.0.mlp.experts.down_proj"]
    assert not torch.equal(rounded.state_dict()["model.layers.0.mlp.experts.down_proj"], before)


@pytest.mark.parametrize("ways", [1, 3])
def test_mxfp4_experts_dequantized_give_transformers_tokens_on_the_same_weights(as_mxfp4, ways):
    _, path, want = as_mxfp4
    assert split_greedy(path, SPLITS[ways], [PROMPT], NEW_TOKENS) == [want]


def test_mxfp4_experts_on_swarm_s_kernels_compute_what_their_float32_weights_give(as_mxfp4):
    from swarm.model import kernels
    from swarm.model.blocks import Block
    from swarm.model.linear import Blocks

    if kernels.load() is None:
        pytest.skip("swarm's kernels do not load here")
    _, path, _ = as_mxfp4
    source = open_model(str(path))
    x = torch.randn(5, source.config.hidden)
    for i in range(source.config.num_layers):
        on_kernels = Block.load(source.config, i, source.block_raw(i), "auto", None, 2).mlp
        exact = Block.load(source.config, i, source.block_raw(i), "float32", None).mlp
        linears = [lin for mlp in on_kernels.experts for lin in mlp.linears]
        assert all(isinstance(lin, Blocks) and lin.kind == "MXFP4" for lin in linears)
        want = exact(x)
        assert (on_kernels(x) - want).abs().max() < 1e-3 * want.abs().max()


@pytest.fixture(scope="module")
def mxfp4_folder(as_gguf, tmp_path_factory):
    """The GGUF fixture's folder with its experts in config.json's MXFP4 layout (the codes of
    the MXFP4 GGUF's), and transformers' own model of it (its MXFP4 dequantized on load)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    folder = mxfp4_checkpoint(as_gguf[3], tmp_path_factory.mktemp("mxfp4_json") / "m")
    model = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    )
    return folder, model.eval()


def test_transformers_reads_a_mxfp4_folder_as_gguf_py_reads_its_gguf(mxfp4_folder, as_mxfp4):
    _, model = mxfp4_folder
    rounded, _, want = as_mxfp4
    ours = rounded.state_dict()
    for name, w in model.state_dict().items():
        assert torch.equal(w.float(), ours[name]), name
    assert reference_greedy(model, PROMPT, NEW_TOKENS) == want


@pytest.mark.parametrize("ways", [1, 3])
def test_a_mxfp4_config_json_folder_gives_transformers_tokens(mxfp4_folder, as_mxfp4, ways):
    folder, _ = mxfp4_folder
    assert open_model(str(folder)).config.mxfp4_experts
    assert split_greedy(folder, SPLITS[ways], [PROMPT], NEW_TOKENS) == [as_mxfp4[2]]


def test_a_mxfp4_folder_s_experts_keep_the_gguf_s_blocks_on_swarm_s_kernels(mxfp4_folder, as_mxfp4):
    from swarm.model import kernels
    from swarm.model.blocks import Block

    if kernels.load() is None:
        pytest.skip("swarm's kernels do not load here")
    folder, _ = mxfp4_folder
    source, file = open_model(str(folder)), open_model(str(as_mxfp4[1]))
    for i in range(source.config.num_layers):
        raw = source.block_raw(i)
        experts = Block.load(source.config, i, raw, "auto", None).mlp.experts
        assert not raw.unread()
        stacked = {p: file.block_raw(i)[f"experts.{p}"].data for p in ("gate", "up", "down")}
        for e, mlp in enumerate(experts):
            gate_up, down = mlp.gate_up.linears[0], mlp.down
            rows = {p: len(w) // len(experts) for p, w in stacked.items()}
            want = [stacked[p][e * rows[p] : (e + 1) * rows[p]] for p in ("gate", "up", "down")]
            assert np.array_equal(gate_up.blocks(), np.concatenate(want[:2]))
            assert np.array_equal(down.blocks(), want[2])


@pytest.mark.slow
def test_three_nodes_from_a_mxfp4_folder_give_transformers_tokens(mxfp4_folder, as_mxfp4):
    folder, _ = mxfp4_folder
    assert nodes_greedy(str(folder), SPLITS[3], PROMPT, NEW_TOKENS) == as_mxfp4[2]
