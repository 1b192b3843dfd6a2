"""Hostile connections against live nodes while a legitimate session generates beside them.

Every attack must end in an error frame or a closed connection; the legitimate session's tokens
must equal the unsplit model's; the node must stay alive, answer pings, and keep its memory.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import msgpack
import pytest
import torch
import trio

from devtools.launch import NodeProcess, start_swarm, stop_all
from swarm.client.client import Client
from swarm.dht import announce, node_id, start_dht
from swarm.errors import SwarmError
from swarm.model.source import open_model
from swarm.protocol import (
    Attach,
    Attached,
    Close,
    Error,
    Hop,
    Open,
    Opened,
    Ping,
    Pong,
    Result,
    Step,
    to_wire,
)
from swarm.records import NodeRecord
from swarm.transport import FramedStream, connect, ping
from swarm.wire import FrameDecoder, encode_frame, pack_tensor
from tests.conftest import reference_greedy
from tests.helpers.flags import exact_flags

HIDDEN = 64
IDLE = 3.0  # --connection-idle of the nodes here
MARGIN = 12.0  # two busy cores: the node may be slow to notice an idle connection
RSS_BUDGET = 50 * 1024 * 1024
PROMPT = [7, 70, 170, 270, 370, 470, 3, 33]
MAX_LENGTH = 480  # the tiny model's context is 512
NODE_ARGS = [
    "--plaintext",  # these attacks speak raw frames; TLS's own are in tests/test_tls.py
    *exact_flags(ttl=10),
    "--connection-idle",
    str(IDLE),
    # every attack here comes from 127.0.0.1, dozens at once: the share of one address is
    # tests/test_admission.py's subject, not this file's
    "--max-host-connections",
    "200",
]


@pytest.fixture(scope="module")
def chain(tiny_model_dir, tmp_path_factory):
    """Three nodes, disjoint spans 0:2, 2:4, 4:6: every route goes first -> middle -> last."""
    log = open(tmp_path_factory.mktemp("fuzz-socket") / "nodes.stderr", "w")  # noqa: SIM115
    nodes = start_swarm(
        [(0, 2), (2, 4), (4, 6)], model=str(tiny_model_dir), extra=NODE_ARGS, stderr=log
    )
    yield nodes
    stop_all(nodes)
    log.close()


@pytest.fixture(scope="module")
def client(chain, tiny_model_dir):
    c = Client(chain[0].maddrs[:1], model=str(tiny_model_dir), wire_dtype="float32", plaintext=True)
    yield c
    c.close()


class LoneNode:
    """One node serving the whole tiny model, started again if a previous test killed it."""

    def __init__(self, model: str, log_dir):
        self.model, self.log_dir = model, log_dir
        self.node: NodeProcess | None = None
        self.log = None
        self.starts = 0

    def get(self) -> NodeProcess:
        if self.node is not None and not answers_ping(self.node):
            stop_all([self.node])  # dead, or still dying of what the last test did
            self.node = None
        if self.node is None:
            self.starts += 1
            self.log = self.log_dir / f"lone-{self.starts}.stderr"
            with open(self.log, "w") as f:
                self.node = start_swarm([(0, 6)], model=self.model, extra=NODE_ARGS, stderr=f)[0]
        return self.node

    def stop(self) -> None:
        if self.node is not None:
            stop_all([self.node])


@pytest.fixture(scope="module")
def lone_nodes(tiny_model_dir, tmp_path_factory):
    lone = LoneNode(str(tiny_model_dir), tmp_path_factory.mktemp("fuzz-lone"))
    yield lone
    lone.stop()


@pytest.fixture
def lone_node(lone_nodes) -> NodeProcess:
    return lone_nodes.get()


# ---- helpers ---------------------------------------------------------------------------------


def answers_ping(node: NodeProcess, timeout: float = 5.0) -> bool:
    """Synchronous liveness check, for fixtures."""
    if node.proc.poll() is not None:
        return False
    try:
        with socket.create_connection(node.host_port, timeout=timeout) as sock:
            sock.sendall(encode_frame(to_wire(Ping(nonce=1))))
            decoder = FrameDecoder(4096)
            while (msg := decoder.next_message()) is None:
                data = sock.recv(4096)
                if not data:
                    return False
                decoder.feed(data)
            return msg.get("t") == "pong"
    except (OSError, SwarmError):
        return False


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def assert_alive(node: NodeProcess, log=None) -> None:
    if node.proc.poll() is not None:
        tail = log.read_text()[-3000:] if log is not None else "(stderr not kept)"
        raise AssertionError(f"node {node.layers} died with {node.proc.poll()}:\n{tail}")
    reach = await ping(node.hop(), timeout=10)
    assert reach.reachable, f"node {node.layers} does not answer pings: {reach.error}"


async def raw_connect(node: NodeProcess) -> FramedStream:
    stream = await trio.open_tcp_stream(*node.host_port)
    return FramedStream(stream)


async def verdict(conn: FramedStream, timeout: float = IDLE + MARGIN) -> str:
    """What the node did about our input: 'error:<code>' (first error frame) or 'closed'."""
    with trio.move_on_after(timeout):
        try:
            while True:
                msg = await conn.receive()
                if msg is None:
                    return "closed"
                if isinstance(msg, Error):
                    return f"error:{msg.code}"
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return "closed"
    return "silent"


async def expect_error(conn: FramedStream, code: str, timeout: float = 15) -> Error:
    with trio.fail_after(timeout):
        while True:
            msg = await conn.receive()
            assert msg is not None, f"connection closed while waiting for a {code} error"
            if isinstance(msg, Error):
                assert msg.code == code, msg
                return msg


async def expect(conn: FramedStream, kind: type, timeout: float = 15):
    with trio.fail_after(timeout):
        msg = await conn.receive()
    assert isinstance(msg, kind), msg
    return msg


def hidden(tokens: int, dtype: str = "float32") -> dict:
    return pack_tensor(torch.randn(1, tokens, HIDDEN), dtype)


async def own_session(node: NodeProcess, fingerprint: str, sid: str, start: int, end: int):
    """An attacker's own one-hop session on `node`, attached on the same connection."""
    host, port = node.host_port
    conn = await connect(host, port, tls=None)
    await conn.send(
        Open(
            sid=sid,
            route=(Hop(host, port, start, end, node.peer),),
            hop=0,
            fingerprint=fingerprint,
            wire_dtype="float32",
            max_length=16,
            sink_token="s" * 32,
        )
    )
    await expect(conn, Opened)
    await conn.send(Attach(sid=sid, sink_token="s" * 32))
    await expect(conn, Attached)
    return conn


