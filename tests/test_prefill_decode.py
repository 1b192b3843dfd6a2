"""Prefill on one node, decode on another (P/D): a client sends a long prompt to a node that
announces itself for prompts (--role prefill), which computes it, answers the first token and
hands the session, cache and all, to the node the session decodes on (swarm/node/handover/)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from devtools.launch import stop_all
from swarm.client.client import Client
from swarm.client.routing import HANDOFF_MIN_NEW_TOKENS, PREFILL_MIN_TOKENS
from swarm.errors import NodeBusy, ProtocolError
from swarm.model.sampling import Sampler
from swarm.protocol import Error, Open
from swarm.transport import dial_hop
from tests.conftest import reference_greedy
from tests.helpers.handover import (
    LONG_PROMPT,
    PROMPTS,
    left_with,
    start_full_node,
    wait_for_lines,
)

PROMPT = [*LONG_PROMPT, *PROMPTS[0], *PROMPTS[2]]  # 64 tokens
NEW = HANDOFF_MIN_NEW_TOKENS  # long enough an answer to be handed on
SHORT = 16


def generate(
    client: Client, prompt: list[int], handed=None, new: int = NEW
) -> tuple[list[int], int, list[str]]:
    """Greedy tokens of one session; `handed()` runs once the prompt is in. With the hops its
    route moved and the peers it ended on."""
    with client.session(len(prompt) + new) as s:
        logits = s.feed(prompt)
        out = [int(logits.argmax())]
        if handed is not None:
            handed()
        while len(out) < new:
            out.append(int(s.feed([out[-1]]).argmax()))
        return out, s.remote.moves, [h.peer for h in s.remote.route]


def picked(
    client: Client, prompt: list[int], handed=None, new: int = NEW
) -> tuple[list[int], int, list[str]]:
    """As `generate`, in a reply's session: the route's last hop picks each token."""
    with client.session(len(prompt) + new) as s:
        s.sampler = Sampler()
        out = [s.pick(prompt)]
        if handed is not None:
            handed()
        while len(out) < new:
            out.append(s.pick([out[-1]]))
        return out, s.remote.moves, [h.peer for h in s.remote.route]


def test_the_prompt_long_enough_for_a_prefill_node(tiny_model_dir):
    assert len(PROMPT) >= PREFILL_MIN_TOKENS
    assert SHORT < HANDOFF_MIN_NEW_TOKENS


def test_a_p_d_route_gives_the_colocated_tokens_and_the_decode_node_computes_no_prompt(
    dht_peers,  # noqa: F811
    tiny_model_dir,
    tiny_reference,
):
    decode = start_full_node(tiny_model_dir, dht_peers, "--role", "decode")
    # the prompt in 64 passes: its cache streams to the decode node from the first one on
    prefill = start_full_node(
        tiny_model_dir, dht_peers, "--role", "prefill", "--prefill-pass-tokens", "1"
    )
    nodes = [decode, prefill]
    colocated = Client(
        dht_peers, model=str(tiny_model_dir), wire_dtype="float32", disaggregate=False
    )
    split = Client(dht_peers, model=str(tiny_model_dir), wire_dtype="float32")
    try:
        alone, moves, peers = generate(colocated, PROMPT)
        assert (moves, peers) == (0, [decode.peer])  # routes decode off prefill nodes
        out, moves, peers = generate(
            split, PROMPT, lambda: wait_for_lines(prefill, "handed over to", 1)
        )
        [said] = [line for line in prefill.lines if "handed over to" in line]
        assert int(re.search(r"its cache in (\d+) part", said).group(1)) > 1, said
        assert out == alone == reference_greedy(tiny_reference, PROMPT, NEW)
        assert (moves, peers) == (1, [decode.peer])
        # prompt passes, sessions moved in, sessions moved out
        assert left_with(decode) == (1, 1, 0)  # the colocated session's prompt only
        passes, moved_in, moved_out = left_with(prefill)
        assert (passes > 0, moved_in, moved_out) == (True, 0, 1)
    finally:
        colocated.close()
        split.close()
        stop_all(nodes)


def test_a_p_d_route_whose_last_hops_pick_gives_the_colocated_tokens(
    dht_peers,  # noqa: F811
    tiny_model_dir,
    tiny_reference,
):
    decode = start_full_node(tiny_model_dir, dht_peers, "--role", "decode")
    prefill = start_full_node(tiny_model_dir, dht_peers, "--role", "prefill")
    client = Client(dht_peers, model=str(tiny_model_dir), wire_dtype="float32")
    try:
        out, moves, peers = picked(
            client, PROMPT, lambda: wait_for_lines(prefill, "handed over to", 1)
        )
        assert out == reference_greedy(tiny_reference, PROMPT, NEW)
        assert (moves, peers) == (1, [decode.peer])
        assert client._heads == {}  # the prefill node, then the decode node, picked each token
    finally:
        client.close()
        stop_all([decode, prefill])


def test_a_short_answer_stays_on_the_prefill_node(
    dht_peers,  # noqa: F811
    tiny_model_dir,
    tiny_reference,
):
    """Fewer new tokens than HANDOFF_MIN_NEW_TOKENS: moving the cache would cost more than
    decoding them where the prompt was computed."""
    decode = start_full_node(tiny_model_dir, dht_peers, "--role", "decode")
    prefill = start_full_node(tiny_model_dir, dht_peers, "--role", "prefill")
    client = Client(dht_peers, model=str(tiny_model_dir), wire_dtype="float32")
    try:
        out, moves, peers = generate(client, PROMPT, new=SHORT)
        assert out == reference_greedy(tiny_reference, PROMPT, SHORT)
        assert (moves, peers) == (0, [prefill.peer])
        assert left_with(prefill)[2] == 0  # nothing moved out
        assert left_with(decode)[0] == 0  # no prompt pass on the decode node
    finally:
        client.close()
        stop_all([decode, prefill])


def test_a_client_may_hand_on_shorter_answers(
    dht_peers,  # noqa: F811
    tiny_model_dir,
    tiny_reference,
):
    """Client(handoff_min_new=...) lowers the bar: a session of SHORT new tokens moves to the
    decode node too, with the tokens it would have had."""
    decode = start_full_node(tiny_model_dir, dht_peers, "--role", "decode")
    prefill = start_full_node(tiny_model_dir, dht_peers, "--role", "prefill")
    client = Client(
        dht_peers, model=str(tiny_model_dir), wire_dtype="float32", handoff_min_new=SHORT
    )
    try:
        out, moves, peers = generate(
            client, PROMPT, lambda: wait_for_lines(prefill, "handed over to", 1), new=SHORT
        )
        assert out == reference_greedy(tiny_reference, PROMPT, SHORT)
        assert (moves, peers) == (1, [decode.peer])
        assert left_with(prefill)[2] == 1  # moved out
    finally:
        client.close()
        stop_all([decode, prefill])


def test_a_handoff_the_decode_node_cannot_take_leaves_the_session_on_the_prefill_node(
    dht_peers,  # noqa: F811
    tiny_model_dir,
    tiny_reference,
):
    """The decode node crashed after the client last saw it (its record and round trip still
    fresh): the prefill node cannot hand the session on, keeps it and decodes it to the end,
    the same tokens."""
    decode = start_full_node(tiny_model_dir, dht_peers)
    prefill = start_full_node(tiny_model_dir, dht_peers, "--role", "prefill")
    client = Client(dht_peers, model=str(tiny_model_dir), wire_dtype="float32")
    try:
        assert [h.peer for h in client.route()] == [decode.peer]
        decode.proc.kill()
        decode.proc.wait(30)
        out, moves, peers = generate(client, PROMPT)
        assert out == reference_greedy(tiny_reference, PROMPT, NEW)
        assert (moves, peers) == (0, [prefill.peer])
        assert left_with(prefill)[2] == 0
    finally:
        client.close()
        stop_all([decode, prefill])


@pytest.mark.parametrize("role", ["decode", "both"])
def test_an_open_with_a_handoff_the_node_cannot_honour_is_refused(
    dht_peers,  # noqa: F811
    tiny_model_dir,
    role,
):
    """A decode node takes no prompts to hand on (busy: the client routes elsewhere); a
    handoff on a hop that is not the route's last, of other blocks, or to the node itself is
    malformed (a protocol error). Nothing of it stays open."""
    node = start_full_node(tiny_model_dir, dht_peers, "--role", role)
    client = Client(dht_peers, model=str(tiny_model_dir), wire_dtype="float32")
    try:
        [hop] = client.route()
        other = replace(hop, peer="12D3KooWOther", port=hop.port + 1)
        half = replace(hop, end=3)
        opens = {
            "a handoff to the node itself": ((hop,), hop),
            "a handoff of other blocks": ((hop,), replace(other, end=3)),
            "a handoff on a hop before the last": ((half, replace(other, start=3)), half),
        }
        if role == "decode":
            opens["a decode node's handoff"] = ((hop,), other)

        async def answer(route, to):
            conn = await dial_hop(hop)
            try:
                await conn.send(
                    Open(
                        sid="a" * 32,
                        route=route,
                        hop=0,
                        fingerprint=client.fingerprint,
                        wire_dtype="float32",
                        max_length=128,
                        sink_token="b" * 32,
                        handoff=to,
                    )
                )
                return await conn.receive()
            finally:
                await conn.aclose()

        for what, (route, to) in opens.items():
            reply = client.loop.run(answer, route, to)
            assert isinstance(reply, Error), what
            expected = NodeBusy if what == "a decode node's handoff" else ProtocolError
            assert reply.code == expected.code, (what, reply)
    finally:
        client.close()
        stop_all([node])
