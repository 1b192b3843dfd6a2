"""Qwen3.5 gives transformers' own tokens: tiny random ones, dense and MoE (swarm.model.tiny: 6
layers, Gated DeltaNet but for layers 2 and 5, full attention with an output gate and partial
rotary; the MoE's 8 experts top 3 beside a gated shared expert) from their safetensors folders
and from GGUF files as llama.cpp's converter writes them (qwen35, qwen35moe: value heads tiled),
split between DeltaNet and full-attention layers, in process and through 3 nodes; batched
sessions keep their states apart; what a fixed-size state cannot do is refused by name."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from devtools import gguf_check
from devtools.hf_to_gguf import write_gguf
from swarm.errors import SpeculationRefused
from swarm.model.blocks import Block, KVCache, Span
from swarm.model.deltanet import DeltaNetNoRewind, State
from swarm.model.head import Head
from swarm.model.source import open_model
from swarm.model.tiny import min_greedy_margin, reference_greedy, save_tiny, save_tiny_tokenizer
from tests.conftest import FAMILY_NEW_TOKENS, FAMILY_PROMPT, nodes_greedy, split_greedy
from tests.helpers.tiny import assert_four_sessions_batch_alike, changed_copy

FAMILIES = ["qwen3_5", "qwen3_5_moe"]
# layers 2 and 5 are full attention: each split falls between the two kinds
SPLITS = {1: [(0, 6)], 2: [(0, 2), (2, 6)], 3: [(0, 2), (2, 3), (3, 6)]}
PROMPT, NEW_TOKENS = FAMILY_PROMPT, FAMILY_NEW_TOKENS
LONG_PROMPT = [(11 * i + 5) % 500 + 5 for i in range(70)]  # past one chunk of 64


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """family -> (reference model, safetensors folder, its greedy tokens after PROMPT, F32 GGUF
    written as llama.cpp writes it)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            folder = tmp_path_factory.mktemp(family)
            model = save_tiny(family, folder)
            save_tiny_tokenizer(folder)
            path = write_gguf(folder, tmp_path_factory.mktemp("gguf") / f"{family}.gguf")
            cache[family] = model, folder, reference_greedy(model, PROMPT, NEW_TOKENS), path
        return cache[family]

    return get


