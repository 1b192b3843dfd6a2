"""A Qwen3.5 session handed over mid-generation (swarm/node/handover/): its Gated DeltaNet
states go with the paused tail, after its last positions, checked against the receiver's span,
and the session goes on there to transformers' tokens without replaying one."""

from __future__ import annotations

import pytest
import torch

from devtools.launch import stop_all
from swarm.errors import HandoverRefused, ShapeMismatch
from swarm.model.blocks import Span
from swarm.model.head import Head
from swarm.model.source import open_model
from swarm.model.tiny import reference_greedy
from swarm.node.handover.cache import CacheIntake, slab_digest, slabs, state_slabs
from swarm.protocol import StateChunk
from swarm.wire import pack_tensor
from tests.conftest import FAMILY_NEW_TOKENS, FAMILY_PROMPT
from tests.helpers.handover import NEW, chunks, handed_over_across_a_leave, state_chunks
from tests.helpers.tiny import four_prompts

FULL_LAYERS = (2, 5)  # the tiny Qwen3.5's full-attention layers; the others Gated DeltaNet


def _decode(head: Head, span: Span, cache, tokens: list[int], n: int) -> None:
    for _ in range(n):
        x = span.decode(head.embed_tokens(tokens[-1:])[0], [cache], [cache.length], 0, 6)
        tokens.append(int(head.logits_rows(x)[0].argmax()))


def _sent_mid_generation(folder):
    """A session 6 tokens into its answer and the cache allocated for it elsewhere, both of
    blocks 0:6 of the model in `folder`: (head, span, sender, receiver, tokens so far)."""
    source = open_model(str(folder))
    head, span = Head.load(source, weights="float32"), Span.load(source, 0, 6, weights="float32")
    sender = span.allocate_cache(0, 6, 128)
    x = span.forward(head.embed_tokens(FAMILY_PROMPT), sender, 0, 0, 6)
    tokens = [int(head.logits(x[0, -1]).argmax())]
    _decode(head, span, sender, tokens, 5)
    return head, span, sender, span.allocate_cache(0, 6, 128), tokens


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_a_cache_handed_over_with_its_states_goes_on_to_transformers_tokens(tiny_family, family):
    _, folder, _, want = tiny_family(family)
    head, span, sender, receiver, tokens = _sent_mid_generation(folder)
    intake = CacheIntake(receiver, sender.length)
    phase, states = slabs(sender, 0, sender.length), state_slabs(sender)
    for chunk in chunks(phase):
        intake.take(chunk)
    for piece in state_chunks(states):
        intake.take_state(piece)
    intake.install()
    assert intake.digest() == slab_digest([phase], states)
    for layer, state in sender.states.items():
        assert torch.equal(receiver.states[layer].s, state.s)
        assert torch.equal(receiver.states[layer].conv, state.conv)
    _decode(head, span, receiver, tokens, FAMILY_NEW_TOKENS - len(tokens))  # there now
    assert tokens == want


def test_a_cache_whose_states_have_not_all_come_is_not_installed(tiny_family):
    _, folder, _, _ = tiny_family("qwen3_5")
    _, _, sender, receiver, _ = _sent_mid_generation(folder)
    intake = CacheIntake(receiver, sender.length)
    for chunk in chunks(slabs(sender, 0, sender.length)):
        intake.take(chunk)
    for piece in state_chunks(state_slabs(sender))[:-1]:
        intake.take_state(piece)
    with pytest.raises(HandoverRefused, match="incomplete .*layer 4's s"):
        intake.install()


@pytest.mark.parametrize("layer", [*FULL_LAYERS, 6])
def test_a_state_for_a_layer_without_one_in_the_span_is_refused(tiny_family, layer):
    _, folder, _, _ = tiny_family("qwen3_5")
    _, _, sender, receiver, _ = _sent_mid_generation(folder)
    intake = CacheIntake(receiver, sender.length)
    for chunk in chunks(slabs(sender, 0, sender.length)):
        intake.take(chunk)
    [(_, conv, _), *_] = state_slabs(sender)
    with pytest.raises(HandoverRefused, match=f"layer {layer} .*no Gated DeltaNet state"):
        intake.take_state(StateChunk("s", layer, "conv", 0, pack_tensor(conv, "float32")))


