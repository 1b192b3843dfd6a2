"""A node's weight format travels in its DHT record, and the client's head follows the route."""

from __future__ import annotations

import pytest
import torch

from devtools.launch import start_swarm, stop_all
from swarm.client.client import Client
from swarm.model import kernels


@pytest.fixture(scope="module")
def int8_node(tiny_model_dir):
    nodes = start_swarm([(0, 6)], model=str(tiny_model_dir), extra=["--weights", "int8"])
    yield nodes[0]
    stop_all(nodes)


def test_a_nodes_record_names_the_format_it_holds_its_weights_in(int8_node, tiny_model_dir):
    client = Client(int8_node.maddrs[:1], model=str(tiny_model_dir))
    try:
        assert [r.weights for r in client.nodes()] == ["int8"]
    finally:
        client.close()


def test_a_route_of_quantized_nodes_gets_the_files_own_head(int8_node, tiny_model_dir):
    client = Client(int8_node.maddrs[:1], model=str(tiny_model_dir))
    try:
        with client.session(16) as s:
            logits = s.feed([5, 6, 7])
            assert logits.shape == (client.config.vocab,)
            assert client.head(s.remote.route).weights == "bfloat16"  # float tensors: bfloat16
    finally:
        client.close()


def test_a_route_of_float32_nodes_gets_the_float32_head(tiny_swarm, tiny_model_dir):
    client = Client(tiny_swarm[0].maddrs[:1], model=str(tiny_model_dir), wire_dtype="float32")
    try:
        assert client.head(client.route()).weights == "float32"
    finally:
        client.close()


@pytest.mark.skipif(not kernels.runnable_isas(), reason="this CPU runs none of swarm's kernels")
def test_a_node_takes_its_matmul_inputs_in_the_int8_terms_it_is_told():
    nodes = start_swarm([(0, 30)], extra=["--input-terms", "1", "--threads", "1"])
    try:
        assert any("inputs in 1 int8 term(s)" in line for line in nodes[0].lines), nodes[0].lines
        client = Client(nodes[0].maddrs[:1])
        try:
            with client.session(16) as s:
                logits = s.feed([1, 2, 3, 4])
                assert torch.isfinite(logits).all() and logits.shape == (client.config.vocab,)
        finally:
            client.close()
    finally:
        stop_all(nodes)
