"""What each attack on the swarm's trust costs an honest user: served or not, and time to first
token and per output token against the quiet swarm's, same run.

A tiny random Llama (6 layers) on three honest nodes (0:3, 3:6, 0:6). Per attack a fresh client
(nothing learnt before) runs --generations greedy generations while the attack is on:
  forged-offline     a stranger's stock hivemind peer stores unsigned records naming every
                     honest node offline, dated a year ahead, expiring in a year
  other-key-offline  the same lies signed with the stranger's own key
  oversized-record   3.6 MiB under every block key
  model-flood        33 unsigned entries in the model index (figure: our model still listed)
  relay-burst        10 rounds of 24 accepts for one splice token at node 0:6
  false-span         a node serving 0:3 announces 0:6 at 1e9 tokens/s
  false-throughput   a node on 0:6 taking 50 ms a pass announces 1e9 tokens/s
  wrong-activations  a node on 0:6 scaling its outputs by 1.5 announces 1e9 tokens/s; the
                     client checks each session once (InferenceSession.verify)
Then `python -m swarm.api` (default flags) in front of the swarm, and per row --generations
one-token chat requests of a polite caller (127.0.0.2), timed whole, against api-quiet's:
  api-48-streams     another caller (127.0.0.1) holds 48 streamed 400-token replies
  api-slow-headers   1,100 connections from 50 addresses that never finish their headers
                     (figure: the API process's file descriptors before and at most)

  .venv/bin/python scripts/bench_trust.py [--generations 3] [--new-tokens 24] [--only NAME...]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import hivemind
import trio
from bench.proc import cpu_name
from bench.timing import greedy
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from devtools.launch import start_swarm, stop_all
from devtools.liar_node import start_liar
from devtools.stranger import new_key, store_padded, stranger_dht
from swarm.address import parse_host_port
from swarm.client.client import Client
from swarm.dht import read_models
from swarm.model.tiny import save_tiny_llama, save_tiny_tokenizer
from swarm.protocol import Relay, relay_claim
from swarm.records import MODELS_KEY, ModelRecord, block_key
from swarm.transport import connect

FLAGS = ["--weights", "float32", "--wire-dtype", "float32", "--announce-ttl", "10"]
YEAR_S = 365 * 24 * 3600.0


class Swarm:
    def __init__(self, model: Path):
        self.model = str(model)
        self.nodes = start_swarm([(0, 3), (3, 6), (0, 6)], model=self.model, extra=FLAGS)
        self.peers = self.nodes[0].maddrs[:1]
        self.client = Client(self.peers, model=self.model, wire_dtype="float32")
        self.records = self.client.nodes()
        self.name, self.layers = self.client.config.name, self.client.config.num_layers

    def stranger(self, key: RSAPrivateKey | None = None) -> hivemind.DHT:
        return stranger_dht(self.peers, key)

    def close(self) -> None:
        self.client.close()
        stop_all(self.nodes)


def store_lies(dht: hivemind.DHT, swarm: Swarm, subkey: bytes, expiration: float) -> None:
    for r in swarm.records:
        lie = {**r.to_wire(), "state": "offline", "updated": get_dht_time() + YEAR_S}
        for b in range(r.start, r.end):
            key = block_key(swarm.name, b)
            dht.store(key, lie, expiration, subkey=subkey, return_future=True).result(30)


@contextmanager
def attack(name: str, swarm: Swarm, notes: dict):
    started: list = []
    try:
        if name == "forged-offline":
            started.append(dht := swarm.stranger())
            store_lies(dht, swarm, b"anyone", get_dht_time() + YEAR_S)
        elif name == "other-key-offline":
            key = RSAPrivateKey()
            started.append(dht := swarm.stranger(key))
            marker = RSASignatureValidator(key).local_public_key
            store_lies(dht, swarm, marker, get_dht_time() + 60)
        elif name == "oversized-record":
            key = RSAPrivateKey()
            started.append(dht := swarm.stranger(key))
            keys = [block_key(swarm.name, b) for b in range(swarm.layers)]
            marker = RSASignatureValidator(key).local_public_key
            request = partial(store_padded, keys=keys, record=swarm.records[0].to_wire())
            dht.run_coroutine(
                partial(
                    request, pad=int(3.6 * 2**20), subkey=marker, expiration=get_dht_time() + 60
                )
            )
        elif name == "model-flood":
            started.append(dht := swarm.stranger())
            for i in range(33):
                fake = ModelRecord(f"aaa-fake-{i:02d}", 1, "0" * 16).to_wire()
                dht.store(MODELS_KEY, fake, get_dht_time() + 60, subkey=f"fake{i}".encode())
            notes["listed"] = swarm.name in read_models(swarm.client.dht)[0]
        elif name == "relay-burst":
            trio.run(relay_burst, swarm.nodes[2])
            notes["node alive"] = swarm.nodes[2].proc.poll() is None
        elif name.startswith("false") or name == "wrong-activations":
            lies = {
                "false-span": ((0, 3), {"LIE_END": 6, "LIE_THROUGHPUT": 1e9}),
                "false-throughput": ((0, 6), {"LIE_THROUGHPUT": 1e9, "LIE_SLOW_S": 0.05}),
                "wrong-activations": ((0, 6), {"LIE_THROUGHPUT": 1e9, "LIE_SCALE": 1.5}),
            }
            span, lie = lies[name]
            started.append(liar := start_liar(span, swarm.peers, swarm.model, FLAGS, **lie))
            liar.wait_serving()
            notes["liar"] = liar.peer
        time.sleep(3)  # the DHT spreads what was stored
        yield
    finally:
        for thing in started:
            if hasattr(thing, "shutdown"):
                thing.shutdown()
            else:
                stop_all([thing])


async def relay_burst(node) -> None:
    host, port = parse_host_port(node.addr)
    key, marker, me = new_key()
    opened = []
    for _ in range(10):
        control = await connect(host, port, tls=None)
        await control.send(Relay(op="listen", peer=me))
        nonce = (await control.receive()).token
        proof = key.sign(relay_claim(node.peer, me, nonce)).decode()
        await control.send(Relay(op="prove", key=marker.decode(), proof=proof))
        await control.receive()
        splicer = await connect(host, port, tls=None)
        await splicer.send(Relay(op="splice", peer=me))
        token = (await control.receive()).token
        accepts = [await connect(host, port, tls=None) for _ in range(24)]
        async with trio.open_nursery() as nursery:
            for conn in accepts:
                nursery.start_soon(conn.send, Relay(op="accept", token=token))
        opened += [control, splicer, *accepts]
        await trio.sleep(0.2)
    for conn in opened:
        await conn.aclose()


def generation(client: Client, prompt: list[int], new: int, check: bool, notes: dict):
    """(TTFT, TPOT) of one greedy generation; a check of its route if `check`."""
    with client.session(len(prompt) + new + 1) as s:

        def checked(token: int) -> int:
            verdict = s.verify(random.Random(0))
            notes["caught"] = notes.get("caught", False) or bool(verdict.suspects)
            return int(s.feed([token]).argmax())

        t = greedy(s.feed, prompt, new, between=checked if check else None)
        return t.ttft, t.tpot


def measure(swarm: Swarm, name: str, a) -> tuple[int, list, dict]:
    notes: dict = {}
    prompt = [(i * 7919) % 400 + 5 for i in range(a.prompt_tokens)]
    with attack(name, swarm, notes):
        client = Client(swarm.peers, model=swarm.model, wire_dtype="float32")
        runs, served = [], 0
        try:
            for _ in range(a.generations):
                try:
                    check = name == "wrong-activations"
                    runs.append(generation(client, prompt, a.new_tokens, check, notes))
                    served += 1
                except Exception as exc:  # what the attack did to the honest user
                    notes["error"] = f"{type(exc).__name__}: {str(exc)[:60]}"
            if "liar" in notes:
                notes["liar routes after"] = sum(
                    notes["liar"] in {h.peer for h in client.route()} for _ in range(5)
                )
                del notes["liar"]
        finally:
            client.close()
    return served, runs, notes


ATTACKS = [
    "quiet",
    "forged-offline",
    "other-key-offline",
    "oversized-record",
    "model-flood",
    "relay-burst",
    "false-span",
    "false-throughput",
    "wrong-activations",
    "api-quiet",
    "api-48-streams",
    "api-slow-headers",
]
POLITE, GREEDY = "127.0.0.2", "127.0.0.1"


class Api:
    """`python -m swarm.api` in front of the swarm, default flags."""

    def __init__(self, swarm: Swarm):
        cmd = [sys.executable, "-m", "swarm.api", "--initial-peers", *swarm.peers, "--port", "0"]
        cmd += ["--model", swarm.model, "--wire-dtype", "float32"]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        for line in self.proc.stdout:
            if m := re.search(r"api on http://([\d.]+):(\d+)/v1 serving (\S+);", line):
                self.host, self.port, self.name = m.group(1), int(m.group(2)), m.group(3)
                break
        else:
            raise RuntimeError("the API server did not start")
        self.ask()  # its tokenizer and heads load on the first request: not the quiet row's

    def connect(self, source: str) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(
            self.host, self.port, timeout=120, source_address=(source, 0)
        )

    def post(self, conn: http.client.HTTPConnection, max_tokens: int, stream: bool) -> None:
        body = {"model": self.name, "messages": [{"role": "user", "content": "Tell a story."}],
                "max_tokens": max_tokens, "temperature": 0, "stream": stream}  # fmt: skip
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"}
        )

    def ask(self) -> float:
        """Seconds for the polite caller's one-token request; raises unless answered 200."""
        conn = self.connect(POLITE)
        t0 = time.perf_counter()
        self.post(conn, 1, stream=False)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:80]!r}")
        return time.perf_counter() - t0

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@contextmanager
def streams(api: Api, n: int, notes: dict):
    """`n` streamed replies of the greedy caller under way for the block."""
    conns = [api.connect(GREEDY) for _ in range(n)]
    finished: list[int] = []

    def hog(conn: http.client.HTTPConnection) -> None:
        try:
            api.post(conn, 400, stream=True)
            for _ in conn.getresponse():
                pass
            finished.append(1)
        except OSError:
            pass  # cut when the measurement ended

    threads = [threading.Thread(target=hog, args=(c,), daemon=True) for c in conns]
    for t in threads:
        t.start()
    time.sleep(2)  # every stream sent, the first ones generating
    try:
        yield
    finally:
        notes["greedy streams done meanwhile"] = len(finished)
        for conn in conns:
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(30)


