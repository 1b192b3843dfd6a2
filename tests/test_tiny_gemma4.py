"""A tiny random Gemma 4 (sliding and full layers by turns, full layers with their own head width
and keys as values, proportional RoPE, per-layer inputs from the token ids, the last two layers
reading earlier layers' KV) gives transformers' greedy tokens at float32, split or not,
batched, and through real nodes (replays and verification rounds too); a span that would cut
a KV-sharing layer from its source is refused by name; each switch changes what it computes."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
import torch
import transformers

from devtools.launch import start_node, start_swarm, stop_all
from swarm.errors import ProtocolError, SpanError
from swarm.model.blocks import Span
from swarm.model.families import config_from_hf
from swarm.model.head import Head
from swarm.model.source import open_model
from swarm.model.tiny import reference_greedy, save_tiny
from tests.conftest import FAMILY_NEW_TOKENS, FAMILY_PROMPT, split_greedy, swarm_greedy
from tests.helpers.flags import exact_flags
from tests.helpers.tiny import assert_four_sessions_batch_alike, changed_copy

PROMPT, NEW_TOKENS = FAMILY_PROMPT, FAMILY_NEW_TOKENS
# layers s f s f s f (window 8); layer 4 reads layer 2's KV, layer 5 layer 3's: every split
# keeps 2:6 whole, and cuts between a sliding and a full layer
SPLITS = {1: [(0, 6)], 2: [(0, 1), (1, 6)], 3: [(0, 1), (1, 2), (2, 6)]}
MOE = dict(enable_moe_block=True, num_experts=8, top_k_experts=3, moe_intermediate_size=32)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(reference model, safetensors folder, the model's greedy tokens after PROMPT)."""
    folder = tmp_path_factory.mktemp("gemma4")
    model = save_tiny("gemma4", folder)
    return model, folder, reference_greedy(model, PROMPT, NEW_TOKENS)


def test_the_config_has_its_layer_kinds_shared_kv_and_per_layer_inputs(made):
    _, folder, _ = made
    c = open_model(str(folder)).config
    assert (c.family, c.windows) == ("gemma4", (8, None, 8, None, 8, None))
    assert [c.kv_source(i) for i in range(6)] == [None, None, None, None, 2, 3]
    assert [(c.at(i).head_dim, c.at(i).kv_heads, c.at(i).k_eq_v) for i in (0, 1)] == [
        (32, 2, False),
        (48, 1, True),
    ]
    assert [c.at(i).intermediate for i in (3, 4)] == [128, 256]  # double wide where shared
    assert (c.per_layer, c.attention_scale, c.norm_offset, c.final_softcap) == (16, 1.0, 0, 10.0)
    assert (c.rope.theta, c.rope.proportion, c.local_rope.proportion) == (1e6, 0.25, 1.0)


@pytest.mark.parametrize("ways", [1, 2, 3])
def test_a_split_gives_transformers_greedy_tokens(made, ways):
    _, folder, want = made
    assert len(PROMPT) + NEW_TOKENS > 8  # past the window
    assert split_greedy(folder, SPLITS[ways], [PROMPT], NEW_TOKENS) == [want]


def test_four_batched_sessions_each_get_their_own_tokens(made):
    model, folder, _ = made
    assert_four_sessions_batch_alike(model, folder, PROMPT, SPLITS[3])


@pytest.mark.parametrize(
    "span, reader, source", [((3, 6), 4, 2), ((4, 6), 4, 2), ((5, 6), 5, 3)], ids=str
)
def test_a_span_holding_a_kv_sharing_layer_without_its_source_is_refused_by_name(
    made, span, reader, source
):
    _, folder, _ = made
    said = f"layer {reader} reads the keys and values of layer {source}"
    with pytest.raises(SpanError, match=said):
        Span.load(open_model(str(folder)), *span, weights="float32")


def test_a_cache_for_a_sub_range_cutting_a_kv_sharing_layer_from_its_source_is_refused(made):
    _, folder, _ = made
    span = Span.load(open_model(str(folder)), 2, 6, weights="float32")
    with pytest.raises(SpanError, match="layer 4 .* layer 2"):
        span.allocate_cache(3, 6, 64)


def test_a_kv_sharing_layer_holds_no_cache_of_its_own(made):
    _, folder, _ = made
    cache = Span.load(open_model(str(folder)), 2, 6, weights="float32").allocate_cache(2, 6, 64)
    assert cache.keys[2] is cache.keys[0] and cache.values[3] is cache.values[1]


