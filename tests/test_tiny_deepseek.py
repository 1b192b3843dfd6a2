"""DeepSeek-V3 gives transformers' own tokens: a tiny random one (swarm.model.tiny: 4 layers,
the first dense; latent attention with a q bottleneck; 8 experts in 4 groups, sigmoid routing
with a bias, 2 shared experts; YaRN with DeepSeek's mscale) from its safetensors folder and from
a GGUF written as llama.cpp's deepseek2 converter writes it, split between the dense and the
mixture layers, in process and through 3 nodes; batched sessions; the cache holds the latent."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from devtools import gguf_check, gguf_tables
from devtools.hf_to_gguf import UnsupportedCheckpoint, write_gguf
from swarm.model.blocks import Block, KVCache
from swarm.model.source import open_model
from swarm.model.tiny import reference_greedy, save_tiny
from tests.conftest import FAMILY_NEW_TOKENS, FAMILY_PROMPT, nodes_greedy, split_greedy
from tests.helpers.tiny import assert_four_sessions_batch_alike, changed_copy, logits_of, variant

VARIANTS = {"q-bottleneck": {}, "q-proj": {"q_lora_rank": None}}
SPLITS = {2: [(0, 2), (2, 4)], 3: [(0, 1), (1, 3), (3, 4)]}  # layer 0 dense, 1-3 mixtures
PROMPT, NEW_TOKENS = FAMILY_PROMPT, FAMILY_NEW_TOKENS


@pytest.fixture(scope="module")
def made(tiny_family):
    """variant -> (reference model, safetensors folder, GGUF path, reference tokens)."""
    return lambda name: tiny_family("deepseek_v3", **VARIANTS[name])


@pytest.mark.parametrize("ways", [2, 3])
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_a_split_gives_transformers_greedy_tokens(made, name, fmt, ways):
    _, folder, path, want = made(name)
    got = split_greedy(folder if fmt == "safetensors" else path, SPLITS[ways], [PROMPT], NEW_TOKENS)
    assert got == [want]


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_four_batched_sessions_each_get_their_own_tokens(made, fmt):
    model, folder, path, _ = made("q-bottleneck")
    assert_four_sessions_batch_alike(
        model, folder if fmt == "safetensors" else path, PROMPT, SPLITS[3]
    )


def test_the_greedy_tokens_are_varied_and_clear_of_ties(made):
    from swarm.model.tiny import min_greedy_margin

    model, _, _, want = made("q-bottleneck")
    assert len(set(want)) >= 20
    assert min_greedy_margin(model, PROMPT, NEW_TOKENS) > 1e-3


YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.mark.parametrize(
    "change",
    [
        dict(n_group=1, topk_group=1),  # every group kept
        dict(routed_scaling_factor=1.0),
        dict(norm_topk_prob=False),
        dict(rope_interleave=False),
        dict(rope_parameters={**YARN, "mscale": 0.5, "mscale_all_dim": 0.5}),
        dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    ],
)
def test_each_switch_changes_what_the_tiny_model_computes(made, change):
    model, _, _, _ = made("q-bottleneck")
    long = PROMPT + list(range(40, 80))  # past YaRN's original 32 positions
    ours, theirs = logits_of(model, long), logits_of(variant(model, **change), long)
    assert (ours - theirs).abs().max() > 0.1


def test_the_choice_bias_changes_the_experts_chosen(made, tmp_path):
    model, folder, _, want = made("q-bottleneck")
    state = load_file(folder / "model.safetensors")
    state = {k: torch.zeros_like(v) if "e_score" in k else v for k, v in state.items()}
    other = changed_copy(folder, tmp_path, state_change=lambda _: state)
    assert split_greedy(other, SPLITS[2], [PROMPT], NEW_TOKENS) != [want]


def test_the_cache_holds_each_token_s_latent_and_shared_rotated_key(made):
    _, folder, _, _ = made("q-bottleneck")
    c = open_model(str(folder)).config
    cache = KVCache.allocate(c, 0, 4, 100)
    assert [tuple(k.shape) for k in cache.keys] == [(1, 1, 100, 32)] * 4  # kv_lora_rank
    assert [tuple(v.shape) for v in cache.values] == [(1, 1, 100, 8)] * 4  # qk_rope_head_dim
    # 40 values a token a layer, where expanded keys and values would be 4 x (24 + 24)
    assert KVCache.bytes_per_token(c, 4, torch.bfloat16) == 4 * 40 * 2


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_every_tensor_of_every_block_is_consumed(made, fmt):
    _, folder, path, _ = made("q-bottleneck")
    source = open_model(str(folder if fmt == "safetensors" else path))
    for block in range(4):
        raw = source.block_raw(block)
        Block.load(source.config, block, raw, "float32", None)
        assert not raw.unread()


def test_the_file_s_names_are_gguf_py_s_and_kv_b_is_split_as_llama_cpp_splits_it(made):
    _, folder, path, _ = made("q-bottleneck")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, 4)
    table = gguf_tables.FAMILIES["deepseek_v3"]
    tensors = gguf_check.dequantized(path)
    for hf_name, value in load_file(folder / "model.safetensors").items():
        if gguf_tables.expert_slot(table, hf_name) is not None or "kv_b_proj" in hf_name:
            continue
        ours = gguf_tables.gguf_name(table, hf_name)
        theirs = hf_name.replace("e_score_correction_bias", "e_score_correction.bias")
        assert ours == names.get_name(theirs, try_suffixes=(".weight", ".bias")), hf_name
        np.testing.assert_array_equal(tensors[ours].reshape(value.shape), value.numpy())
    kv_b = load_file(folder / "model.safetensors")["model.layers.2.self_attn.kv_b_proj.weight"]
    per_head = kv_b.view(4, 16 + 24, 32).numpy()  # [head, nope + v, kv_lora_rank]
    np.testing.assert_array_equal(tensors["blk.2.attn_k_b.weight"], per_head[:, :16].swapaxes(1, 2))
    np.testing.assert_array_equal(tensors["blk.2.attn_v_b.weight"], per_head[:, 16:])


def test_the_file_has_llama_cpp_s_deepseek2_keys(made):
    fields = gguf.GGUFReader(str(made("q-bottleneck")[2])).fields
    expected = {
        "deepseek2.attention.head_count_kv": 1,
        "deepseek2.attention.key_length": 40,
        "deepseek2.attention.value_length": 32,
        "deepseek2.attention.key_length_mla": 24,
        "deepseek2.attention.value_length_mla": 24,
        "deepseek2.leading_dense_block_count": 1,
        "deepseek2.expert_shared_count": 2,
        "deepseek2.expert_group_count": 4,
        "deepseek2.expert_group_used_count": 2,
        "deepseek2.expert_gating_func": 2,  # sigmoid
        "deepseek2.expert_weights_scale": 2.5,
        "deepseek2.rope.dimension_count": 8,
        "deepseek2.rope.scaling.yarn_log_multiplier": 0.1,  # 0.1 x mscale_all_dim
    }
    for key, value in expected.items():
        assert fields[key].contents() == pytest.approx(value), key


@pytest.mark.parametrize(
    "config, said",
    [
        (dict(rope_parameters={**YARN, "mscale": 0.7, "mscale_all_dim": 1.0}), "mscale apart"),
        (dict(rope_parameters=YARN), "without mscale_all_dim"),
        (dict(scoring_func="softmax"), "softmax"),
        (dict(rms_norm_eps=1e-5), "rms_norm_eps"),
        (dict(rope_interleave=False), "rope_interleave"),
    ],
)  # fmt: skip
def test_a_checkpoint_the_file_would_misdescribe_is_refused(tmp_path, config, said):
    save_tiny("deepseek_v3", tmp_path, **config)
    with pytest.raises(UnsupportedCheckpoint, match=said):
        write_gguf(tmp_path, tmp_path / "x.gguf")


@pytest.mark.parametrize(
    "change, said",
    [
        ({"model_type": "deepseek_v32", "index_topk": 2048}, "V3.2's sparse attention"),
        ({"index_topk": 2048}, "indexer"),
    ],
)
def test_deepseek_v3_2_s_indexer_is_refused_by_name(made, tmp_path, change, said):
    _, folder, _, _ = made("q-bottleneck")
    with pytest.raises(ValueError, match=said):
        open_model(str(changed_copy(folder, tmp_path, change)))


@pytest.mark.parametrize(
    "drop, said",
    [
        ("deepseek2.attention.key_length_mla", "before llama.cpp split attn_kv_b"),
        ("deepseek2.expert_gating_func", "softmax routing"),
        ("deepseek2.rope.scaling.yarn_log_multiplier", "yarn_log_multiplier"),
    ],
)
def test_a_deepseek2_file_llama_cpp_computes_otherwise_is_refused_by_name(
    made, tmp_path, drop, said
):
    _, _, path, _ = made("q-bottleneck")
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "deepseek2")
    for key, f in reader.fields.items():
        if key == drop or key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = f.contents()
        kind = f.types[0] if f.types else None
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, kind)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=said):
        open_model(str(tmp_path / "x.gguf"))


def test_multi_token_prediction_layers_are_skipped_by_name(made, tmp_path):
    _, folder, _, want = made("q-bottleneck")
    state = load_file(folder / "model.safetensors")
    mtp = {
        k.replace("layers.3.", "layers.4."): v.clone()
        for k, v in state.items()
        if ".layers.3." in k
    }
    mtp["model.layers.4.eh_proj.weight"] = torch.zeros(64, 128)  # what only MTP layers have
    mtp["model.layers.4.enorm.weight"] = torch.ones(64)
    other = changed_copy(
        folder, tmp_path, {"num_nextn_predict_layers": 1}, state_change=lambda _: state | mtp
    )
    assert open_model(str(other)).config.num_layers == 4
    assert split_greedy(other, SPLITS[2], [PROMPT], NEW_TOKENS) == [want]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_three_nodes_split_between_dense_and_mixture_layers_give_transformers_tokens(made, fmt):
    _, folder, path, want = made("q-bottleneck")
    got = nodes_greedy(str(folder if fmt == "safetensors" else path), SPLITS[3], PROMPT, NEW_TOKENS)
    assert got == want


def test_a_latent_cache_handed_over_mid_generation_goes_on_to_the_same_tokens(made):
    from swarm.model.blocks import Span
    from swarm.model.head import Head
    from swarm.node.handover.cache import CacheIntake, slabs
    from tests.helpers.handover import chunks

    model, folder, _, _ = made("q-bottleneck")
    want = reference_greedy(model, PROMPT, 12)
    source = open_model(str(folder))
    head, span = Head.load(source, weights="float32"), Span.load(source, 0, 4, weights="float32")
    sender = span.allocate_cache(0, 4, 64)
    x = span.forward(head.embed_tokens(PROMPT), sender, 0, 0, 4)
    tokens = [int(head.logits(x[0, -1]).argmax())]
    for _ in range(5):
        x = span.decode(head.embed_tokens(tokens[-1:])[0], [sender], [sender.length], 0, 4)
        tokens.append(int(head.logits_rows(x)[0].argmax()))
    receiver = span.allocate_cache(0, 4, 64)
    intake = CacheIntake(receiver, sender.length)
    for chunk in chunks(slabs(sender, 0, sender.length)):
        intake.take(chunk)
    intake.install()
    for _ in range(6):  # on the receiver now
        x = span.decode(head.embed_tokens(tokens[-1:])[0], [receiver], [receiver.length], 0, 4)
        tokens.append(int(head.logits_rows(x)[0].argmax()))
    assert tokens == want
