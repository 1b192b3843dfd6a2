"""Speculative decoding through real nodes at float32: on every family of the families table,
greedy replies drafted by prompt lookup, by the served model itself and by another model are
plain decoding's tokens, through 3 nodes, past every sliding window; a sampled reply is the
same under the same seed; malformed rounds get typed errors and the session goes on; a node
killed while rounds are in flight costs a reroute, not a token."""

from __future__ import annotations

import pytest
import torch

from devtools.launch import start_swarm, stop_all
from swarm.client.client import Client
from swarm.client.decoding import Decoding
from swarm.client.options import Sampling
from swarm.client.reply import Sampler
from swarm.client.tuner import MAX_DRAFTS, MAX_IN_FLIGHT, Tuner
from swarm.errors import ProtocolError, ShapeMismatch, SwarmError
from swarm.model.tiny import FAMILIES, reference_greedy
from swarm.protocol import MAX_VERIFY_TOKENS, Error
from tests.conftest import SPLITS
from tests.helpers.flags import exact_flags
from tests.helpers.speculation import Fixed

# repeats itself, so prompt lookup drafts from the start; with the reply, past every window
PROMPT = [(7 * i + 3) % 500 + 5 for i in range(10)] * 3
NEW = 40


def decode(client: Client, ids, new: int, speculative: str, tuner: Tuner | None = None, **sampling):
    """A reply's tokens through `client`; its speculation stats; the most rounds in flight.
    `tuner`: the client's own, measuring, unless another is given."""
    sampler = Sampler(Sampling(**sampling))
    with client.session(len(ids) + new, speculative) as session:
        decoding = Decoding(session, ids, new, sampler, session.drafter, tuner)
        out, in_flight = [], 0
        for token in decoding:
            out.append(token)
            in_flight = max(in_flight, len(decoding.rounds))
    return out, decoding.stats, in_flight


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_family):
    """(family, its tiny model, a client of 3 nodes serving it at float32)."""
    model, folder, _, _ = tiny_family(request.param)
    nodes = start_swarm(SPLITS[3], model=str(folder), extra=exact_flags(ttl=30))
    client = Client(nodes[0].maddrs[:1], model=str(folder), wire_dtype="float32")
    yield request.param, model, client
    client.close()
    stop_all(nodes)


def test_greedy_tokens_without_speculation_are_the_models(family):
    _, model, client = family
    out, stats, _ = decode(client, PROMPT, NEW, "off")
    assert out == reference_greedy(model, PROMPT, NEW)
    assert stats.rounds == 0


def long_rounds() -> Fixed:
    """As many drafts a round and rounds in flight as there may be (rounds no longer than a
    window): the same rounds every run (the client's own tuner goes by what it measures)."""
    return Fixed(MAX_DRAFTS, MAX_IN_FLIGHT)


def test_greedy_tokens_drafted_by_prompt_lookup_are_plain_decodings(family):
    _, model, client = family
    out, stats, _ = decode(client, PROMPT, NEW, "lookup", long_rounds())
    assert out == reference_greedy(model, PROMPT, NEW)
    assert stats.rounds > 0  # a random model seldom repeats itself: few drafts are accepted


def test_greedy_tokens_drafted_by_the_served_model_itself_are_plain_decodings(family, tiny_family):
    name, model, client = family
    out, stats, in_flight = decode(client, PROMPT, NEW, str(tiny_family(name)[1]), long_rounds())
    assert out == reference_greedy(model, PROMPT, NEW)
    # the draft runs at the client's default weights, the route at float32: near-ties differ
    assert stats.accepted > stats.proposed / 3 and in_flight > 1


def test_greedy_tokens_drafted_by_another_model_are_plain_decodings(family, tiny_family):
    name, model, client = family
    other = tiny_family(name, seed=1)[1]  # the same tokenizer, other weights
    out, stats, _ = decode(client, PROMPT, NEW, str(other))  # the client's own tuner
    assert out == reference_greedy(model, PROMPT, NEW)
    assert stats.rounds > 0 and stats.accepted < stats.proposed


# ---- the shared tiny swarm (0:2, 1:5, 4:6): rounds by hand ---------------------------------


