"""`python -m swarm.api` as a process of the test's: started on a free port, its output kept."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import openai

KEY = "test-key-1"


@dataclass
class ApiServer:
    proc: subprocess.Popen
    url: str = ""
    lines: list[str] = field(default_factory=list)

    @classmethod
    def start(cls, peers: list[str], model: Path, *extra: str, key: str | None = KEY):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("SWARM_API_KEY", None)
        if key:
            env["SWARM_API_KEY"] = key  # the environment variable path of --api-key
        cmd = [sys.executable, "-m", "swarm.api", "--initial-peers", *peers, "--model", str(model)]
        cmd += ["--port", "0", "--wire-dtype", "float32", *extra]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        server = cls(proc)
        found: queue.Queue[str | None] = queue.Queue()

        def pump() -> None:
            for line in proc.stdout:
                server.lines.append(line.rstrip("\n"))
                if m := re.search(r"api on (http://\S+)/v1 ", line):
                    found.put(m.group(1))
            found.put(None)

        threading.Thread(target=pump, daemon=True).start()
        try:
            url = found.get(timeout=180)
        except queue.Empty:
            url = None
        if url is None:
            server.stop()
            raise RuntimeError("the API server did not start:\n" + "\n".join(server.lines))
        server.url = url
        return server

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def openai(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, **kw)
