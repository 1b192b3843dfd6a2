"""A node without --layers picks where the swarm is thinnest, and moves only to fill a gap it
would not open (issue 24)."""

from __future__ import annotations

import time

import numpy as np
import torch

from devtools.launch import start_node, stop_all
from swarm.client.client import Client
from swarm.node.placement import (
    better_span,
    blocks_for_memory,
    choose_span,
    coverage,
    room_for_head,
    settled_span,
    span_beside_head,
)
from tests.helpers.records import LAYERS, rec


def test_a_new_node_takes_the_blocks_nobody_serves():
    records = [rec("a", 0, 4), rec("b", 8, 12)]
    assert choose_span(coverage(records, LAYERS), 4) == (4, 8)


def test_with_every_block_served_it_takes_the_fewest_nodes_then_the_least_throughput():
    records = [rec("a", 0, 12, tps=5), rec("b", 0, 6, tps=5), rec("c", 6, 12, tps=50)]
    assert choose_span(coverage(records, LAYERS), 6) == (0, 6)
    records.append(rec("d", 0, 6))
    assert choose_span(coverage(records, LAYERS), 6) == (6, 12)


def test_with_every_block_served_it_takes_the_blocks_with_most_sessions_per_throughput():
    """Two nodes on 0:6 serve 8 sessions at 10 tokens/s each; one on 6:12 serves 2 at 10: a
    new node goes where users wait longest, though 0:6 has more nodes."""
    records = [rec("a", 0, 6, sessions=4), rec("b", 0, 6, sessions=4)]
    records.append(rec("c", 6, 12, sessions=2))
    assert choose_span(coverage(records, LAYERS), 6) == (0, 6)
    records[2] = rec("c", 6, 12, sessions=9)
    assert choose_span(coverage(records, LAYERS), 6) == (6, 12)


def test_a_node_still_joining_counts_so_the_next_one_goes_elsewhere():
    records = [rec("a", 0, 6, state="joining")]
    assert choose_span(coverage(records, LAYERS), 6) == (6, 12)


def test_offline_nodes_leave_their_blocks_uncovered():
    records = [rec("a", 0, 6), rec("b", 6, 12, state="offline")]
    assert choose_span(coverage(records, LAYERS), 6) == (6, 12)


def test_a_node_stays_where_leaving_would_open_a_gap():
    records = [rec("a", 0, 4), rec("b", 4, 8)]  # 8:12 uncovered, but a and b are each alone
    assert better_span(records, "a", (0, 4), LAYERS) is None


def test_a_redundant_node_moves_to_the_gap():
    records = [rec("a", 0, 6), rec("b", 0, 6)]
    assert better_span(records, "a", (0, 6), LAYERS) == (6, 12)


def test_of_two_redundant_nodes_only_the_lowest_peer_id_moves():
    records = [rec("a", 0, 6), rec("b", 0, 6)]
    assert better_span(records, "b", (0, 6), LAYERS) is None


def test_nobody_moves_when_every_block_is_served():
    records = [rec("a", 0, 6), rec("b", 0, 6), rec("c", 6, 12)]
    assert better_span(records, "a", (0, 6), LAYERS) is None


def test_of_two_nodes_choosing_the_same_blocks_at_once_the_higher_peer_id_chooses_again():
    records = [rec("a", 0, 4), rec("m", 4, 8, state="joining"), rec("z", 4, 8, state="joining")]
    assert settled_span(records, "z", (4, 8), LAYERS)[0] == (8, 12)
    assert settled_span(records, "m", (4, 8), LAYERS) == ((4, 8), None)


def test_a_simultaneous_chooser_already_online_still_makes_the_higher_peer_id_choose_again():
    # a tiny span loads within the settling wait: the rival's record may say online already
    records = [rec("a", 0, 4), rec("m", 4, 8), rec("z", 4, 8, state="joining")]
    assert settled_span(records, "z", (4, 8), LAYERS)[0] == (8, 12)


def test_overlapping_a_node_known_at_the_first_choice_is_kept():
    # every block served once: 0:4 doubled was the best choice with "a" in view, and stays
    records = [rec("a", 0, 4), rec("b", 4, 8), rec("c", 8, 12), rec("z", 0, 4, state="joining")]
    assert settled_span(records, "z", (0, 4), LAYERS) == ((0, 4), None)


def test_memory_decides_how_many_blocks_fit():
    assert blocks_for_memory(block_bytes=100, cache_bytes_per_block=50, budget=1000) == 6
    assert blocks_for_memory(block_bytes=100, cache_bytes_per_block=50, budget=10) == 1


def test_a_span_ending_the_model_is_no_wider_than_fits_beside_the_head():
    ok = room_for_head(LAYERS, ending=3)
    assert ok(0, 4) and ok(4, 8) and ok(9, 12)
    assert not ok(8, 12)
    # the thinnest window is the model's end: a node there takes what fits with the head
    records = [rec("a", 0, 8)]
    assert span_beside_head(coverage(records, LAYERS), 4, ending=3) == (9, 12)
    assert span_beside_head(coverage(records, LAYERS), 4, ending=4) == (8, 12)
    records = [rec("a", 4, 12)]  # elsewhere, every block that fits
    assert span_beside_head(coverage(records, LAYERS), 4, ending=3) == (0, 4)


