"""Run a node that logs its steps to a file, for scripts/bench_link.py and tests/test_link_e2e.py.

    python devtools/step_log.py --step-log FILE <the arguments of python -m swarm.node>

Not part of the installed package: the node only calls a StepObserver (swarm/node/observer.py);
this one appends a line per event, line-buffered, so a killed node loses none:
- per decode step: its arrival (monotonic seconds), seconds until its output was queued for the
  link, seconds of that in compute, and of the compute the seconds on a CPU and waiting for one;
- `a SID NOW POS TOKENS END` per prompt piece arrived;
- `p SID NOW POS TOKENS END COMPUTE CPU RUNQUEUE` per prompt pass done.
"""

from __future__ import annotations

import argparse
import sys

from swarm.node.__main__ import main as node_main
from swarm.node.compute import Usage


class StepLog:
    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 (open for the node's life)

    def prompt_piece(self, sid: str, now: float, pos: int, tokens: int, end: int) -> None:
        self._file.write(f"a {sid[:8]} {now:.4f} {pos} {tokens} {end}\n")

    def decode_step(self, arrived: float, now: float, compute_s: float, usage: Usage) -> None:
        self._file.write(
            f"{arrived:.6f} {now - arrived:.6f} {compute_s:.6f}"
            f" {usage.cpu_s:.4f} {usage.runqueue_s:.4f}\n"
        )

    def prompt_pass(
        self, sid: str, now: float, pos: int, tokens: int, end: int, compute_s: float, usage: Usage
    ) -> None:
        self._file.write(
            f"p {sid[:8]} {now:.4f} {pos} {tokens} {end} {compute_s:.4f}"
            f" {usage.cpu_s:.4f} {usage.runqueue_s:.4f}\n"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--step-log", required=True, metavar="FILE")
    known, node_args = parser.parse_known_args(argv)
    return node_main(node_args, observer=StepLog(known.step_log))


if __name__ == "__main__":
    sys.exit(main())
