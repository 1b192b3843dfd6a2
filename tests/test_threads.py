"""OpenMP's wait policy, which must be set before torch loads: swarm's processes do not spin."""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = "import swarm, os; print(os.environ.get('OMP_WAIT_POLICY'))"


def run_probe(env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_importing_swarm_makes_openmp_threads_wait_passively():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert run_probe(env) == "PASSIVE"


def test_a_wait_policy_the_user_chose_is_kept():
    assert run_probe({**os.environ, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE"