def test_the_cache_bytes_a_token_budgeted_are_what_a_sessions_cache_holds(made):
    """Full layers wider (1 kv head of 48 against 2 of 32), KV-sharing layers none (a session
    no longer than the window: the sliding layers' rings hold every position)."""
    from swarm.model.blocks import KVCache

    _, folder, _ = made
    c = open_model(str(folder)).config
    cache = Span.load(open_model(str(folder)), 0, 6, weights="float32").allocate_cache(0, 6, 8)
    held = {id(t): t.nbytes for t in (*cache.keys, *cache.values)}
    assert KVCache.bytes_per_token(c, 6) == sum(held.values()) // 8 == (2 * 64 + 2 * 48) * 2 * 4
    assert KVCache.bytes_per_token(c, 3, start=3) == 48 * 2 * 4


def test_a_step_without_its_token_ids_is_refused(made):
    _, folder, _ = made
    source = open_model(str(folder))
    span = Span.load(source, 0, 2, weights="float32")
    h = Head.load(source, weights="float32").embed_tokens(PROMPT[:4])
    with pytest.raises(ProtocolError, match="token id of each"):
        span.forward(h, span.allocate_cache(0, 2, 64), 0, 0, 2)
    with pytest.raises(ProtocolError, match="token id of each"):
        span.forward(h, span.allocate_cache(0, 2, 64), 0, 0, 2, ids=PROMPT[:3])


def test_a_verification_pass_past_the_window_matches_plain_decode_steps(made):
    """A verification round's rows share one cache: the sliding layer a KV-sharing layer reads
    is a full ring each row rewrites, so each row must see the ring as its own step left it
    (a row that saw a later row's keys is off by whole units; stacked rows' float32 matmuls
    by rounding)."""
    _, folder, _ = made
    source = open_model(str(folder))
    head = Head.load(source, weights="float32")
    span = Span.load(source, 0, 6, weights="float32")
    drafts = PROMPT[20:26]
    outs = []
    for verify in (False, True):
        cache = span.allocate_cache(0, 6, 128)
        span.forward(head.embed_tokens(PROMPT), cache, 0, 0, 6, ids=PROMPT)
        x = head.embed_tokens(drafts)[0]
        positions = list(range(len(PROMPT), len(PROMPT) + len(drafts)))
        if verify:
            outs.append(span.decode(x, [cache] * len(drafts), positions, 0, 6, ids=drafts))
        else:
            steps = zip(x, positions, drafts)
            rows = [span.decode(row[None], [cache], [p], 0, 6, ids=[t]) for row, p, t in steps]
            outs.append(torch.cat(rows))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-3)


def _scale_table(state):
    return {k: v * 0.5 if "embed_tokens_per_layer" in k else v for k, v in state.items()}


def _unit_scalars(state):
    return {k: torch.ones_like(v) if k.endswith("layer_scalar") else v for k, v in state.items()}


def _rope(full: dict) -> dict:
    return {
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
    }


@pytest.mark.parametrize(
    "change",
    [
        dict(state_change=_scale_table),
        dict(state_change=_unit_scalars),
        dict(config_change=_rope({"rope_type": "default", "rope_theta": 1e6})),
    ],
    ids=["per-layer-table", "layer-scalars", "proportional-rope"],
)
def test_each_switch_changes_what_the_tiny_model_computes(made, tmp_path, change):
    _, folder, want = made
    other = changed_copy(folder, tmp_path, **change)
    assert split_greedy(other, SPLITS[2], [PROMPT], NEW_TOKENS) != [want]


@pytest.mark.parametrize(
    "change",
    [{"layer_types": ["sliding_attention"] * 6}, {"layer_types": None}],
    ids=["last-forced-full", "default-pattern"],
)
def test_layer_kinds_are_transformers_own(made, change):
    """transformers makes the last layer full whatever the list says, and without a list
    takes 5 sliding layers then a full one."""
    _, folder, _ = made
    config = {**json.loads((folder / "config.json").read_text()), **change}
    config["num_kv_shared_layers"] = 0  # else layer 5 would share a full layer's KV: none
    types = transformers.Gemma4TextConfig(**config).layer_types
    want = tuple(8 if t == "sliding_attention" else None for t in types)
    assert want == (8, 8, 8, 8, 8, None)
    assert config_from_hf(config, "g", "g")[0].windows == want