def test_a_node_without_room_for_the_head_serves_away_from_the_models_end():
    records = [rec("a", 0, 8)]
    assert span_beside_head(coverage(records, LAYERS), 4, ending=0) == (7, 11)
    assert not room_for_head(LAYERS, ending=0)(11, 12)


def test_room_for_the_head_keeps_the_models_own_span_rule():
    ok = room_for_head(LAYERS, ending=12, span_ok=lambda start, end: start % 2 == 0)
    assert ok(0, 4) and not ok(1, 5)


def test_nodes_without_layers_cover_the_model_and_one_moves_to_a_gap(tiny_model_dir):
    extra = [
        "--num-blocks",
        "3",
        "--weights",
        "float32",
        "--announce-ttl",
        "3",
        "--rebalance-interval",
        "1",
    ]
    nodes = []
    try:
        for _ in range(3):  # one after another, each seeing the others' records
            peers = nodes[0].maddrs[:1] if nodes else ()
            nodes.append(start_node(None, peers, model=str(tiny_model_dir), extra=extra))
            nodes[-1].wait_serving()
        spans = sorted(n.layers for n in nodes)
        assert spans[:2] == [(0, 3), (3, 6)] or spans[1:] == [(0, 3), (3, 6)]
        client = Client(nodes[0].maddrs[:1], model=str(tiny_model_dir))
        try:
            assert sum(h.end - h.start for h in client.route()) == 6
            # stop a node nobody else backs up; a redundant one must move into its gap
            alone = next(n for n in nodes if [m.layers for m in nodes].count(n.layers) == 1)
            alone.stop()
            survivors = [n for n in nodes if n is not alone]
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                online = [r for r in client.nodes() if r.state == "online"]
                served = {b for r in online for b in range(r.start, r.end)}
                if served == set(range(6)):
                    break
                time.sleep(1)
            assert served == set(range(6)), f"still uncovered: {set(range(6)) - served}"
            assert any("moving from blocks" in line for n in survivors for line in n.lines)
            assert sum(h.end - h.start for h in client.route()) == 6
        finally:
            client.close()
    finally:
        stop_all(nodes)


def test_nodes_started_together_without_layers_cover_the_model(tiny_model_dir):
    extra = ["--num-blocks", "2", "--weights", "float32", "--rebalance-interval", "0"]
    first = start_node(None, model=str(tiny_model_dir), extra=extra)
    nodes = [first]
    try:
        first.wait_serving()
        # whichever reads the DHT first takes 2:4; the other sees that choice at once or, if
        # both read before either announced, when it looks again (settled_span)
        for _ in range(2):
            nodes.append(start_node(None, first.maddrs[:1], model=str(tiny_model_dir), extra=extra))
        for n in nodes[1:]:
            n.wait_serving()
        served = {b for n in nodes for b in range(*n.layers)}
        assert served == set(range(6)), f"spans {[n.layers for n in nodes]}"
    finally:
        stop_all(nodes)


def test_a_nodes_head_bytes_are_known_before_it_loads(tiny_model_dir, tmp_path):
    from devtools.hf_to_gguf import write_gguf
    from swarm.model.head import LazyHead, head_bytes
    from swarm.model.source import open_model

    float_gguf = write_gguf(tiny_model_dir, tmp_path / "tiny.gguf")  # its tables F32
    # safetensors; a GGUF file of float tables; None: the default model's, of Q8_0 ones
    for path in (tiny_model_dir, float_gguf, None):
        for weights in ("float32", "auto"):
            source = open_model(path)
            head = LazyHead(source, weights).get()
            held = head.lm_head.nbytes
            table = head.embed.data  # a quantized file's table stays mapped (uint8 blocks)
            in_memory = isinstance(table, torch.Tensor) or table.dtype != np.uint8
            if in_memory and table is not getattr(head.lm_head, "weight", None):
                held += table.nbytes
            assert head_bytes(source, weights) == held > 0, (path, weights)


def test_a_node_fits_fewer_blocks_where_its_span_ends_the_model():
    from swarm.model.head import head_bytes
    from swarm.model.source import open_model
    from swarm.node.config import NodeConfig
    from swarm.node.measure import blocks_that_fit

    source = open_model(None)  # the default model: a 28 MiB head beside 1.4 MiB blocks
    said: list[str] = []
    fit = blocks_that_fit(
        NodeConfig(start=0, end=30, max_memory_mb=80.0), source, None, said.append
    )
    assert 0 < fit.ending < fit.blocks
    per_block = 80 * 2**20 / fit.blocks
    assert fit.ending * per_block + head_bytes(source, "auto") <= 80 * 2**20 * 1.001
    assert f"{fit.ending} beside the last block's head" in said[-1]