@dataclass
class Ledger:
    """What each attack got back; every entry must be an error frame or a close."""

    outcomes: list[tuple[str, str]] = field(default_factory=list)

    def add(self, name: str, outcome: str) -> None:
        self.outcomes.append((name, outcome))

    def unanswered(self) -> list[tuple[str, str]]:
        return [(n, o) for n, o in self.outcomes if not o.startswith(("error:", "closed"))]


# ---- the attacks ------------------------------------------------------------------------------


async def random_bytes(node: NodeProcess, ledger: Ledger, rng: random.Random, n: int) -> None:
    blobs = [rng.randbytes(rng.choice([1, 3, 4, 5, 64, 1000, 70_000])) for _ in range(n)]
    for i in range(0, n, 3):  # a small prefix, so the garbage is framed and reaches msgpack
        blobs[i] = struct.pack(">I", len(blobs[i])) + blobs[i]

    async def one(blob: bytes) -> None:
        conn = await raw_connect(node)
        await conn.send_raw(blob)
        ledger.add("random bytes", await verdict(conn))
        await conn.aclose()

    async with trio.open_nursery() as nursery:
        for blob in blobs:
            nursery.start_soon(one, blob)


async def truncated_frames(node: NodeProcess, ledger: Ledger, rng: random.Random, n: int):
    frame = encode_frame(
        to_wire(Step(sid="f" * 32, phase="prefill", pos=0, end=3, hidden=hidden(3)))
    )
    cuts = [rng.randrange(1, len(frame)) for _ in range(n)]

    async def one(cut: int) -> None:
        conn = await raw_connect(node)
        await conn.send_raw(frame[:cut])
        ledger.add("truncated frame", await verdict(conn))
        await conn.aclose()

    async with trio.open_nursery() as nursery:
        for cut in cuts:
            nursery.start_soon(one, cut)


