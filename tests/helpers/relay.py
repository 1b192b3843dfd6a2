"""A shaped link in front of a test's node: devtools/link_proxy.py as its own process."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def shaped_relay(target: int, rate_mbps: float, delay_ms: float) -> Iterator[int]:
    """A relay to 127.0.0.1:`target` at `rate_mbps` with `delay_ms` each way: its port, where
    a node started with `--port target --public-address 127.0.0.1:PORT` is reached."""
    public = free_port()
    relay = subprocess.Popen(
        [sys.executable, "-m", "devtools.link_proxy", "--listen", f"127.0.0.1:{public}"]
        + ["--target", f"127.0.0.1:{target}"]
        + ["--rate-mbps", str(rate_mbps), "--delay-ms", str(delay_ms)],
        cwd=ROOT,  # devtools/ is not installed: the relay runs from this checkout
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield public
    finally:
        relay.kill()
        relay.wait()