@pytest.fixture(scope="module")
def multimodal(made, tmp_path_factory):
    """The tiny model as a multimodal checkpoint (Gemma4ForConditionalGeneration, a small
    vision tower beside it, as the Hub's Gemma 4 folders are): (model, folder)."""
    model, _, _ = made
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, head_dim=16)
    vision |= dict(num_attention_heads=2, num_key_value_heads=2)
    config = transformers.Gemma4Config(text_config=model.config.to_dict(), vision_config=vision)
    whole = transformers.Gemma4ForConditionalGeneration(config).float().eval()
    whole.model.language_model.load_state_dict(model.model.state_dict())
    folder = tmp_path_factory.mktemp("gemma4-multimodal")
    whole.save_pretrained(folder)
    return whole, folder


def test_a_multimodal_folder_serves_its_text_model_its_towers_skipped(made, multimodal, caplog):
    _, _, want = made
    whole, folder = multimodal
    with caplog.at_level("INFO", logger="swarm.model"):
        assert open_model(str(folder)).config.family == "gemma4"
    assert "embed_vision, vision_tower skipped" in caplog.text
    assert reference_greedy(whole, PROMPT, NEW_TOKENS) == want
    assert split_greedy(folder, SPLITS[3], [PROMPT], NEW_TOKENS) == [want]


# ---- the mixture-of-experts variant (26B-A4B's): a dense MLP beside 8 experts, top 3 ----


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(reference model, safetensors folder, greedy tokens) of the tiny Gemma 4 with experts."""
    folder = tmp_path_factory.mktemp("gemma4-moe")
    model = save_tiny("gemma4", folder, **MOE)
    return model, folder, reference_greedy(model, PROMPT, NEW_TOKENS)


def test_the_mixture_config_names_its_experts(moe):
    c = open_model(str(moe[1])).config
    assert (c.experts, c.experts_used, c.expert_intermediate, c.arch) == (8, 3, 32, "gemma4 8/3")


@pytest.mark.parametrize("ways", [1, 3])
def test_the_mixture_split_gives_transformers_greedy_tokens(moe, ways):
    _, folder, want = moe
    assert split_greedy(folder, SPLITS[ways], [PROMPT], NEW_TOKENS) == [want]


def test_the_mixture_batches_four_sessions(moe):
    model, folder, _ = moe
    assert_four_sessions_batch_alike(model, folder, PROMPT, SPLITS[3])


def _ones(ending: str):
    def change(state):
        return {k: torch.ones_like(v) if k.endswith(ending) else v for k, v in state.items()}

    return change


@pytest.mark.parametrize("ending", ["router.scale", "router.per_expert_scale"])
def test_each_router_scale_changes_what_the_mixture_computes(moe, tmp_path, ending):
    _, folder, want = moe
    other = changed_copy(folder, tmp_path, state_change=_ones(ending))
    assert split_greedy(other, SPLITS[1], [PROMPT], NEW_TOKENS) != [want]


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_every_tensor_of_every_block_is_consumed(made, moe, variant):
    from swarm.model.blocks import Block

    _, folder, _ = made if variant == "dense" else moe
    source = open_model(str(folder))
    for i in range(source.config.num_layers):
        raw = source.block_raw(i)
        Block.load(source.config, i, raw, "float32", None)
        assert not raw.unread()


@pytest.fixture(scope="module")
def served(made):
    """A client of 3 real nodes serving the tiny Gemma 4 at float32, split SPLITS[3]."""
    from swarm.client.client import Client

    _, folder, _ = made
    nodes = start_swarm(SPLITS[3], model=str(folder), extra=exact_flags(ttl=30))
    client = Client(nodes[0].maddrs[:1], model=str(folder), wire_dtype="float32")
    yield client
    client.close()
    stop_all(nodes)


@pytest.mark.slow
def test_three_nodes_split_between_layer_kinds_give_transformers_tokens(made, served):
    _, _, want = made
    assert swarm_greedy(served, PROMPT, NEW_TOKENS) == want


@pytest.mark.slow
def test_a_session_on_a_new_route_mid_reply_replays_its_ids_and_goes_on_alike(made, served):
    _, _, want = made
    out = []
    with served.session(len(PROMPT) + NEW_TOKENS) as s:
        logits = s.feed(PROMPT)
        for i in range(NEW_TOKENS):
            out.append(int(logits.argmax()))
            if i == NEW_TOKENS // 2:
                s.close()  # the next step opens a route anew and replays the history
            logits = s.feed([out[-1]])
    assert out == want


@pytest.mark.slow
def test_verification_rounds_through_nodes_give_plain_greedy_tokens(made, served):
    """Prompt lookup drafts from a prompt that repeats itself: rounds of several tokens, each
    carrying its ids, past the window of the rings the KV-sharing layers read."""
    from swarm.client.decoding import Decoding
    from swarm.client.options import Sampling
    from swarm.client.reply import Sampler

    model, _, _ = made
    prompt = PROMPT[:10] * 3
    with served.session(len(prompt) + NEW_TOKENS, "lookup") as session:
        decoding = Decoding(session, prompt, NEW_TOKENS, Sampler(Sampling()), session.drafter)
        out = list(decoding)
    assert decoding.stats.rounds > 0
    assert out == reference_greedy(model, prompt, NEW_TOKENS)


@pytest.mark.slow
def test_a_node_asked_for_a_sharing_layer_without_its_source_refuses_by_name(made):
    _, folder, _ = made
    node = start_node((3, 6), model=str(folder), extra=exact_flags(), stderr=subprocess.STDOUT)
    try:
        with pytest.raises(RuntimeError, match="layer 4 reads the keys and values of layer 2"):
            node.wait_serving(timeout=120)
    finally:
        stop_all([node])


def test_a_cache_handed_over_past_the_window_computes_on_alike(made):
    """swarm.node.handover.cache's transfer of blocks 2:6 at position 50 (rings wrapped; a
    KV-sharing layer's entry its source's tensors, sent twice): the receiving cache equals the
    sender's and the next steps give the same outputs, bit for bit."""
    from swarm.node.handover.cache import CacheIntake, slabs
    from swarm.protocol import KvChunk
    from swarm.wire import pack_tensor

    _, folder, want = made
    source = open_model(str(folder))
    head = Head.load(source, weights="float32")
    a, b = (Span.load(source, *s, weights="float32") for s in ((0, 2), (2, 6)))
    ca, cb = a.allocate_cache(0, 2, 128), b.allocate_cache(2, 6, 128)
    b.forward(a.forward(head.embed_tokens(PROMPT), ca, 0, 0, 2, ids=PROMPT), cb, 0, 2, 6, PROMPT)
    moved = None
    for pos, token in zip(range(len(PROMPT), 70), want):
        if pos == 50:
            moved = b.allocate_cache(2, 6, 128)
            intake = CacheIntake(moved, 50)
            for layer, (first, k, v) in enumerate(slabs(cb, 0, 50)):
                pack = (pack_tensor(k, "float32"), pack_tensor(v, "float32"))
                intake.take(KvChunk(sid="s", layer=layer, pos=first, keys=pack[0], values=pack[1]))
            moved.length = 50
            assert all(
                torch.equal(x, y) for x, y in zip(cb.keys + cb.values, moved.keys + moved.values)
            )
        h = a.forward(head.embed_tokens([token]), ca, pos, 0, 2, ids=[token])
        out = b.forward(h, cb, pos, 2, 6, ids=[token])
        if moved is not None:
            assert torch.equal(b.forward(h, moved, pos, 2, 6, ids=[token]), out)


