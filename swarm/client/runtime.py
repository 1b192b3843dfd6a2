"""A trio event loop on a background thread, so synchronous callers can drive async sessions."""

from __future__ import annotations

import threading

import trio


class TrioThread:
    def __init__(self, name: str = "swarm-client"):
        self._token: trio.lowlevel.TrioToken | None = None
        self._ready = threading.Event()
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        trio.run(self._serve)

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        self._ready.set()
        await self._stop.wait()

    def run(self, afn, *args):
        """Run `await afn(*args)` on the loop thread and return its result here."""
        return trio.from_thread.run(afn, *args, trio_token=self._token)

    def close(self) -> None:
        if self._thread.is_alive():
            trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            self._thread.join(5)
