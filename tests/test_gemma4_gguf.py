"""A tiny random Gemma 4 written as llama.cpp's converter writes it (devtools.hf_to_gguf, checked
against llama.cpp's own convert_hf_to_gguf.py with devtools.compare_llama_cpp: the same keys,
tensor names, types and values at F32 and Q8_0) gives transformers' greedy tokens at float32,
split or not, batched, through real nodes, dense and with experts; what llama.cpp's keys could
say that is not computed here is refused by name."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest

from devtools.hf_to_gguf import write_gguf
from swarm.errors import SpanError
from swarm.model.blocks import Block, Span
from swarm.model.source import open_model
from swarm.model.tiny import reference_greedy, save_tiny
from tests.conftest import FAMILY_NEW_TOKENS, FAMILY_PROMPT, nodes_greedy, split_greedy
from tests.helpers.tiny import assert_four_sessions_batch_alike

PROMPT, NEW_TOKENS = FAMILY_PROMPT, FAMILY_NEW_TOKENS
# layers s f s f s f (window 8), 4 and 5 reading 2's and 3's KV: each split cuts between a
# sliding and a full layer and keeps 2:6 whole
SPLITS = {1: [(0, 6)], 2: [(0, 1), (1, 6)], 3: [(0, 1), (1, 2), (2, 6)]}
MOE = dict(enable_moe_block=True, num_experts=8, top_k_experts=3, moe_intermediate_size=32)


def _made(tmp_path_factory, name: str, **config):
    folder = tmp_path_factory.mktemp(name)
    model = save_tiny("gemma4", folder, **config)
    path = write_gguf(folder, tmp_path_factory.mktemp(f"{name}-gguf") / f"{name}.gguf")
    return model, folder, path, reference_greedy(model, PROMPT, NEW_TOKENS)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(reference model, safetensors folder, its F32 GGUF file, greedy tokens after PROMPT)."""
    return _made(tmp_path_factory, "gemma4")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """The same of the tiny Gemma 4 with 8 experts (top 3) beside each layer's dense MLP."""
    return _made(tmp_path_factory, "gemma4-moe", **MOE)


def test_the_file_has_llama_cpp_s_per_layer_keys_and_tensor_names(made):
    reader = gguf.GGUFReader(str(made[2]))
    value = lambda key: reader.fields[f"gemma4.{key}"].contents()  # noqa: E731
    assert value("attention.sliding_window_pattern") == [True, False] * 3
    assert value("attention.head_count_kv") == [2, 1] * 3
    assert value("feed_forward_length") == [128] * 4 + [256] * 2  # double wide where shared
    assert (value("attention.key_length"), value("attention.key_length_swa")) == (48, 32)
    assert (value("attention.shared_kv_layers"), value("embedding_length_per_layer_input")) == (
        2,
        16,
    )
    tensors = {t.name: t for t in reader.tensors}
    assert list(tensors["rope_freqs.weight"].data) == [1.0] * 6 + [1e30] * 18  # 48 x 0.25 / 2
    assert {"per_layer_token_embd.weight", "per_layer_model_proj.weight"} <= tensors.keys()
    block = {n.removeprefix("blk.1.") for n in tensors if n.startswith("blk.1.")}
    assert {"inp_gate.weight", "proj.weight", "post_norm.weight"} <= block
    assert "layer_output_scale.weight" in block and "attn_v.weight" not in block  # k = v
    assert not {"blk.4.attn_k.weight", "blk.5.attn_v.weight"} & tensors.keys()  # shared KV


def test_the_config_read_from_the_file_is_the_folder_s(made):
    _, folder, path, _ = made
    want, got = open_model(str(folder)).config, open_model(str(path)).config
    same = dict(name="x", rms_eps=want.rms_eps, bos_token_id=None, eos_token_ids=())
    # the file's share of the full layers' frequencies turned: the 6 of 24 as transformers's 0.25
    assert replace(got, **same) == replace(want, **same)


@pytest.mark.parametrize("ways", [1, 2, 3])
def test_a_split_gives_transformers_greedy_tokens(made, ways):
    _, _, path, want = made
    assert split_greedy(path, SPLITS[ways], [PROMPT], NEW_TOKENS) == [want]


def test_four_batched_sessions_each_get_their_own_tokens(made):
    model, _, path, _ = made
    assert_four_sessions_batch_alike(model, path, PROMPT, SPLITS[3])


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_every_tensor_of_every_block_is_consumed(made, moe, variant):
    source = open_model(str((made if variant == "dense" else moe)[2]))
    for i in range(source.config.num_layers):
        raw = source.block_raw(i)
        Block.load(source.config, i, raw, "float32", None)
        assert not raw.unread()


def test_a_span_holding_a_kv_sharing_layer_without_its_source_is_refused_by_name(made):
    with pytest.raises(SpanError, match="layer 4 reads the keys and values of layer 2"):
        Span.load(open_model(str(made[2])), 3, 6, weights="float32")


def test_a_q8_0_table_split_inside_its_blocks_gives_the_whole_s_tokens(made, tmp_path):
    """Each layer's 16 columns of the per-layer table are half a Q8_0 block: a span starting
    at layer 1 reads its columns out of blocks it shares with layer 0."""
    path = write_gguf(made[1], tmp_path / "q8.gguf", "Q8_0")
    whole = split_greedy(path, SPLITS[1], [PROMPT], NEW_TOKENS)
    assert split_greedy(path, SPLITS[3], [PROMPT], NEW_TOKENS) == whole


@pytest.mark.parametrize("ways", [1, 3])
def test_the_mixture_gives_transformers_greedy_tokens(moe, ways):
    _, _, path, want = moe
    assert open_model(str(path)).config.arch == "gemma4 8/3"
    assert split_greedy(path, SPLITS[ways], [PROMPT], NEW_TOKENS) == [want]


def test_the_mixture_batches_four_sessions(moe):
    model, _, path, _ = moe
    assert_four_sessions_batch_alike(model, path, PROMPT, SPLITS[3])


def _rewritten(path, to, fields=None, tensors=None):
    """The GGUF file at `path` with `fields` (key -> value) and `tensors` (name -> float32
    array) in place of its own."""
    fields, tensors = fields or {}, tensors or {}
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(to), "gemma4")
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = fields.get(key, f.contents())
        if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, f.types[0] if f.types else None)
    for t in reader.tensors:
        data = tensors.get(t.name, np.asarray(t.data))
        writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return to


@pytest.mark.parametrize(
    "fields, tensors, said",
    [
        ({}, {"rope_freqs.weight": np.full(24, 2.0, np.float32)}, "rope_freqs other than"),
        ({"gemma4.rope.dimension_count_swa": 16}, {}, "sliding layers' RoPE over part"),
        ({"gemma4.feed_forward_length": [128, 256] * 3}, {}, "only the KV-sharing layers'"),
        ({"gemma4.attention.head_count_kv": [2, 1, 2, 2, 2, 1]}, {}, "full layers of differing"),
    ],
    ids=["rope_freqs", "partial_rope", "feed_forward", "kv_heads"],
)
def test_what_the_file_says_that_is_not_computed_is_refused_by_name(
    made, tmp_path, fields, tensors, said
):
    other = _rewritten(made[2], tmp_path / "other.gguf", fields, tensors)
    with pytest.raises(ValueError, match=said):
        open_model(str(other))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_three_nodes_from_the_file_give_transformers_tokens(made, moe, variant):
    _, _, path, want = made if variant == "dense" else moe
    assert nodes_greedy(path, SPLITS[3], PROMPT, NEW_TOKENS) == want