async def huge_prefixes(node: NodeProcess, ledger: Ledger) -> None:
    for length in (16 * 1024 * 1024 + 1, 2**31, 2**32 - 1):
        conn = await raw_connect(node)
        await conn.send_raw(struct.pack(">I", length) + b"\x80" * 16)
        await expect_error(conn, "frame_too_large")
        ledger.add("huge prefix", "error:frame_too_large")
        ledger.add("huge prefix then", await verdict(conn))  # the stream is dropped
        await conn.aclose()


async def big_partial_frame(node: NodeProcess, ledger: Ledger) -> None:
    """Most of a 15 MiB frame, then silence: buffered up to the limit, then let go."""
    conn = await raw_connect(node)
    await conn.send_raw(struct.pack(">I", 15 * 1024 * 1024) + b"\x00" * (8 * 1024 * 1024))
    ledger.add("big partial frame", await verdict(conn))
    await conn.aclose()


WRONG_SHAPES = [
    [1, 2, 3],
    7,
    "step",
    None,
    {"sid": "x"},
    {"t": "teleport"},
    {"t": ["step"]},
    {"t": "step", "sid": 5, "phase": "prefill", "pos": 0, "end": 1},
    {"t": "step", "sid": "x", "phase": "sideways", "pos": 0, "end": 1},
    {"t": "step", "sid": "x", "phase": "prefill", "pos": "0", "end": 1},
    {"t": "step", "sid": "x", "phase": "prefill", "pos": True, "end": 1},
    {"t": "step", "sid": "x", "phase": "prefill", "pos": -1, "end": 1},
    {"t": "step", "sid": "x" * 65, "phase": "prefill", "pos": 0, "end": 1},
    {"t": "open", "sid": "x", "route": {}, "hop": 0},
    {"t": "open", "sid": "x", "route": [], "hop": 0},
    {"t": "open", "sid": "x", "route": [["h", 1, 0]], "hop": 0},
    {"t": "open", "sid": "x", "route": [["h", 1, 0, 2, ""]] * 65, "hop": 0},
    {"t": "ping", "nonce": -5},
    {"t": "ping", "nonce": 2**64 - 1},
    {"t": "attach", "sid": "x"},
    {"t": "pong", "nonce": 1},  # a node takes no pongs from upstream
    {"t": "result", "sid": "x", "end": 1, "hidden": None},
    {"t": "error", "code": "protocol", "message": "you are wrong"},
    {"t": "opened", "sid": "x"},
]


async def wrong_shapes(node: NodeProcess, ledger: Ledger) -> None:
    """Valid msgpack, wrong shape: one protocol error each, on one connection that lives on."""
    conn = await raw_connect(node)
    for obj in WRONG_SHAPES:
        body = msgpack.packb(obj, use_bin_type=True)
        await conn.send_raw(struct.pack(">I", len(body)) + body)
        await expect_error(conn, "protocol")
        ledger.add(f"wrong shape {str(obj)[:40]}", "error:protocol")
    await conn.send(Ping(nonce=9))
    assert (await expect(conn, Pong)).nonce == 9
    await conn.aclose()


async def bad_tensors(node: NodeProcess, fingerprint: str, ledger: Ledger) -> None:
    """Wrong dtype, shape, size and non-finite values on the attacker's own session."""
    sid = os.urandom(16).hex()
    conn = await own_session(node, fingerprint, sid, 0, 2)
    good = hidden(2)
    nan = torch.randn(1, 2, HIDDEN)
    nan[0, 1, 5] = float("nan")
    inf = torch.randn(1, 2, HIDDEN)
    inf[0, 0, 0] = float("-inf")
    bad = [
        {**good, "dtype": "float64"},
        {**good, "dtype": "int8"},
        {**good, "dtype": 5},
        {**good, "shape": [1, 2, HIDDEN + 1]},
        {**good, "shape": [2, 1, HIDDEN]},
        {**good, "shape": [1, 0, HIDDEN]},
        {**good, "shape": [1, 2, HIDDEN, 1]},
        {**good, "shape": [1, -2, HIDDEN]},
        {**good, "shape": "1,2,64"},
        {**good, "data": good["data"][:-1]},
        {**good, "data": good["data"] + b"\x00" * 4},
        {**good, "data": "not bytes"},
        {**good, "extra": 1},
        {"dtype": "float32", "shape": [1, 2, HIDDEN]},
        pack_tensor(nan, "float32"),
        pack_tensor(inf, "float32"),
        pack_tensor(inf, "float16"),
        pack_tensor(torch.full((1, 2, HIDDEN), 1e6), "float16"),  # overflows to Inf on the wire
        None,
        [1, 2],
    ]
    for tensor in bad:
        await conn.send(Step(sid=sid, phase="prefill", pos=0, end=2, hidden=tensor))
        await expect_error(conn, "shape_mismatch")
        ledger.add("bad tensor", "error:shape_mismatch")
    await conn.send(Step(sid=sid, phase="prefill", pos=0, end=2, hidden=good))
    assert (await expect(conn, Result)).end == 2  # the session outlived all of it
    await conn.aclose()


