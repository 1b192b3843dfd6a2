"""python -m swarm.node [--layers START:END | --num-blocks N] [--initial-peers MULTIADDR ...]"""

from __future__ import annotations

# ruff: noqa: E402 (the imports below load torch: OpenMP's policy must be set before)
from swarm.process import wait_passively

wait_passively()

import sys

import torch
import trio

from swarm.cli import setup_logging
from swarm.errors import SwarmError
from swarm.node.config import parse_args
from swarm.node.lifecycle import run
from swarm.node.observer import StepObserver
from swarm.process import watch_parent_env


def main(argv: list[str] | None = None, observer: StepObserver | None = None) -> int:
    """Run a node until SIGINT or SIGTERM; `observer`: a benchmark's hook (see observer.py)."""
    watch_parent_env()  # started by a launcher (devtools.launch): stop when it exits
    cfg = parse_args(argv)
    setup_logging()
    torch.set_num_threads(cfg.threads)
    try:
        trio.run(run, cfg, observer)
    except (SwarmError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
