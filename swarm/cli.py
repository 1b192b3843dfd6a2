"""What the command-line programs (node, client, health page, API) set up alike."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: int = logging.INFO) -> None:
    """Timestamped lines on stderr; hivemind's own chatter only from warnings up."""
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("hivemind").setLevel(logging.WARNING)


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
