"""OpenMP's wait policy, which must be set before torch loads: swarm's programs do not spin, and
importing swarm as a library leaves the policy to the program that does."""

from __future__ import annotations

import os
import subprocess
import sys

NODE = "swarm.node.__main__"  # the node's program, imported as `python -m swarm.node` runs it
LIBRARY = "swarm.model.blocks"  # a library module that loads torch


def run_probe(env: dict[str, str], module: str = NODE) -> str:
    """The wait policy once `module` is imported in a fresh process with `env`."""
    probe = f"import {module}, os; print(os.environ.get('OMP_WAIT_POLICY'))"
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def without_policy() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}


def test_a_node_makes_openmp_threads_wait_passively():
    assert run_probe(without_policy()) == "PASSIVE"


def test_a_wait_policy_the_user_chose_is_kept():
    assert run_probe({**os.environ, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"


def test_importing_swarm_as_a_library_leaves_the_wait_policy_alone():
    assert run_probe(without_policy(), LIBRARY) == "None"