@contextmanager
def slow_headers(api: Api, n: int, notes: dict):
    """`n` connections from 50 addresses that begin their headers and never end them; the
    API process's descriptors before and at most meanwhile go into `notes`."""
    before, peak, done = api.fds(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            peak[0] = max(peak[0], api.fds())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    held = []
    try:
        for i in range(n):
            s = socket.create_connection(
                (api.host, api.port), timeout=10, source_address=(f"127.0.1.{1 + i % 50}", 0)
            )
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            held.append(s)
        yield
    finally:
        done.set()
        sampler.join()
        for s in held:
            s.close()
        notes["fds before / at most"] = f"{before} / {peak[0]}"


def measure_api(api: Api, name: str, a) -> tuple[int, list, dict]:
    notes: dict = {}
    attacks = {
        "api-48-streams": partial(streams, api, 48),
        "api-slow-headers": partial(slow_headers, api, 1100),
    }
    runs, served = [], 0
    with attacks[name](notes) if name in attacks else nullcontext():
        for _ in range(a.generations):
            try:
                runs.append((api.ask(), None))
                served += 1
            except Exception as exc:  # what the attack did to the polite caller
                notes["error"] = f"{type(exc).__name__}: {str(exc)[:60]}"
    if name != "api-quiet":
        notes["API alive"] = api.proc.poll() is None
    return served, runs, notes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--generations", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--only", nargs="+", choices=ATTACKS, help="these rows (and their quiet one)")
    a = p.parse_args()
    # 1,100 slow connections are as many descriptors here; the soft limit is often 1,024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    names = [n for n in ATTACKS if not a.only or n in a.only or n in ("quiet", "api-quiet")]
    model = Path(tempfile.mkdtemp()) / "tiny-llama"
    save_tiny_llama(model)
    save_tiny_tokenizer(model)
    swarm = Swarm(model)
    api = None
    rows = []
    try:
        for name in names:
            if name.startswith("api-"):
                api = api or Api(swarm)
                rows.append((name, *measure_api(api, name, a)))
            else:
                rows.append((name, *measure(swarm, name, a)))
            print(f"  {name}: {rows[-1][1]}/{a.generations} served", flush=True)
    finally:
        if api is not None:
            api.close()
        swarm.close()
    print(f"\n{cpu_name()}; tiny Llama on 3 nodes (0:3, 3:6, 0:6)")
    print(f"{a.generations} generations an attack, prompt {a.prompt_tokens}, {a.new_tokens} new")
    print("api- rows: the polite caller's one-token request, timed whole (as TTFT)")
    head = f"{'attack':>18}{'served':>8}{'TTFT ms':>9}{'x quiet':>8}"
    print(f"{head}{'TPOT ms':>9}{'x quiet':>8}  notes")
    quiet = {row[0]: row[2] for row in rows if row[0] in ("quiet", "api-quiet")}
    for name, served, runs, notes in rows:
        base = quiet.get("api-quiet" if name.startswith("api-") else "quiet")
        cells = ""
        for k in (0, 1):
            if runs and base and runs[0][k] is not None:
                med, ref = (statistics.median(r[k] for r in rs) for rs in (runs, base))
                cells += f"{med * 1000:>9.1f}{med / ref:>8.2f}"
            else:
                cells += f"{'-':>9}{'':>8}"
        said = ", ".join(f"{k}: {v}" for k, v in notes.items())
        print(f"{name:>18}{served:>5}/{a.generations}{cells}  {said}")


if __name__ == "__main__":
    main()
