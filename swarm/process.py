"""What a program of ours does first: keep OpenMP's threads from spinning (`wait_passively`),
and, in a child process, not outlive the process that started it (`watch_parent`)."""

from __future__ import annotations

import os
import signal
import threading
import time

WAIT_POLICY_ENV = "OMP_WAIT_POLICY"
PARENT_ENV = "SWARM_PARENT_PID"  # set by a launcher: the pid its child watches (watch_parent_env)
POLL_S = 0.25


def wait_passively() -> None:
    """Let OpenMP's threads sleep between parallel ops, unless the user chose a policy. Call it
    before torch is imported: torch loads OpenMP then, and OpenMP reads the policy once, at load.

    torch's OpenMP threads spin after each parallel op by default. On a home PC's few cores that
    spinning takes the core from the thread that runs next, here the quantized-matmul kernels'
    own pool (swarm/model/kernels): at 2 threads an 8B-shaped layer's decode took 7.3 ms
    spinning against 5.2 passive, its 1-thread time 7.3 (docs/benchmarks.md, "Kernels")."""
    os.environ.setdefault(WAIT_POLICY_ENV, "PASSIVE")


def watch_parent(parent: int, poll: float = POLL_S) -> None:
    """In a child of process `parent`: SIGTERM this process once `parent` has exited.

    Not the kernel's parent-death signal (PR_SET_PDEATHSIG): that one fires when the *thread*
    that forked the child exits, so a node started from a short-lived thread (a benchmark's
    worker, trio's thread cache) was stopped as soon as that thread returned. An orphan's
    parent pid changes (to init or a subreaper), whatever thread forked it."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def watch_parent_env() -> None:
    """In a process a launcher started with PARENT_ENV set: watch that parent. The variable is
    removed, so a process this one starts does not watch its grandparent."""
    parent = os.environ.pop(PARENT_ENV, "")
    if parent.isdigit():
        watch_parent(int(parent))