async def replays(node: NodeProcess, fingerprint: str, ledger: Ledger) -> None:
    """Steps replayed, skipped ahead or overlong on the attacker's own session."""
    sid = os.urandom(16).hex()
    conn = await own_session(node, fingerprint, sid, 0, 2)
    await conn.send(Step(sid=sid, phase="prefill", pos=0, end=3, hidden=hidden(3)))
    assert (await expect(conn, Result)).end == 3
    cases = [
        (Step(sid=sid, phase="prefill", pos=0, end=3, hidden=hidden(3)), "protocol"),  # replay
        (Step(sid=sid, phase="decode", pos=2, end=3, hidden=hidden(1)), "protocol"),  # back
        (Step(sid=sid, phase="decode", pos=7, end=8, hidden=hidden(1)), "protocol"),  # ahead
        (Step(sid=sid, phase="decode", pos=3, end=5, hidden=hidden(2)), "shape_mismatch"),
        (Step(sid=sid, phase="prefill", pos=3, end=4, hidden=hidden(2)), "shape_mismatch"),
        (Step(sid=sid, phase="prefill", pos=3, end=40, hidden=hidden(2)), "shape_mismatch"),
        (Step(sid=sid, phase="prefill", pos=3, end=20, hidden=hidden(14)), "shape_mismatch"),
    ]
    for step, code in cases:
        await conn.send(step)
        await expect_error(conn, code)
        ledger.add(f"step {step.phase} {step.pos}:{step.end}", f"error:{code}")
    await conn.send(Step(sid=sid, phase="decode", pos=3, end=4, hidden=hidden(1)))
    assert (await expect(conn, Result)).end == 4
    await conn.send(Step(sid=sid, phase="decode", pos=3, end=4, hidden=hidden(1)))  # replayed
    await expect_error(conn, "protocol")
    ledger.add("replayed decode step", "error:protocol")
    await conn.aclose()


async def foreign_sessions(
    node: NodeProcess, last: NodeProcess, fingerprint: str, sid: str, ledger: Ledger
) -> None:
    """Another connection names the legitimate session: refused as if it did not exist."""
    host, port = node.host_port
    conn = await connect(host, port, tls=None)
    probes = [
        Step(sid=sid, phase="decode", pos=p, end=p + 1, hidden=hidden(1)) for p in (0, 8, 9, 200)
    ]
    probes += [
        Step(sid=sid, phase="prefill", pos=0, end=4, hidden=hidden(4)),
        Close(sid=sid),
        Step(sid=os.urandom(16).hex(), phase="prefill", pos=0, end=1, hidden=hidden(1)),
        Close(sid=os.urandom(16).hex()),
    ]
    for msg in probes:
        await conn.send(msg)
        await expect_error(conn, "session_not_found")
        ledger.add(f"foreign {msg.t}", "error:session_not_found")
    # the same id opened again here is refused without saying whose it is
    await conn.send(
        Open(
            sid=sid,
            route=(Hop(host, port, 0, 2, node.peer),),
            hop=0,
            fingerprint=fingerprint,
            wire_dtype="float32",
            max_length=16,
            sink_token="z" * 32,
        )
    )
    await expect_error(conn, "busy")
    ledger.add("open with a taken sid", "error:busy")
    await conn.aclose()
    # nobody else can claim the legitimate session's results on the last node
    sink = await connect(*last.host_port, tls=None)
    for token in ("", "0" * 32, os.urandom(16).hex()):
        await sink.send(Attach(sid=sid, sink_token=token))
        await expect_error(sink, "session_not_found")
        ledger.add("foreign attach", "error:session_not_found")
    await sink.aclose()


