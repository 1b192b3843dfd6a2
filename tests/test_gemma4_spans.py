"""Where a swarm may cut a Gemma 4 with KV sharing: a layer that reads another's keys and values
stays on the node computing that layer, in the spans nodes choose and in the routes clients
draw; and a step's token ids (its layers' per-layer inputs) travel and split with its pieces."""

from __future__ import annotations

import random

import pytest
import torch

from swarm.client.routing import Estimates, find_route
from swarm.errors import ProtocolError
from swarm.model.config import ModelConfig, Rope
from swarm.node.placement import choose_span, coverage
from swarm.node.prompt import PromptPieces
from swarm.protocol import PREFILL, Step, parse_message, to_wire
from tests.helpers.records import ROUTE_LAYERS as LAYERS
from tests.helpers.records import route_rec as rec

# layers s f s f s f: layer 4 reads layer 2's KV, layer 5 layer 3's (the tiny Gemma 4's)
CONFIG = ModelConfig(
    *("g", "gemma4", LAYERS, 64, 128, 4, 2, 32, Rope(1e4), 1e-6, 512, 1, (2,), 512),
    windows=(8, None) * 3,
    kv_shared=2,
)


def test_the_spans_a_node_computes_alone_keep_each_sharing_layer_with_its_source():
    ok = {(a, b) for a in range(LAYERS) for b in range(a + 1, LAYERS + 1) if CONFIG.span_ok(a, b)}
    assert {(3, 6), (4, 6), (4, 5), (5, 6), (3, 5)} & ok == set()
    assert {(0, 6), (2, 6), (2, 5), (0, 2), (3, 4), (2, 3)} <= ok


def test_a_node_choosing_where_the_swarm_is_thin_takes_a_span_it_can_compute():
    """Blocks 3:6 are unserved: a node of 3 blocks takes 2:5 (a gap of two), not 3:6."""
    blocks = coverage([rec("a", 0, 3)], LAYERS)
    assert choose_span(blocks, 3) == (3, 6)  # what a model without sharing gets
    assert choose_span(blocks, 3, CONFIG.span_ok) == (2, 5)


@pytest.mark.parametrize("seed", range(10))
def test_a_route_never_cuts_a_sharing_layer_from_its_source(seed):
    """A serves 0:4 fast, B 2:6 slowly: the cheapest route, A 0:4 then B 4:6 (what a model
    without sharing gets), would cut layer 4 from layer 2."""
    records = [rec("a", 0, 4, throughput=1000.0), rec("bb", 2, 6, throughput=10.0)]
    rng = random.Random(seed)
    cheapest = find_route(records, LAYERS, "f", Estimates(), rng=rng)
    route = find_route(records, LAYERS, "f", Estimates(), rng=rng, span_ok=CONFIG.span_ok)
    assert [(h.start, h.end) for h in cheapest] == [(0, 4), (4, 6)]
    assert [(h.start, h.end) for h in route] == [(0, 2), (2, 6)]


def test_a_steps_token_ids_travel_with_it_and_are_bounded():
    step = Step("s" * 8, PREFILL, 0, 3, b"", ids=(5, 6, 7))
    assert parse_message(to_wire(step)).ids == (5, 6, 7)
    assert parse_message(to_wire(Step("s" * 8, PREFILL, 0, 3, b""))).ids is None
    for bad in ([-1], [True], [], "abc"):
        raw = {**to_wire(step), "ids": bad}
        with pytest.raises(ProtocolError, match="ids"):
            parse_message(raw)


def test_prompt_pieces_joined_or_split_keep_their_ids_in_step():
    pieces = PromptPieces()
    pieces.add(Step("s", PREFILL, 0, 5, b"", ids=(1, 2)), torch.zeros(1, 2, 4), 0.0)
    pieces.add(Step("s", PREFILL, 2, 5, b"", ids=(3, 4, 5)), torch.zeros(1, 3, 4), 0.0)
    first, hidden = pieces.take(3, 0.0)
    assert (first.pos, first.ids, hidden.shape[1]) == (0, (1, 2, 3), 3)
    rest, hidden = pieces.take(8, 0.0)
    assert (rest.pos, rest.ids, hidden.shape[1]) == (3, (4, 5), 2)
