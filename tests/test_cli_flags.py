"""The flags every program shares (--initial-peers, --model, --wire-dtype, the HTTP server's)
are declared once: each program reads them alike, with its own default where it needs one.
Every number a flag reads has its bounds checked at parse."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from swarm.api.__main__ import ApiOptions
from swarm.api.__main__ import build_parser as api_parser
from swarm.client.__main__ import build_parser as client_parser
from swarm.client.options import ClientOptions, Sampling, split_options
from swarm.health.__main__ import build_parser as health_parser
from swarm.health.state import CollectorConfig
from swarm.node.config import build_parser as node_parser
from swarm.node.config import parse_args
from swarm.options import add_options, from_args, option, positive_int

PEER = "/ip4/1.2.3.4/tcp/1/p2p/Qm"
ROOT = Path(__file__).resolve().parents[1]


def actions(parser) -> dict:
    return {a.option_strings[0]: a for a in parser._actions if a.option_strings}


@pytest.mark.parametrize("parser", [api_parser, client_parser])
def test_a_client_program_takes_the_nodes_model_and_wire_dtype_flags(parser):
    node, other = actions(node_parser()), actions(parser())
    assert other["--model"].help == node["--model"].help
    assert other["--wire-dtype"].choices == node["--wire-dtype"].choices


@pytest.mark.parametrize("parser", [api_parser, client_parser])
def test_a_client_leaves_the_wire_dtype_to_each_node_unless_told(parser):
    argv = (["hi"] if parser is client_parser else []) + ["--initial-peers", PEER]
    assert parser().parse_args(argv).wire_dtype is None
    assert parser().parse_args([*argv, "--wire-dtype", "float32"]).wire_dtype == "float32"


@pytest.mark.parametrize("parser", [api_parser, client_parser, health_parser])
def test_every_program_but_the_node_must_be_given_a_swarm_to_join(parser, capsys):
    argv = ["hi"] if parser is client_parser else []
    with pytest.raises(SystemExit):
        parser().parse_args(argv)
    assert "--initial-peers" in capsys.readouterr().err
    assert parser().parse_args([*argv, "--initial-peers", PEER, PEER]).initial_peers == [PEER] * 2


def test_a_node_without_initial_peers_starts_a_new_swarm():
    assert parse_args(["--layers", "0:10"]).initial_peers == ()


@pytest.mark.parametrize(
    ("parser", "host", "port"), [(api_parser, "127.0.0.1", 8000), (health_parser, "0.0.0.0", 8080)]
)
def test_the_http_servers_keep_their_own_listen_defaults(parser, host, port):
    args = parser().parse_args(["--initial-peers", PEER])
    assert (args.host, args.port, args.access_log) == (host, port, False)
    args = parser().parse_args(["--initial-peers", PEER, "--port", "0", "--access-log"])
    assert (args.port, args.access_log) == (0, True)


def test_the_health_page_flags_default_to_its_collectors_own():
    args = health_parser().parse_args(["--initial-peers", PEER])
    c = CollectorConfig(initial_peers=(PEER,))
    assert (args.dht_host, args.interval, args.dht_timeout) == (
        c.dht_host,
        c.interval,
        c.dht_timeout,
    )
    assert (args.ping_timeout, args.forget_after) == (c.ping_timeout, c.forget_after)


# ---- bounds: a value out of range is a usage error at parse, in every program ----------------

NODE = ("swarm.node", "--layers", "0:1")
API = ("swarm.api", "--initial-peers", PEER)
HEALTH = ("swarm.health", "--initial-peers", PEER)
CLIENT = ("swarm.client", "hi", "--initial-peers", PEER)


@pytest.mark.parametrize(
    ("program", "flag", "value", "message"),
    [
        (NODE, "--threads", "0", "argument --threads: must be at least 1, got 0"),
        (API, "--idle-timeout", "-1", "argument --idle-timeout: must be a number >= 0, got -1"),
        (HEALTH, "--interval", "0", "argument --interval: must be a number > 0, got 0"),
        (HEALTH, "--port", "65536", "argument --port: must be 0..65535, got 65536"),
        (CLIENT, "--top-p", "0", "argument --top-p: must be a number > 0 and <= 1, got 0"),
        (NODE, "--max-sessions", "many", "argument --max-sessions: invalid int value: 'many'"),
        (NODE, "--layers", "5:2", "argument --layers: need 0 <= START < END, got '5:2'"),
    ],
)
def test_a_value_out_of_bounds_ends_the_program_with_a_usage_error(program, flag, value, message):
    module, *argv = program
    out = subprocess.run(
        [sys.executable, "-m", module, *argv, flag, value],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].endswith(f"error: {message}")
    assert "Traceback" not in out.stderr


def test_an_option_reading_a_number_must_declare_its_bounds():
    parser = argparse.ArgumentParser()
    with pytest.raises(TypeError, match="--count reads a number: give its bounds"):
        add_options(parser, count=option(3, "how many"))
    add_options(parser, count=option(3, "how many", type=positive_int))


def test_every_option_of_a_client_is_a_flag_of_the_client_program():
    argv = ["hi", "--initial-peers", PEER, "--no-disaggregate", "--step-timeout", "5"]
    argv += ["--temperature", "0.7", "--top-k", "40", "--seed", "1", "--stop", "a", "--stop", "b"]
    args = client_parser().parse_args(argv)
    assert from_args(ClientOptions, args) == ClientOptions(disaggregate=False, step_timeout=5.0)
    assert from_args(Sampling, args) == Sampling(temperature=0.7, top_k=40, seed=1)
    assert args.stop == ["a", "b"]


def test_generate_takes_the_client_and_sampling_options_as_keywords():
    options, sampling = split_options({"model": "m", "plaintext": True, "top_p": 0.9})
    assert options == ClientOptions(model="m", plaintext=True)
    assert sampling == Sampling(top_p=0.9)
    with pytest.raises(TypeError, match="temprature"):
        split_options({"temprature": 0.5})


def test_the_api_counts_requests_not_sessions():
    args = api_parser().parse_args(["--initial-peers", PEER, "--max-requests", "4"])
    assert from_args(ApiOptions, args).max_requests == 4
    assert "--max-sessions" not in actions(api_parser())