async def slowloris(node: NodeProcess, ledger: Ledger, trickle: bool) -> None:
    """Connect and never finish a frame: closed once connection-idle passes, not before."""
    # timed from before the dial: under the churn this process may resume from the connect
    # well after the node accepted and started its idle timer (2.4 s seen in CI)
    t0 = time.monotonic()
    conn = await raw_connect(node)
    frame = encode_frame({"t": "ping", "nonce": 1, "pad": "x" * 200})
    closed_after = None
    with trio.move_on_after(IDLE + MARGIN):
        async with trio.open_nursery() as nursery:
            if trickle:

                async def drip():
                    for b in frame:
                        await conn.send_raw(bytes([b]))
                        await trio.sleep(0.25)

                nursery.start_soon(_quietly, drip)
            while True:
                try:
                    msg = await conn.receive()
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    msg = None
                if msg is None:
                    closed_after = time.monotonic() - t0
                    nursery.cancel_scope.cancel()
                    break
    name = "slowloris (trickle)" if trickle else "slowloris (silent)"
    assert closed_after is not None, f"{name}: still open after {IDLE + MARGIN} s"
    assert closed_after >= IDLE - 0.1, f"{name}: closed after only {closed_after:.1f} s"
    ledger.add(f"{name} closed after {closed_after:.1f} s", "closed")
    await conn.aclose()


async def _quietly(afn) -> None:
    try:
        await afn()
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass


async def churn(node: NodeProcess, ledger: Ledger, n: int, parallel: int = 25) -> None:
    """Open and drop a thousand connections, some mid-prefix."""
    limiter = trio.CapacityLimiter(parallel)

    async def one(i: int) -> None:
        async with limiter:
            stream = await trio.open_tcp_stream(*node.host_port)
            try:
                if i % 2:
                    await stream.send_all(b"\x00\x00"[: i % 3])
            finally:
                await stream.aclose()

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    ledger.add(f"churn of {n} connections", "closed")


async def middle_node(
    node: NodeProcess, fingerprint: str, sid: str, ledger: Ledger, rng: random.Random
) -> None:
    conn = await raw_connect(node)
    await conn.send_raw(struct.pack(">I", 40) + b"\xc1" + rng.randbytes(39))  # 0xc1: never msgpack
    await expect_error(conn, "protocol")
    ledger.add("middle: random body", "error:protocol")
    await conn.send(Step(sid=sid, phase="decode", pos=9, end=10, hidden=hidden(1)))
    await expect_error(conn, "session_not_found")
    ledger.add("middle: foreign step", "error:session_not_found")
    await conn.send(Close(sid=sid))
    await expect_error(conn, "session_not_found")
    ledger.add("middle: foreign close", "error:session_not_found")
    host, port = node.host_port
    await conn.send(
        Open(
            sid=sid,
            route=(Hop("127.0.0.1", 1, 0, 2, ""), Hop(host, port, 2, 4, node.peer)),
            hop=1,
            fingerprint=fingerprint,
            wire_dtype="float32",
            max_length=16,
            sink_token="z" * 32,
        )
    )
    await expect_error(conn, "busy")
    ledger.add("middle: open with a taken sid", "error:busy")
    await conn.send_raw(struct.pack(">I", 2**31))
    await expect_error(conn, "frame_too_large")
    ledger.add("middle: huge prefix", "error:frame_too_large")
    await conn.aclose()


# ---- the tests ------------------------------------------------------------------------------


def legit_generation(
    client: Client, state: dict, sid_ready: threading.Event, stop: threading.Event
) -> None:
    """Greedy decoding until the attacks are over (at least 20 tokens, at most the context)."""
    out: list[int] = []
    with client.session(MAX_LENGTH) as s:
        logits = s.feed(PROMPT)
        state["sid"] = s.remote.sid
        sid_ready.set()
        while len(out) < MAX_LENGTH - len(PROMPT) - 1 and (not stop.is_set() or len(out) < 20):
            out.append(int(logits.argmax()))
            logits = s.feed([out[-1]])
            time.sleep(0.02)
        state.update(tokens=out, recoveries=list(s.recoveries), sid_after=s.remote.sid)


