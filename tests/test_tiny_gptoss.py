"""A tiny random gpt-oss (sinks, sliding and full layers by turns, YaRN, 8 biased experts with
a clamped SwiGLU) gives transformers' greedy tokens at float32, split or not, batched, and
through real nodes; each of its switches changes what it computes."""

from __future__ import annotations

import pytest

from swarm.model import gptoss
from swarm.model.families import family_of
from swarm.model.source import open_model
from swarm.model.tiny import reference_greedy, save_tiny
from tests.conftest import FAMILY_NEW_TOKENS, FAMILY_PROMPT, nodes_greedy, split_greedy
from tests.helpers.tiny import assert_four_sessions_batch_alike, changed_copy

PROMPT, NEW_TOKENS = FAMILY_PROMPT, FAMILY_NEW_TOKENS
# layers 0 and 2 slide (window 8), 1 and 3 see all: the 3-way split cuts between the kinds
SPLITS = {1: [(0, 4)], 2: [(0, 1), (1, 4)], 3: [(0, 1), (1, 2), (2, 4)]}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(reference model, safetensors folder, the model's greedy tokens after PROMPT)."""
    folder = tmp_path_factory.mktemp("gpt_oss")
    model = save_tiny("gpt_oss", folder)
    return model, folder, reference_greedy(model, PROMPT, NEW_TOKENS)


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


def test_a_quantized_config_json_checkpoint_is_refused_by_name(made, tmp_path):
    _, folder, _ = made
    other = changed_copy(
        folder, tmp_path, config_change={"quantization_config": {"quant_method": "mxfp4"}}
    )
    with pytest.raises(ValueError, match="mxfp4"):
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


def test_a_gpt_oss_gguf_is_refused_by_name_until_one_is_verified():
    family = family_of("gpt-oss", gguf=True, where="x.gguf", moe=True)
    with pytest.raises(ValueError, match="gpt-oss GGUF files are not verified yet"):
        gptoss.gguf_fields(family, lambda *a: None, "gpt-oss")