@pytest.mark.slow
def test_a_leaving_last_hop_hands_a_session_over_and_it_goes_on_alike(made, dht_peers):
    """The leaving node's cache goes as it is (a KV-sharing layer's entry is its source's
    tensors, sent and received twice); the session goes on there without replaying a token.
    In process, the same transfer (handover.cache's slabs into a CacheIntake) leaves the
    receiving cache equal and the next 20 steps identical."""
    from swarm.client.client import Client
    from tests.helpers.handover import start_full_node, wait_for_lines

    _, folder, want = made
    first = start_full_node(folder, dht_peers, layers=(0, 2))
    leaving = start_full_node(folder, dht_peers, "--grace", "20", layers=(2, 6))
    client = Client(dht_peers, model=str(folder), wire_dtype="float32", step_timeout=10)
    replica = None
    try:
        out = []
        with client.session(len(PROMPT) + NEW_TOKENS) as s:
            logits = s.feed(PROMPT)
            for i in range(NEW_TOKENS):
                if i == NEW_TOKENS // 2:
                    replica = start_full_node(folder, dht_peers, layers=(2, 6))
                    leaving.proc.send_signal(signal.SIGTERM)
                    wait_for_lines(leaving, "handed over to", 1)
                out.append(int(logits.argmax()))
                logits = s.feed([out[-1]])
            moved = (s.recoveries, s.remote.moves, [h.peer for h in s.remote.route])
        assert out == want
        assert moved == ([], 1, [first.peer, replica.peer])
    finally:
        client.close()
        stop_all([first, leaving] + ([replica] if replica else []))
