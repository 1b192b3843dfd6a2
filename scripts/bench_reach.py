"""What TLS and the relayed path cost (issue 24), on the default model, in one sitting.

Two swarms of the default model (default weights, 1 thread a node), blocks 0:15 and 15:30:
- a TLS swarm whose second half is served twice: by a node dialled directly and by one that
  serves only through a relay (`--relay always`, relayed by the first node);
- a plaintext swarm (`--plaintext` on both nodes).
For each path: decode tokens/s of one session (greedy, --tokens after a short prompt), the best
ping round trip to the second node, and how fast --mib MiB frames cross to it (the node reads a
whole frame before it answers that the session does not exist). Variants take turns, --repeats
times; medians printed, with ratios to the direct TLS path.

    .venv/bin/python scripts/bench_reach.py [--repeats 3] [--tokens 64] [--mib 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import bench  # noqa: F401 (this checkout first on the path)
import torch
import trio

from devtools.launch import start_node, start_swarm, stop_all
from swarm.client.client import Client
from swarm.protocol import Error, Step
from swarm.transport import dial_hop, ping
from swarm.wire import pack_tensor

FLAGS = ["--threads", "1", "--announce-ttl", "10"]
PROMPT = [1, 504, 3474, 314, 260, 3578, 30, 2]


def decode_rate(client: Client, exclude: set[str], tokens: int) -> float:
    with client.session(len(PROMPT) + tokens + 1) as s:
        s.excluded.update(exclude)
        logits = s.feed(PROMPT)
        token = int(logits.argmax())
        t0 = time.perf_counter()
        for _ in range(tokens):
            token = int(s.feed([token]).argmax())
        return tokens / (time.perf_counter() - t0)


async def bulk_rate(hop, mib: int, rounds: int = 3) -> float:
    """MiB/s of `mib`-MiB frames sent to the node at `hop`, each answered once read."""
    hidden = pack_tensor(torch.zeros(1, mib * 2**20 // (576 * 2), 576), "float16")
    frame = Step(sid="0" * 32, phase="prefill", pos=0, end=1, hidden=hidden)
    conn = await dial_hop(hop)
    try:
        best = 0.0
        for _ in range(rounds):
            t0 = time.perf_counter()
            await conn.send(frame)
            reply = await conn.receive()
            assert isinstance(reply, Error), reply
            best = max(best, mib / (time.perf_counter() - t0))
        return best
    finally:
        await conn.aclose()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--mib", type=int, default=8)
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    spans = [(0, 15), (15, 30)]
    secure = start_swarm(spans, extra=FLAGS)
    nodes = list(secure)
    try:
        relayed = start_node(spans[1], secure[0].maddrs[:1], extra=[*FLAGS, "--relay", "always"])
        nodes.append(relayed)
        relayed.wait_serving()
        plain = start_swarm(spans, extra=[*FLAGS, "--plaintext"])
        nodes += plain
        tls_client = Client(secure[0].maddrs[:1])
        plain_client = Client(plain[0].maddrs[:1], plaintext=True)
        second = {"TLS, direct": secure[1], "TLS, relayed": relayed, "plaintext": plain[1]}
        paths = {
            "TLS, direct": (tls_client, {relayed.peer}),
            "TLS, relayed": (tls_client, {secure[1].peer}),
            "plaintext": (plain_client, set()),
        }
        hops = {
            name: next(r for r in client.nodes() if r.peer == second[name].peer).hop()
            for name, (client, _) in paths.items()
        }
        rows: dict[str, dict[str, list[float]]] = {n: {} for n in paths}
        for r in range(a.repeats):
            order = list(paths) if r % 2 == 0 else list(paths)[::-1]
            for name in order:
                client, exclude = paths[name]
                row = rows[name]
                row.setdefault("decode tok/s", []).append(decode_rate(client, exclude, a.tokens))
                reach = trio.run(lambda h=hops[name]: ping(h, timeout=10, rounds=20))
                row.setdefault("ping ms", []).append(1000 * reach.rtt_s)
                row.setdefault("MiB/s", []).append(trio.run(bulk_rate, hops[name], a.mib))
            print(f"repeat {r + 1}/{a.repeats} done", flush=True)
        base = {k: statistics.median(v) for k, v in rows["TLS, direct"].items()}
        print(
            f"\n{'path':14} {'decode tok/s':>13} {'ping ms':>9} {'MiB/s':>8}   ratios to TLS direct"
        )
        for name, row in rows.items():
            med = {k: statistics.median(v) for k, v in row.items()}
            ratios = " ".join(f"{k.split()[0]} {med[k] / base[k]:.2f}" for k in med)
            print(
                f"{name:14} {med['decode tok/s']:13.1f} {med['ping ms']:9.3f}"
                f" {med['MiB/s']:8.0f}   {ratios}"
            )
        tls_client.close()
        plain_client.close()
    finally:
        stop_all(nodes)


if __name__ == "__main__":
    main()