async def test_hostile_connections_leave_a_concurrent_session_and_the_node_intact(
    chain, client, tiny_reference
):
    first, middle, last = chain
    rng = random.Random(6)
    ledger = Ledger()
    sid_ready, stop = threading.Event(), threading.Event()
    legit: dict = {}

    async def run_legit():
        try:
            await trio.to_thread.run_sync(legit_generation, client, legit, sid_ready, stop)
        finally:
            sid_ready.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_legit)
        await trio.to_thread.run_sync(sid_ready.wait)
        sid = legit["sid"]
        rss_before = {n.layers: rss_bytes(n.pid) for n in (first, middle)}
        fds_before = open_fds(first.pid)
        t0 = time.monotonic()
        try:
            async with trio.open_nursery() as attacks:
                attacks.start_soon(random_bytes, first, ledger, rng, 60)
                attacks.start_soon(truncated_frames, first, ledger, rng, 20)
                attacks.start_soon(huge_prefixes, first, ledger)
                attacks.start_soon(big_partial_frame, first, ledger)
                attacks.start_soon(wrong_shapes, first, ledger)
                attacks.start_soon(bad_tensors, first, client.fingerprint, ledger)
                attacks.start_soon(replays, first, client.fingerprint, ledger)
                attacks.start_soon(foreign_sessions, first, last, client.fingerprint, sid, ledger)
                attacks.start_soon(slowloris, first, ledger, False)
                attacks.start_soon(slowloris, first, ledger, True)
                attacks.start_soon(churn, first, ledger, 1000)
                attacks.start_soon(middle_node, middle, client.fingerprint, sid, ledger, rng)
        finally:
            stop.set()
        attack_seconds = time.monotonic() - t0

    for node in chain:
        await assert_alive(node)
    await trio.sleep(1)  # let the node finish closing what the attacks left behind
    rss_after = {n.layers: rss_bytes(n.pid) for n in (first, middle)}
    fds_after = open_fds(first.pid)
    print(
        f"\n{len(ledger.outcomes)} attacks in {attack_seconds:.1f} s while the session made"
        f" {len(legit['tokens'])} tokens"
    )
    for layers in rss_before:
        print(
            f"node {layers} RSS before {rss_before[layers] / 2**20:.1f} MiB,"
            f" after {rss_after[layers] / 2**20:.1f} MiB"
        )
    print(f"first node open fds before {fds_before}, after {fds_after}")
    print(Counter(outcome for _, outcome in ledger.outcomes))

    assert ledger.unanswered() == []
    assert legit["tokens"] == reference_greedy(tiny_reference, PROMPT, len(legit["tokens"]))
    assert legit["recoveries"] == [] and legit["sid_after"] == sid  # never even rerouted
    for layers in rss_before:
        assert rss_after[layers] - rss_before[layers] < RSS_BUDGET
    assert fds_after <= fds_before + 8


async def test_a_foreign_session_id_gets_the_same_error_as_an_unknown_one(chain, client):
    """Nothing in the refusal tells an attacker that a guessed id exists."""
    conn = await connect(*chain[0].host_port, tls=None)

    def legit():
        with client.session(32) as s:
            s.feed(PROMPT)
            return trio.from_thread.run(probe, s.remote.sid)

    async def probe(sid):
        refusals = []
        for target in (sid, os.urandom(16).hex()):
            await conn.send(Step(sid=target, phase="decode", pos=8, end=9, hidden=hidden(1)))
            err = await expect_error(conn, "session_not_found")
            refusals.append((err.code, err.hop, err.message.replace(target[:8], "<sid>")))
        return refusals

    foreign, unknown = await trio.to_thread.run_sync(legit)
    await conn.aclose()
    assert foreign == unknown


