"""The flags every program shares (--initial-peers, --model, --wire-dtype, the HTTP server's)
are declared once: each program reads them alike, with its own default where it needs one."""

from __future__ import annotations

import pytest

from swarm.api.__main__ import build_parser as api_parser
from swarm.client.__main__ import build_parser as client_parser
from swarm.health.__main__ import build_parser as health_parser
from swarm.health.state import CollectorConfig
from swarm.node.config import build_parser as node_parser
from swarm.node.config import parse_args

PEER = "/ip4/1.2.3.4/tcp/1/p2p/Qm"


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
