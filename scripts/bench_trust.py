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

  .venv/bin/python scripts/bench_trust.py [--generations 3] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import checkout  # noqa: F401 (devtools/ from this checkout)
import hivemind
import trio
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
        t0 = time.perf_counter()
        token = int(s.feed(prompt).argmax())
        ttft = time.perf_counter() - t0
        if check:
            verdict = s.verify(random.Random(0))
            notes["caught"] = notes.get("caught", False) or bool(verdict.suspects)
            token = int(s.feed([token]).argmax())
        t1 = time.perf_counter()
        for _ in range(new):
            token = int(s.feed([token]).argmax())
        return ttft, (time.perf_counter() - t1) / new


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
]


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if "model name" in line), "?")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--generations", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=24)
    a = p.parse_args()
    model = Path(tempfile.mkdtemp()) / "tiny-llama"
    save_tiny_llama(model)
    save_tiny_tokenizer(model)
    swarm = Swarm(model)
    rows = []
    try:
        for name in ATTACKS:
            rows.append((name, *measure(swarm, name, a)))
            print(f"  {name}: {rows[-1][1]}/{a.generations} served", flush=True)
    finally:
        swarm.close()
    quiet = rows[0][2]
    print(f"\n{cpu_name()}; tiny Llama on 3 nodes (0:3, 3:6, 0:6)")
    print(f"{a.generations} generations an attack, prompt {a.prompt_tokens}, {a.new_tokens} new")
    head = f"{'attack':>18}{'served':>8}{'TTFT ms':>9}{'x quiet':>8}"
    print(f"{head}{'TPOT ms':>9}{'x quiet':>8}  notes")
    for name, served, runs, notes in rows:
        cells = ""
        for k in (0, 1):
            if runs and quiet:
                med, base = (statistics.median(r[k] for r in rs) for rs in (runs, quiet))
                cells += f"{med * 1000:>9.1f}{med / base:>8.2f}"
            else:
                cells += f"{'-':>9}{'':>8}"
        said = ", ".join(f"{k}: {v}" for k, v in notes.items())
        print(f"{name:>18}{served:>5}/{a.generations}{cells}  {said}")


if __name__ == "__main__":
    main()