def test_a_plain_step_after_a_rejected_round_follows_the_accepted_tokens(tiny_client):
    with tiny_client.session(len(PROMPT) + 8, "off") as s:
        token = int(s.feed(PROMPT).argmax())
        r = s.send_round([token, 3, 4], len(PROMPT))  # two drafts the model does not pick
        picked = int(s.round_logits(r)[0].argmax())
        s.keep(r, 1)
        assert picked != 3 and s.history == [*PROMPT, token]
        after = s.feed([picked])
    with tiny_client.session(len(PROMPT) + 8, "off") as s:
        s.feed(PROMPT)
        s.feed([token])
        plain = s.feed([picked])
    assert torch.allclose(after, plain, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    "tokens, offset, error, said",
    [
        (MAX_VERIFY_TOKENS + 1, 0, ShapeMismatch, f"at most {MAX_VERIFY_TOKENS} tokens"),
        (2, 1, ProtocolError, "may go on at"),
        (2, -2, ProtocolError, "at the earliest"),
    ],
    ids=["over the token limit", "skipping ahead", "rewinding into the prompt"],
)
def test_a_malformed_round_gets_a_typed_error_and_the_session_goes_on(
    tiny_client, tiny_reference, tokens, offset, error, said
):
    want = reference_greedy(tiny_reference, PROMPT, 2)
    with tiny_client.session(len(PROMPT) + 32, "off") as s:
        assert int(s.feed(PROMPT).argmax()) == want[0]
        hidden = tiny_client.head(s.remote.route).embed_tokens([want[0]] * tokens)
        pos = len(PROMPT) + offset
        with pytest.raises(error, match=said) as refused:
            tiny_client.loop.run(s.remote.send_round, hidden, pos, 1000)
            tiny_client.loop.run(s.remote.round_result, 1000, pos, tokens)
        assert refused.value.hop == 0  # the first hop refused it: no hop after it saw it
        r = s.send_round([want[0]], len(PROMPT))
        assert int(s.round_logits(r)[0].argmax()) == want[1]
        s.keep(r, 1)
        assert s.recoveries == []


def test_the_same_seed_samples_the_same_tokens_through_the_swarm(tiny_client, tiny_model_dir):
    sampling = dict(temperature=1.0, top_k=40, seed=11)
    plain, _, _ = decode(tiny_client, PROMPT, 24, "off", **sampling)
    drafted, stats, _ = decode(tiny_client, PROMPT, 24, str(tiny_model_dir), **sampling)
    assert drafted == plain
    assert stats.rounds > 0


# ---- a node killed while rounds are in flight --------------------------------------------


@pytest.fixture
def replicated(tiny_model_dir):
    """Every block served twice, 0:3 and 3:6: a route remains when a node dies."""
    nodes = start_swarm(
        [(0, 3), (0, 3), (3, 6), (3, 6)],
        model=str(tiny_model_dir),
        extra=[*exact_flags(ttl=20), "--grace", "3"],
    )
    yield nodes
    stop_all(nodes)


@pytest.mark.parametrize("hop", [0, 1])
def test_a_node_killed_during_a_round_costs_a_reroute_and_replays_accepted_tokens_only(
    replicated, tiny_model_dir, tiny_reference, hop
):
    by_peer = {n.peer: n for n in replicated}
    client = Client(
        replicated[0].maddrs[:1], model=str(tiny_model_dir), wire_dtype="float32", step_timeout=3
    )
    try:
        with client.session(len(PROMPT) + NEW, str(tiny_model_dir)) as s:
            # short rounds: those in flight at the kill cannot hold all the tokens left
            decoding = Decoding(s, PROMPT, NEW, Sampler(), s.drafter, Fixed(2, 2))
            out, killed = [], None
            for token in decoding:
                out.append(token)
                if killed is None and len(out) >= 8 and decoding.rounds:
                    killed = by_peer[s.remote.route[hop].peer]
                    killed.proc.kill()
            assert killed is not None and s.remote.route[hop].peer != killed.peer
            assert len(s.recoveries) == 1
            assert s.history == PROMPT + out[:-1]  # what the route holds: accepted tokens
    finally:
        client.close()
    assert out == reference_greedy(tiny_reference, PROMPT, NEW)


def test_a_clients_next_reply_on_a_route_starts_from_what_its_last_measured(
    tiny_client, tiny_swarm
):
    pool = tiny_client.tuners
    tiny_client.generate(
        "one two three one two three one two", max_new_tokens=16, speculative="lookup"
    )
    (key,) = [k for k in pool.keys() if k[0] == "PromptLookup"]
    assert set(key[1:]) <= {n.peer for n in tiny_swarm}  # the route's hops
    assert pool.take(key).latency > 0  # what its rounds or steps took, measured


def reported(code: str, hop: int, peer: str) -> SwarmError:
    """The error a node at `hop` of a route sends back, as the client raises it."""
    exc = Error(code=code, message="refused", hop=hop).exception()
    exc.peer = peer
    return exc


def test_a_broken_message_the_first_hop_reports_leaves_it_for_this_session_only(
    tiny_client, tiny_reference
):
    with tiny_client.session(len(PROMPT) + 8, "off") as s:
        s.feed(PROMPT)
        first = s.remote.route[0].peer
        s.recover(reported("protocol", 0, first))  # about the client's own round
        assert first in s.excluded and first not in tiny_client.shunned


def test_a_refused_rewind_replays_the_session_and_blames_nobody(tiny_client, tiny_reference):
    want = reference_greedy(tiny_reference, PROMPT, 2)
    with tiny_client.session(len(PROMPT) + 8, "off") as s:
        s.feed(PROMPT)
        last = s.remote.route[-1].peer
        s.recover(reported("rewind_refused", len(s.remote.route) - 1, last))
        assert s.excluded == set() and last not in tiny_client.shunned
        assert int(s.feed([want[0]]).argmax()) == want[1]  # replayed on a new route
        assert len(s.recoveries) == 1
