"""Headless Chromium driven over the DevTools protocol, enough for tests to use a page: open a
URL, run JavaScript in it, set the viewport, take a screenshot.

Blocking and minimal: one page, one WebSocket (wsproto, which hypercorn already brings), one
command at a time. `--dump-dom` cannot type into a page or wait for a reply to stream in; this can.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Message,
    Ping,
    Request,
    TextMessage,
)


class CdpError(RuntimeError):
    pass


class Browser:
    """`with Browser(chromium, tmp_path) as b: b.open(url); b.eval("document.title")`."""

    def __init__(self, chromium: str, profile: Path, timeout: float = 60.0):
        self.timeout = timeout
        self.proc = subprocess.Popen(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--hide-scrollbars", "--remote-debugging-port=0",
             f"--user-data-dir={profile}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            port = self._devtools_port()
            # keep reading its log, or chromium blocks once the pipe is full
            threading.Thread(target=self.proc.stderr.read, daemon=True).start()
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                pages = [t for t in json.load(r) if t["type"] == "page"]
            self._connect(pages[0]["webSocketDebuggerUrl"])
        except BaseException:
            self.close()
            raise
        self._id = 0

    def _devtools_port(self) -> int:
        deadline = time.monotonic() + self.timeout
        for line in self.proc.stderr:
            if m := re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line):
                return int(m.group(1))
            if time.monotonic() > deadline:
                break
        raise CdpError(f"chromium printed no DevTools address (exit {self.proc.poll()})")

    def _connect(self, url: str) -> None:
        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=self.timeout)
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.sock.sendall(self.ws.send(Request(host=parts.netloc, target=parts.path)))
        while not any(isinstance(e, AcceptConnection) for e in self._events()):
            pass
        self._text = ""

    def _events(self):
        data = self.sock.recv(1 << 16)
        if not data:
            raise CdpError("chromium closed the DevTools connection")
        self.ws.receive_data(data)
        yield from self.ws.events()

    def call(self, method: str, **params) -> dict[str, Any]:
        self._id += 1
        msg = json.dumps({"id": self._id, "method": method, "params": params})
        self.sock.sendall(self.ws.send(Message(data=msg)))
        while True:
            for event in self._events():
                if isinstance(event, Ping):
                    self.sock.sendall(self.ws.send(event.response()))
                elif isinstance(event, CloseConnection):
                    raise CdpError("chromium closed the DevTools connection")
                elif isinstance(event, TextMessage):
                    self._text += event.data
                    if not event.message_finished:
                        continue
                    reply, self._text = json.loads(self._text), ""
                    if reply.get("id") != self._id:
                        continue  # an event we did not subscribe to, or an older answer
                    if "error" in reply:
                        raise CdpError(f"{method}: {reply['error']}")
                    return reply["result"]

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise CdpError(f"{expression!r} threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def wait_for(self, expression: str, timeout: float | None = None, every: float = 0.05):
        """Poll until `expression` is truthy; its value."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while time.monotonic() < deadline:
            if value := self.eval(expression):
                return value
            time.sleep(every)
        raise TimeoutError(f"still false after {timeout or self.timeout} s: {expression}")

    def viewport(self, width: int, height: int, mobile: bool = False) -> None:
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=2 if mobile else 1,
            mobile=mobile,
        )

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot")["data"]))
        return path

    def close(self) -> None:
        if getattr(self, "sock", None) is not None:
            self.sock.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