async def test_a_tensor_whose_dtype_is_not_a_string_gets_shape_mismatch(
    lone_node, lone_nodes, fingerprint
):
    conn = await own_session(lone_node, fingerprint, "d" * 32, 0, 6)
    got = []
    for dtype in ([], {}, [1, 2], {"a": 1}):
        tensor = {"dtype": dtype, "shape": [1, 1, HIDDEN], "data": b"\x00" * (4 * HIDDEN)}
        await conn.send(Step(sid="d" * 32, phase="prefill", pos=0, end=1, hidden=tensor))
        got.append(await verdict(conn, 15))
    await conn.aclose()
    await assert_alive(lone_node, lone_nodes.log)
    assert got == ["error:shape_mismatch"] * 4


async def test_attach_with_a_non_ascii_token_gets_session_not_found(
    lone_node, lone_nodes, fingerprint
):
    host, port = lone_node.host_port
    conn = await connect(host, port, tls=None)
    got = []
    for sid, opened_with, attached_with in [
        ("g" * 32, "s" * 32, "\u00f1" * 32),
        ("h" * 32, "\u00f1" * 32, "s" * 32),
    ]:
        await conn.send(
            Open(
                sid=sid,
                route=(Hop(host, port, 0, 6, lone_node.peer),),
                hop=0,
                fingerprint=fingerprint,
                wire_dtype="float32",
                max_length=16,
                sink_token=opened_with,
            )
        )
        await expect(conn, Opened)
        await conn.send(Attach(sid=sid, sink_token=attached_with))
        got.append(await verdict(conn, 15))
    await conn.aclose()
    await assert_alive(lone_node, lone_nodes.log)
    assert got == ["error:session_not_found"] * 2


@pytest.mark.parametrize(
    "next_host",
    [
        pytest.param("a..b", id="empty-label"),
        pytest.param("x" * 70 + ".example", id="label-too-long"),
        pytest.param("\u00e9" * 64, id="idna-too-long"),
        pytest.param("no-such-host.invalid", id="unresolvable"),
    ],
)
async def test_open_naming_an_unusable_next_hop_gets_unannounced_peer(
    lone_node, lone_nodes, fingerprint, next_host
):
    host, port = lone_node.host_port
    conn = await connect(host, port, tls=None)
    await conn.send(two_hop_open(lone_node, fingerprint, Hop(next_host, 80, 3, 6, "")))
    got = await verdict(conn, 30)
    await conn.aclose()
    await assert_alive(lone_node, lone_nodes.log)
    assert got == "error:unannounced_peer"


@pytest.fixture
def announcer(lone_node):
    """A DHT peer in the lone node's swarm, to announce a next hop the node will believe."""
    dht = start_dht(lone_node.maddrs[:1])
    yield dht
    dht.shutdown()


async def test_open_whose_announced_next_hop_never_accepts_gets_peer_failed(
    lone_node, lone_nodes, fingerprint, tiny_model_dir, announcer
):
    """A next hop whose accept queue is full: the connect hangs until the node gives up."""
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        fillers = [socket.socket() for _ in range(4)]
        for s in fillers:  # fill the accept queue; later SYNs are dropped
            s.setblocking(False)
            try:
                s.connect(full.getsockname())
            except BlockingIOError:
                pass
        config = open_model(str(tiny_model_dir)).config
        record = NodeRecord(
            peer=node_id(),
            addr=f"127.0.0.1:{full.getsockname()[1]}",
            model=config.name,
            start=3,
            end=6,
            state="online",
            fingerprint=fingerprint,
            version="0",
            num_layers=config.num_layers,
        )
        assert announce(announcer, [record], ttl=60) > 0
        await trio.sleep(0.5)
        conn = await connect(*lone_node.host_port, tls=None)
        hop = Hop(*full.getsockname(), 3, 6, record.peer)
        await conn.send(two_hop_open(lone_node, fingerprint, hop))
        got = await verdict(conn, 60)
        await conn.aclose()
        for s in fillers:
            s.close()
    await assert_alive(lone_node, lone_nodes.log)
    assert got == "error:peer_failed"


def two_hop_open(node: NodeProcess, fingerprint: str, next_hop: Hop) -> Open:
    host, port = node.host_port
    return Open(
        sid=os.urandom(16).hex(),
        route=(Hop(host, port, 0, 3, node.peer), next_hop),
        hop=0,
        fingerprint=fingerprint,
        wire_dtype="float32",
        max_length=16,
        sink_token="s" * 32,
    )