@pytest.mark.parametrize("ways", [1, 2, 3])
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_split_gives_transformers_greedy_tokens(made, family, fmt, ways):
    _, folder, want, path = made(family)
    got = split_greedy(folder if fmt == "safetensors" else path, SPLITS[ways], [PROMPT], NEW_TOKENS)
    assert got == [want]


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_four_batched_sessions_each_get_their_own_tokens(made, family, fmt):
    model, folder, _, path = made(family)
    assert_four_sessions_batch_alike(
        model, folder if fmt == "safetensors" else path, PROMPT, SPLITS[3]
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_longer_than_a_chunk_gives_transformers_tokens(made, family):
    model, folder, _, _ = made(family)
    want = reference_greedy(model, LONG_PROMPT, 30)
    assert split_greedy(folder, SPLITS[2], [LONG_PROMPT], 30) == [want]


def _greedy_in_pieces(folder, pieces: list[list[int]], new_tokens: int) -> list[int]:
    """Greedy tokens after a prompt fed in several passes, as a node's prompt passes feed it."""
    source = open_model(str(folder))
    head, span = Head.load(source, weights="float32"), Span.load(source, 0, 6, weights="float32")
    cache = span.allocate_cache(0, 6, 128)
    for piece in pieces:
        x = span.forward(head.embed_tokens(piece), cache, cache.length, 0, 6)
    tokens = [int(head.logits(x[0, -1]).argmax())]
    for _ in range(new_tokens - 1):
        x = span.decode(head.embed_tokens(tokens[-1:])[0], [cache], [cache.length], 0, 6)
        tokens.append(int(head.logits_rows(x)[0].argmax()))
    return tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_a_prompt_fed_in_passes_carries_the_state_from_one_to_the_next(made, family):
    _, folder, want, _ = made(family)
    pieces = [PROMPT[:12], PROMPT[12:13], PROMPT[13:]]  # one pass of a single token among them
    assert _greedy_in_pieces(folder, pieces, NEW_TOKENS) == want


@pytest.mark.parametrize("family", FAMILIES)
def test_the_greedy_tokens_are_varied_and_clear_of_ties(made, family):
    model, _, want, _ = made(family)
    assert len(set(want)) >= 20
    assert min_greedy_margin(model, PROMPT, NEW_TOKENS) > 1e-3


def test_the_cache_holds_a_fixed_state_for_each_deltanet_layer_and_keys_for_the_others(made):
    _, folder, _, _ = made("qwen3_5")
    c = open_model(str(folder)).config
    cache = KVCache.allocate(c, 1, 6, 100)  # layers 1-5 of the model
    assert sorted(cache.states) == [0, 2, 3]  # model layers 1, 3, 4
    state = cache.states[0]
    assert tuple(state.conv.shape) == (2 * 2 * 16 + 4 * 24, 4)  # q, k, v channels x kernel
    assert tuple(state.s.shape) == (4, 16, 24)  # value heads x key dim x value dim
    assert State.nbytes(c.delta) == state.conv.nbytes + state.s.nbytes
    assert [k.numel() for k in cache.keys] == [0, 2 * 100 * 32, 0, 0, 2 * 100 * 32]


def test_the_cache_bytes_a_token_budgeted_count_only_the_full_attention_layers(made):
    _, folder, _, _ = made("qwen3_5")
    c = open_model(str(folder)).config
    cache = KVCache.allocate(c, 0, 6, 100)
    held = sum(t.nbytes for t in (*cache.keys, *cache.values))  # layers 2 and 5 grow
    assert KVCache.bytes_per_token(c, 6) * 100 == held == 2 * (2 * 100 * 32 * 2) * 4
    assert KVCache.bytes_per_token(c, 2) == 0  # layers 0 and 1: Gated DeltaNet


def test_a_rewind_of_a_deltanet_state_is_refused_by_name(made):
    _, folder, _, _ = made("qwen3_5")
    source = open_model(str(folder))
    head, span = Head.load(source, weights="float32"), Span.load(source, 0, 6, weights="float32")
    cache = span.allocate_cache(0, 6, 64)
    span.forward(head.embed_tokens(PROMPT), cache, 0, 0, 6)
    with pytest.raises(DeltaNetNoRewind, match="Gated DeltaNet"):
        cache.rewind(len(PROMPT) - 2)
    assert cache.length == len(PROMPT)


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_of_every_block_is_consumed(made, family, fmt):
    _, folder, _, path = made(family)
    source = open_model(str(folder if fmt == "safetensors" else path))
    for block in range(6):
        raw = source.block_raw(block)
        Block.load(source.config, block, raw, "float32", None)
        assert not raw.unread()


def test_the_attention_gate_changes_what_the_model_computes(made, tmp_path):
    """q_proj's gate rows are read: zeroed, the gate is sigmoid(0) = 1/2 everywhere."""
    _, folder, want, _ = made("qwen3_5")

    def no_gate(state):
        for name in [n for n in state if n.endswith("self_attn.q_proj.weight")]:
            q = state[name].view(4, 2, 32, 64).clone()
            q[:, 1] = 0
            state[name] = q.view(256, 64)
        return state

    other = changed_copy(folder, tmp_path, state_change=no_gate)
    assert split_greedy(other, SPLITS[1], [PROMPT], NEW_TOKENS) != [want]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_multimodal_folder_serves_its_text_model_skipping_vision_and_mtp(made, tmp_path, family):
    """As transformers saves Qwen3_5ForConditionalGeneration (and the Hub's checkpoints are):
    the text model under model.language_model., the vision tower under model.visual., the
    multi-token-prediction weights under mtp.; config.json's text_config."""
    _, folder, want, _ = made(family)
    text = json.loads((folder / "config.json").read_text())
    whole = {"model_type": family, "text_config": text, "vision_config": {"depth": 1}}
    whole["tie_word_embeddings"] = False

    def multimodal(state):
        out = {k.replace("model.", "model.language_model.", 1): v for k, v in state.items()}
        out["model.visual.blocks.0.attn.qkv.weight"] = torch.ones(96, 32)
        out["mtp.fc.weight"] = torch.ones(64, 128)
        return out

    other = changed_copy(folder, tmp_path, state_change=multimodal)
    (other / "config.json").write_text(json.dumps(whole))
    assert open_model(str(other)).config.family == family
    assert split_greedy(other, SPLITS[2], [PROMPT], NEW_TOKENS) == [want]


def test_the_file_has_llama_cpp_s_keys_names_and_tiled_value_heads(made):
    model, folder, _, path = made("qwen3_5")
    fields = gguf.GGUFReader(str(path)).fields
    expected = {
        "qwen35.ssm.conv_kernel": 4,
        "qwen35.ssm.state_size": 16,
        "qwen35.ssm.group_count": 2,
        "qwen35.ssm.time_step_rank": 4,
        "qwen35.ssm.inner_size": 96,
        "qwen35.full_attention_interval": 3,
        "qwen35.rope.dimension_count": 8,
    }
    for key, value in expected.items():
        assert fields[key].contents() == value, key
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, 6)
    tensors = gguf_check.dequantized(path)
    hf = [n.replace("dt_bias", "dt_proj.bias") for n in model.state_dict()]  # as it renames
    theirs = {names.get_name(n, try_suffixes=(".weight", ".bias")) for n in hf}
    assert set(tensors) == theirs
    a_log = model.state_dict()["model.layers.0.linear_attn.A_log"].numpy()
    tiled = -np.exp(a_log.reshape(2, 2).T.reshape(-1))  # [k0v0 k0v1 k1v0 k1v1] -> v0s, then v1s
    np.testing.assert_array_equal(tensors["blk.0.ssm_a"], tiled)


