"""What every child process of ours does first: it must not outlive the process that started it."""

from __future__ import annotations

import os
import signal
import threading
import time

PARENT_ENV = "SWARM_PARENT_PID"  # set by a launcher: the pid its child watches (watch_parent_env)
POLL_S = 0.25


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