def test_a_state_of_another_shape_is_refused_before_a_byte_lands(tiny_family):
    _, folder, _, _ = tiny_family("qwen3_5")
    _, _, sender, receiver, _ = _sent_mid_generation(folder)
    intake = CacheIntake(receiver, sender.length)
    for chunk in chunks(slabs(sender, 0, sender.length)):
        intake.take(chunk)
    [(layer, _, s), *_] = state_slabs(sender)
    wider = torch.cat((s, s[..., :1]), dim=-1)  # one more value column a row
    with pytest.raises(ShapeMismatch, match="does not fit"):
        intake.take_state(StateChunk("s", layer, "s", 0, pack_tensor(wider, "float32")))
    taller = torch.cat((s, s[:, :1]), dim=1)  # one more row than the receiver's state holds
    with pytest.raises(ShapeMismatch, match="does not fit"):
        intake.take_state(StateChunk("s", layer, "s", 0, pack_tensor(taller, "float32")))
    assert not receiver.states[layer].s.any()


def test_a_state_before_the_positions_are_complete_is_refused(tiny_family):
    _, folder, _, _ = tiny_family("qwen3_5")
    _, _, sender, receiver, _ = _sent_mid_generation(folder)
    intake = CacheIntake(receiver, sender.length)
    [first, *_] = state_chunks(state_slabs(sender))
    with pytest.raises(HandoverRefused, match="before the positions are complete"):
        intake.take_state(first)


@pytest.mark.slow
def test_a_leaving_node_hands_its_deltanet_sessions_over_and_they_go_on_without_replay(
    tiny_family, dht_peers
):
    model, folder, _, _ = tiny_family("qwen3_5")
    prompts = four_prompts(FAMILY_PROMPT)
    out = handed_over_across_a_leave(folder, dht_peers, prompts, grace=30)
    assert out == [reference_greedy(model, p, NEW) for p in prompts]


@pytest.mark.slow
def test_a_prefill_node_hands_a_deltanet_session_on_to_its_decode_node(tiny_family, dht_peers):
    """P/D: the prompt in passes of 8 on the prefill node, its states carried from pass to pass,
    then handed on with the cache; the decode node computes no prompt and gives transformers'
    tokens."""
    from swarm.client.client import Client
    from swarm.client.routing import HANDOFF_MIN_NEW_TOKENS, PREFILL_MIN_TOKENS
    from tests.helpers.handover import left_with, start_full_node, wait_for_lines

    model, folder, _, _ = tiny_family("qwen3_5")
    prompt, new = [(11 * i + 5) % 500 + 5 for i in range(70)], HANDOFF_MIN_NEW_TOKENS
    assert len(prompt) >= PREFILL_MIN_TOKENS
    decode = start_full_node(folder, dht_peers, "--role", "decode")
    prefill = start_full_node(folder, dht_peers, "--role", "prefill", "--prefill-pass-tokens", "8")
    client = Client(dht_peers, model=str(folder), wire_dtype="float32")
    try:
        with client.session(len(prompt) + new) as s:
            out = [int(s.feed(prompt).argmax())]
            wait_for_lines(prefill, "handed over to", 1)
            while len(out) < new:
                out.append(int(s.feed([out[-1]]).argmax()))
            moved = (s.recoveries, s.remote.moves, [h.peer for h in s.remote.route])
        assert out == reference_greedy(model, prompt, new)
        assert moved == ([], 1, [decode.peer])
        assert left_with(decode) == (0, 1, 0)  # prompt passes, sessions moved in, moved out
    finally:
        client.close()
        stop_all([decode, prefill])