@pytest.mark.parametrize("arch", ["qwen3next"])
def test_a_qwen3_next_gguf_is_refused_by_its_architecture(tmp_path, arch):
    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), arch)
    writer.add_block_count(4)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=f"architecture '{arch}' is not one this node computes"):
        open_model(str(tmp_path / "x.gguf"))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("family", FAMILIES)
def test_three_nodes_split_between_deltanet_and_attention_layers_give_transformers_tokens(
    made, family, fmt
):
    _, folder, want, path = made(family)
    got = nodes_greedy(str(folder if fmt == "safetensors" else path), SPLITS[3], PROMPT, NEW_TOKENS)
    assert got == want


def test_speculative_decoding_is_refused_by_name_and_off_by_default(made, dht_peers):
    from swarm.client.client import Client

    _, folder, _, _ = made("qwen3_5")
    client = Client(dht_peers, model=str(folder), wire_dtype="float32")
    try:
        assert client.drafter() is None  # the client's default, lookup, does not apply
        with pytest.raises(SpeculationRefused, match="Gated DeltaNet"):
            client.session(64, speculative="lookup")
    finally:
        client.close()


def test_a_state_is_the_same_whether_its_session_decodes_alone_or_batched(made):
    """Up to float32 rounding: a matmul over two rows may sum in another order than over one."""
    _, folder, _, _ = made("qwen3_5_moe")
    source = open_model(str(folder))
    head, span = Head.load(source, weights="float32"), Span.load(source, 0, 6, weights="float32")
    alone, batched, other = (span.allocate_cache(0, 6, 64) for _ in range(3))
    for cache, prompt in ((alone, PROMPT), (batched, PROMPT), (other, PROMPT[::-1])):
        span.forward(head.embed_tokens(prompt), cache, 0, 0, 6)
    token = head.embed_tokens([7])[0]
    span.decode(token, [alone], [alone.length], 0, 6)
    span.decode(torch.cat((token, token)), [other, batched], [other.length, batched.length], 0, 6)
    for layer in alone.states:
        assert torch.allclose(alone.states[layer].s, batched.states[layer].s, atol=1e-5)
        assert not torch.allclose(other.states[layer].s, batched.states[layer].s, atol=1e-2)


def test_a_node_s_memory_budget_counts_a_state_for_each_session_a_deltanet_block_may_hold(made):
    from swarm.node.config import Limits, NodeConfig
    from swarm.node.measure import blocks_that_fit

    _, folder, _, _ = made("qwen3_5")
    source = open_model(str(folder))
    said = []

    def fit(sessions: int) -> int:
        limits = Limits(max_sessions=sessions, max_cache_tokens=16)
        config = NodeConfig(start=0, end=6, limits=limits, max_memory_mb=8.0, weights="float32")
        return blocks_that_fit(config, source, ("float32",), said.append).blocks

    state = State.nbytes(source.config.delta)  # 8.5 KiB a session here
    assert fit(1) > fit(64)
    assert f"{64 * state / 2**20:.1f} MiB of cache" in said[-1]


def _with_mtp_block(path, to):
    """The GGUF file at `path` as llama.cpp's converter writes a checkpoint with one
    multi-token-prediction layer: block_count one more, nextn_predict_layers 1, and the extra
    block (a full-attention block's tensors and the nextn ones) after the last."""
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(to), "qwen35")
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = f.contents()
        value = value + 1 if key == "qwen35.block_count" else value
        kind = f.types[0] if f.types else None
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, kind)
    writer.add_uint32("qwen35.nextn_predict_layers", 1)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
        if t.name.startswith("blk.5."):  # a full-attention block
            copy = t.name.replace("blk.5.", "blk.6.")
            writer.add_tensor(copy, np.asarray(t.data).copy(), raw_dtype=t.tensor_type)
    writer.add_tensor("blk.6.nextn.eh_proj.weight", np.zeros((64, 128), dtype=np.float32))
    writer.add_tensor("blk.6.nextn.enorm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return to


def test_a_gguf_s_multi_token_prediction_layer_is_skipped_by_name(made, tmp_path):
    _, _, want, path = made("qwen3_5")
    other = _with_mtp_block(path, tmp_path / "mtp.gguf")
    config = open_model(str(other)).config
    assert (config.num_layers, config.mtp_layers) == (6, 1)
    assert split_greedy(other, SPLITS[2], [PROMPT], NEW_TOKENS) == [want]
