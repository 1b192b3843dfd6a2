"""What every child process of ours does first: it must not outlive the process that started it."""

from __future__ import annotations

import signal


def die_with_parent() -> None:
    """In a child: the kernel sends SIGTERM when the parent dies, so it never outlives it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
