"""The public health page: a real DHT, node processes, `python -m swarm.health`, headless Chromium.

The end-to-end tests run real nodes of the tiny random Llama from conftest. Run as a script
(`python tests/test_health.py fake-node ...`) this file is also a stand-in node that announces
records like swarm.node and answers pings, or takes connections and never answers (--hang):
the hung node of these tests, and the nodes of scripts/bench_health.sh.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio

from swarm.dht import NodeKey
from swarm.health.app import create_app
from swarm.health.render import render_page
from swarm.health.snapshot import DhtStatus, Known, Snapshot, build_model_view
from swarm.health.state import Collector, CollectorConfig
from swarm.records import MODELS_KEY, ModelRecord, NodeRecord, Reported, block_key
from swarm.transport import Reach
from tests.helpers.flags import exact_flags
from tests.helpers.records import node_record

MODEL, LAYERS, FINGERPRINT = "tiny-fake", 8, "fp-test-0001"
CHECKOUT = str(Path(__file__).resolve().parents[1])  # a fake node runs this file: tests.helpers
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


# ---- pure parts: coverage, route, throughput, escaping -------------------------------------


def rec(peer: str, start: int, end: int, **kw) -> NodeRecord:
    base = dict(
        addr=f"10.0.0.{start}:{7000 + end}",
        model=MODEL,
        fingerprint=FINGERPRINT,
        version="0.1.0",
        num_layers=LAYERS,
        throughput=10.0,
        updated=1000.0,
    )
    return node_record(peer, start, end, **{**base, **kw})


def view(
    *records: NodeRecord,
    reach: dict[str, Reach] | None = None,
    now: float = 1001.0,
    reports: dict[str, Reported] | None = None,
):
    model = ModelRecord(MODEL, LAYERS, FINGERPRINT)
    known = [Known(r, expires=1010.0) for r in records]
    return build_model_view(model, known, reach or {}, now, reports)


def snapshot(*records: NodeRecord, **options) -> Snapshot:
    """A snapshot of one model's nodes (`view`'s records and options), the DHT answering."""
    return Snapshot(
        taken_at=1001.0, dht=DhtStatus("ok", 1001.0, 0.01), models=(view(*records, **options),)
    )


def test_coverage_counts_usable_nodes_per_block_and_a_gap_breaks_the_route():
    m = view(rec("a", 0, 4), rec("b", 2, 6), rec("c", 7, 8))
    assert m.coverage == (1, 1, 2, 2, 1, 1, 0, 1)
    assert m.gaps == [(6, 7)]
    assert not m.full_route
    assert m.throughput == 0.0


def test_throughput_is_the_weakest_blocks_summed_capacity():
    m = view(
        rec("a", 0, 4, throughput=10.0),
        rec("b", 2, 6, throughput=20.0),
        rec("c", 4, 8, throughput=30.0),
    )
    assert m.full_route
    assert m.throughput == 10.0


def test_unreachable_offline_expired_and_foreign_weight_nodes_do_not_count():
    unreachable = rec("u", 0, 8)
    m = view(
        unreachable,
        rec("o", 0, 8, state="offline"),
        rec("f", 0, 8, fingerprint="other"),
        reach={unreachable.addr: Reach(error="no pong within 1 s")},
    )
    assert m.coverage == (0,) * LAYERS
    expired = view(rec("e", 0, 8), now=2000.0)
    assert expired.coverage == (0,) * LAYERS
    assert [n.state for n in expired.nodes] == ["expired"]


def test_page_escapes_whatever_strangers_put_in_records():
    hostile = rec("<b>peer</b>", 0, 8, version="<script>alert(1)</script>", addr='h"x:1')
    snap = snapshot(hostile)
    page = render_page(snap, 10)
    assert "<script" not in page
    assert "&lt;script&gt;" in page
    assert "<b>peer" not in page


def test_page_shows_each_nodes_weight_format():
    # a node from before records carried the field: its weights read as float32
    old = {k: v for k, v in rec("f", 4, 8).to_wire().items() if k != "weights"}
    snap = snapshot(rec("q", 0, 4, weights="int4"), NodeRecord.from_wire(old))
    page = render_page(snap, 10)
    cells = re.findall(r'<td data-label="Weights"><div><code>([^<]*)</code>', page)
    assert cells == ["int4", "float32"]
    nodes = snap.to_json()["models"][0]["nodes"]
    assert [n["weights"] for n in nodes] == ["int4", "float32"]


def test_page_marks_relayed_and_plaintext_nodes():
    key = "ab" * 32
    snap = snapshot(
        rec("direct", 0, 4, tls=key),
        rec("behind", 0, 4, tls=key, relay="12D3KooWRelayRelay"),
        rec("clear", 4, 8),
    )
    page = render_page(snap, 10)
    rows = {m[0]: m[1] for m in re.findall(r'data-peer="(\w+)".*?Address"><div>(.*?)</div>', page)}
    assert "relay" not in rows["direct"] and "plaintext" not in rows["direct"]
    assert "via relay …layRelay" in rows["behind"] and "plaintext" not in rows["behind"]
    assert "plaintext" in rows["clear"]
    nodes = {n["peer"]: n for n in snap.to_json()["models"][0]["nodes"]}
    assert nodes["behind"]["relay"] == "12D3KooWRelayRelay" and nodes["clear"]["tls"] == ""


def test_page_shows_each_nodes_sessions_and_mean_decode_batch():
    # a node from before records carried the fields: no sessions, batches of one
    old = {
        k: v
        for k, v in rec("f", 4, 8).to_wire().items()
        if k not in ("sessions", "decode_batch", "decode_passes")
    }
    busy = rec("q", 0, 4, sessions=5, decode_batch=2.46, decode_passes=300)
    snap = snapshot(busy, NodeRecord.from_wire(old))
    cells = re.findall(
        r'<td data-label="Sessions" class=num><div>(\d+) <span[^>]*>· batch ([\d.]+)',
        render_page(snap, 10),
    )
    assert cells == [("5", "2.5"), ("0", "1.0")]
    nodes = snap.to_json()["models"][0]["nodes"]
    assert [(n["sessions"], n["decode_batch"]) for n in nodes] == [(5, 2.46), (0, 1.0)]


def test_page_shows_sessions_moved_with_their_caches_and_transfers_in_flight():
    took = rec("r", 0, 4, moved_in=4)
    leaving = rec("l", 0, 4, state="offline", moved_out=3, transfers=1)
    quiet = rec("q", 4, 8)
    snap = snapshot(took, leaving, quiet)
    page = render_page(snap, 10)
    moved = re.findall(r"· moved ([^<]*)</span>", page)
    assert sorted(moved) == ["0 in, 3 out, 1 moving", "4 in, 0 out"]
    nodes = {n["peer"]: n for n in snap.to_json()["models"][0]["nodes"]}
    assert (nodes["r"]["moved_in"], nodes["l"]["transfers"], nodes["q"]["moved_out"]) == (4, 1, 0)


def test_page_and_json_show_kv_blocks_lent_and_sessions_borrowing():
    lender = rec("c", 0, 4, lent_mb=12.5)
    borrower = rec("b", 4, 8, borrowing=2)
    quiet = rec("q", 0, 8)
    snap = snapshot(lender, borrower, quiet)
    page = render_page(snap, 10)
    badges = re.findall(r'<span class="muted lending"[^>]*>· ([^<]*)</span>', page)
    assert sorted(badges) == ["2 borrowing", "lends 12.5 MB"]
    nodes = {n["peer"]: n for n in snap.to_json()["models"][0]["nodes"]}
    assert (nodes["c"]["lent_mb"], nodes["b"]["borrowing"], nodes["q"]["lent_mb"]) == (12.5, 2, 0)


def test_page_shows_the_session_a_node_could_take_by_borrowing_beside_its_free_cache():
    borrower = rec("b", 0, 4, free_cache_tokens=48, cache_tokens=64, borrow_tokens=1040)
    same = rec("s", 4, 8, free_cache_tokens=4096, cache_tokens=64, borrow_tokens=1040)
    quiet = rec("q", 0, 8, free_cache_tokens=64)
    snap = snapshot(borrower, same, quiet)
    page = render_page(snap, 10)
    badges = re.findall(r'<span class="muted borrowable"[^>]*>· ([^<]*)</span>', page)
    assert badges == ["1,040 by borrowing"]  # not beside a free cache that holds more
    nodes = {n["peer"]: n for n in snap.to_json()["models"][0]["nodes"]}
    assert (nodes["b"]["borrow_tokens"], nodes["q"]["borrow_tokens"]) == (1040, 0)


def test_page_and_json_show_a_session_cap_below_what_the_node_could_hold():
    capped = rec("c", 0, 4, free_cache_tokens=4096, cache_tokens=8192, session_tokens=1024)
    roomy = rec("r", 4, 8, free_cache_tokens=4096, cache_tokens=8192, session_tokens=8192)
    unsaid = rec("u", 0, 8, free_cache_tokens=64)
    snap = snapshot(capped, roomy, unsaid)
    page = render_page(snap, 10)
    badges = re.findall(r'<span class="muted session-cap"[^>]*>· ([^<]*)</span>', page)
    assert badges == ["1,024 a session at most"]
    nodes = {n["peer"]: n for n in snap.to_json()["models"][0]["nodes"]}
    got = [(nodes[p]["cache_tokens"], nodes[p]["session_tokens"]) for p in ("c", "r", "u")]
    assert got == [(8192, 1024), (8192, 8192), (0, 0)]


def test_page_and_json_show_prefill_and_decode_roles():
    snap = snapshot(rec("p", 0, 8, role="prefill"), rec("d", 0, 8, role="decode"), rec("b", 0, 8))
    page = render_page(snap, 10)
    assert sorted(re.findall(r'<span class="badge role"[^>]*>([^<]*)</span>', page)) == [
        "decode",
        "prefill",
    ]
    nodes = {n["peer"]: n["role"] for n in snap.to_json()["models"][0]["nodes"]}
    assert nodes == {"p": "prefill", "d": "decode", "b": "both"}


def test_page_flags_a_node_clients_reported_with_how_many_keys_reported_it():
    said = Reported("liar", frozenset({"k1", "k2", "k3"}), ((0, 4),), last=1000.0)
    snap = snapshot(rec("liar", 0, 4), rec("honest", 4, 8), reports={"liar": said})
    states = dict(re.findall(r'data-peer="(\w+)".*?State"><div>(.*?)</div>', render_page(snap, 10)))
    assert "reported by 3</span>" in states["liar"] and "a signal, not a verdict" in states["liar"]
    assert "reported" not in states["honest"]
    nodes = {n["peer"]: n for n in snap.to_json()["models"][0]["nodes"]}
    assert nodes["liar"]["reported"] == {"reporters": 3, "blocks": [[0, 4]], "last": 1000.0}
    assert nodes["honest"]["reported"] is None


def test_page_has_no_script_and_no_external_asset():
    snap = snapshot(rec("a", 0, 8))
    page = render_page(snap, 10)
    assert "<script" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)
    assert '<meta http-equiv="refresh" content="10">' in page


# ---- the collector: requests never wait on the DHT ----------------------------------------


async def http_get(port: int, path: str) -> tuple[int, bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(
            f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode()
        )
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


async def burst(port: int, path: str, n: int) -> tuple[list[int], float]:
    """`n` requests at once; their statuses and the slowest one's seconds."""
    statuses: list[int] = []
    slowest = 0.0

    async def one() -> None:
        nonlocal slowest
        t = trio.current_time()
        status, _ = await http_get(port, path)
        statuses.append(status)
        slowest = max(slowest, trio.current_time() - t)

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)
    return statuses, slowest


async def test_pages_are_served_while_a_dht_read_hangs():
    from hypercorn.config import Config
    from hypercorn.trio import serve

    release = threading.Event()
    calls = []

    def stuck_survey(dht, max_models, max_layers):
        calls.append(time.monotonic())
        release.wait(60)  # a hivemind call that does not come back
        raise TimeoutError("released")

    async def never_pinged(addr: str, timeout: float, rounds: int) -> Reach:
        raise AssertionError("nothing to ping")

    collector = Collector(
        CollectorConfig((), interval=0.2, dht_timeout=0.5),
        dht_starter=lambda cfg: types.SimpleNamespace(shutdown=lambda: None),
        surveyor=stuck_survey,
        pinger=never_pinged,
    )
    app = create_app(lambda: collector.snapshot, stale_after=collector.config.stale_after)
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.backlog = 2048
    config.accesslog = None
    try:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve, app, config)
            port = int(binds[0].rsplit(":", 1)[1])
            await nursery.start(collector.run)
            with trio.fail_after(20):
                while collector.snapshot.dht.error is None:
                    await trio.sleep(0.05)
            statuses, slowest = await burst(port, "/", 200)
            assert statuses == [200] * 200
            assert slowest < 10
            status, body = await http_get(port, "/healthz")
            assert status == 503 and json.loads(body)["status"] == "starting"
            status, body = await http_get(port, "/api/v1/state")
            assert status == 200
            assert json.loads(body)["dht"]["error"].startswith("DHT read failed")
            nursery.cancel_scope.cancel()
    finally:
        release.set()
    # the abandoned call held the DHT: later cycles report it busy rather than pile up threads
    assert len(calls) == 1


# ---- end to end: real DHT, node processes, the health server, Chromium ---------------------

SPANS = {"a": (0, 2), "b": (1, 5), "c": (4, 6)}  # of the 6-layer tiny model from conftest
NODE_TTL = 10.0  # the nodes' --announce-ttl: how long a killed node's records may linger
HUNG_WEIGHTS = "int4"  # the stand-in node's announced weight format; real nodes': float32


def descendants(pid: int) -> list[int]:
    """Every process below `pid`: node processes run hivemind's DHT in a child of their own."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def signal_tree(pid: int, sig: int) -> None:
    """SIGTERM asks the process to leave; any other signal hits its whole tree."""
    targets = [pid] if sig == signal.SIGTERM else [pid, *descendants(pid)]
    for target in targets:
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass


@dataclass
class Proc:
    """A child process whose output lines are collected by a thread."""

    proc: subprocess.Popen
    name: str
    lines: list[str] = field(default_factory=list)
    _queue: queue.Queue = field(default_factory=queue.Queue)

    @classmethod
    def start(cls, cmd: list[str], name: str) -> Proc:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": CHECKOUT},
        )
        p = cls(proc, name)
        threading.Thread(target=p._pump, daemon=True).start()
        return p

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float = 120.0) -> re.Match:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(f"{self.name} exited:\n" + "\n".join(self.lines[-40:]))
            if m := re.search(pattern, line):
                return m
        raise TimeoutError(
            f"{self.name}: no {pattern!r} in {timeout} s:\n" + "\n".join(self.lines[-40:])
        )

    def stop(self) -> None:
        stop_tree(self.proc)


def stop_tree(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL for whatever is left of the process and its DHT child."""
    below = descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class Member:
    """One node of the test swarm, real or stand-in."""

    proc: subprocess.Popen
    span: tuple[int, int]
    addr: str
    peer: str


def get_json(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, json.loads(r.read())


def poll(fetch: Callable[[], dict], ok: Callable[[dict], bool], timeout: float, what: str):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = fetch()
            if ok(last):
                return last
        except (OSError, urllib.error.URLError, KeyError, ValueError, StopIteration):
            pass
        time.sleep(0.5)
    raise AssertionError(f"{what} not seen within {timeout} s; last: {json.dumps(last)[:3000]}")


@dataclass
class Swarm:
    dht: object  # a DHT peer of the test's own, to write junk records with
    maddrs: list[str]
    nodes: dict[str, Member]
    health: Proc
    url: str
    model_name: str
    num_layers: int

    def state(self) -> dict:
        return get_json(self.url + "api/v1/state")[1]

    def model(self) -> dict:
        return next(m for m in self.state()["models"] if m["model"] == self.model_name)

    def node(self, m: dict, name: str) -> dict:
        return next(n for n in m["nodes"] if n["peer"] == self.nodes[name].peer)

    def all_listed(self, state: dict) -> bool:
        m = next(m for m in state["models"] if m["model"] == self.model_name)
        peers = {n["peer"]: n for n in m["nodes"]}
        return all(
            n.peer in peers and peers[n.peer]["reachable"] is not None for n in self.nodes.values()
        )

    def signal(self, name: str, sig: int) -> None:
        signal_tree(self.nodes[name].proc.pid, sig)


@pytest.fixture(scope="module")
def swarm(tiny_model_dir):
    from devtools.launch import start_swarm
    from swarm.dht import start_dht

    real = start_swarm(
        list(SPANS.values()),
        model=str(tiny_model_dir),
        extra=exact_flags(ttl=NODE_TTL),
    )
    cleanup: list[subprocess.Popen] = [n.proc for n in real]
    dht = None
    try:
        maddrs = real[0].maddrs[:1]
        nodes = {
            name: Member(n.proc, span, n.addr, n.peer)
            for (name, span), n in zip(SPANS.items(), real, strict=True)
        }
        health = Proc.start(
            [
                sys.executable, "-m", "swarm.health", "--initial-peers", *maddrs,
                "--host", "127.0.0.1", "--port", "0", "--interval", "1", "--refresh", "5",
                "--ping-timeout", "1.5", "--dht-timeout", "5", "--forget-after", "120",
            ],
            "health server",
        )  # fmt: skip
        cleanup.insert(0, health.proc)
        url = health.wait_for(r"health page on (http://\S+/)").group(1)

        def first_model(state: dict) -> dict:
            return next(
                m for m in state["models"] if any(n["peer"] == real[0].peer for n in m["nodes"])
            )

        state = poll(
            lambda: get_json(url + "api/v1/state")[1], first_model, 120, "the swarm's model"
        )
        model = first_model(state)
        # a node that takes connections and never answers them, on the same model
        hung = Proc.start(
            [
                sys.executable, __file__, "fake-node", "--hang", "--span",
                f"0:{model['num_layers']}", "--model", model["model"], "--fingerprint",
                model["fingerprint"], "--num-layers", str(model["num_layers"]),
                "--ttl", str(NODE_TTL), "--weights", HUNG_WEIGHTS, "--initial-peers", *maddrs,
            ],
            "hung node",
        )  # fmt: skip
        cleanup.append(hung.proc)
        m = hung.wait_for(r"serving blocks \d+:\d+ on (\S+) \(peer (\S+)\)")
        nodes["hung"] = Member(hung.proc, (0, model["num_layers"]), m.group(1), m.group(2))
        dht = start_dht(maddrs)
        yield Swarm(dht, maddrs, nodes, health, url, model["model"], model["num_layers"])
    finally:
        for proc in cleanup:
            stop_tree(proc)
        if dht is not None:
            dht.shutdown()


def test_state_json_lists_every_node_with_its_span_and_measured_rtt(swarm):
    state = poll(swarm.state, swarm.all_listed, 90, "all four nodes pinged")
    assert state["schema"] == 1 and state["dht"]["state"] == "ok"
    m = swarm.model()
    assert m["num_layers"] == 6
    for name in SPANS:
        n = swarm.node(m, name)
        assert (n["start"], n["end"]) == swarm.nodes[name].span
        assert n["addr"] == swarm.nodes[name].addr
        assert n["state"] == "online" and n["usable"] and n["fingerprint_ok"]
        assert n["reachable"] is True and 0 < n["rtt_ms"] < 1000
        assert n["throughput"] > 0 and n["free_cache_tokens"] > 0
        assert isinstance(n["link"], dict) and n["version"]
        assert n["weights"] == "float32"
        assert 0 <= n["updated_ago_s"] < 60 and n["expires_in_s"] > 0
    hung = swarm.node(m, "hung")
    assert hung["weights"] == HUNG_WEIGHTS
    assert hung["reachable"] is False and not hung["usable"]
    assert "no pong" in hung["ping_error"]
    # the hung node (0:6) is unreachable, so it adds nothing: a 0:2, b 1:5, c 4:6
    assert m["coverage"] == [1, 2, 1, 1, 2, 1]
    assert m["full_route"] is True and m["gaps"] == []
    assert m["nodes_online"] == 3
    thr = {name: swarm.node(m, name)["throughput"] for name in SPANS}
    bottleneck = min(thr["a"], thr["a"] + thr["b"], thr["b"], thr["b"] + thr["c"], thr["c"])
    assert m["throughput"] == pytest.approx(bottleneck, rel=1e-3)


def test_healthz_is_ok_once_the_dht_was_read(swarm):
    poll(swarm.state, swarm.all_listed, 90, "all nodes listed")
    status, body = get_json(swarm.url + "healthz")
    assert status == 200 and body["status"] == "ok" and body["models"] >= 1


def chromium(*args: str, tmp_path: Path, timeout: float = 90) -> subprocess.CompletedProcess:
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--no-first-run", "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}", *args,
    ]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium: apt-get install chromium")
def test_page_in_headless_chromium_shows_the_bar_and_every_node(swarm, tmp_path):
    poll(swarm.state, swarm.all_listed, 90, "all nodes listed")
    dom = chromium("--dump-dom", swarm.url, tmp_path=tmp_path).stdout
    assert f'data-model="{swarm.model_name}"' in dom
    cells = re.findall(r'<i class="c(\d)" title="block (\d+): (\d+) nodes?" data-count', dom)
    assert [int(c[2]) for c in cells] == [1, 2, 1, 1, 2, 1]
    rows = re.findall(r'<tr[^>]*data-peer="([^"]+)" data-state="([^"]+)"', dom)
    peers = {n.peer for n in swarm.nodes.values()}
    assert {peer for peer, _ in rows} >= peers
    for n in swarm.nodes.values():
        assert f"{n.span[0]}:{n.span[1]}" in dom
        assert n.addr in dom
    weights = re.findall(
        r'<tr[^>]*data-peer="([^"]+)".*?<td data-label="Weights"><div><code>([^<]*)</code>', dom
    )
    hung = swarm.nodes["hung"].peer
    assert {peer: w for peer, w in weights if peer in peers} == {
        n.peer: HUNG_WEIGHTS if n.peer == hung else "float32" for n in swarm.nodes.values()
    }
    assert "unreachable" in dom and 'id="route">yes<' in dom
    for name, size in (("desktop", "1280,900"), ("phone", "390,844")):
        shot = tmp_path / f"health-{name}.png"
        chromium(f"--screenshot={shot}", f"--window-size={size}", swarm.url, tmp_path=tmp_path)
        assert shot.exists() and shot.stat().st_size > 5000
        print(f"screenshot: {shot}")


def test_malformed_and_foreign_records_are_skipped_and_counted(swarm):
    from hivemind.utils import get_dht_time

    exp = get_dht_time() + 300
    name = swarm.model_name
    junk = [  # signed (the swarm's DHT peers store nothing else), each under its own key
        (block_key(name, 2), "not a map"),
        (MODELS_KEY, {"model": "huge", "num_layers": 10**9, "fingerprint": "x"}),
        (block_key(name, 0), {"peer": 1}),
        (block_key(name, 1), rec("f", 0, 6, model="elsewhere").to_wire()),
    ]
    for key, value in junk:
        assert swarm.dht.store(key, value, exp, subkey=NodeKey.process_wide().subkey)
    state = poll(swarm.state, lambda s: s["skipped_records"] >= len(junk), 60, "skipped records")
    assert [m["model"] for m in state["models"]] == [name]
    assert swarm.model()["full_route"] is True
    with urllib.request.urlopen(swarm.url, timeout=10) as r:
        assert r.status == 200
        assert b"malformed or foreign" in r.read()


def test_a_killed_node_leaves_the_page_within_its_record_expiry(swarm, tmp_path):
    poll(swarm.state, swarm.all_listed, 90, "all nodes listed")
    swarm.signal("a", signal.SIGKILL)
    killed = time.monotonic()
    # at once: its data plane is gone, so it no longer counts
    m = poll(swarm.model, lambda m: not swarm.node(m, "a")["usable"], 15, "a unreachable")
    assert m["coverage"][0] == 0 and m["full_route"] is False
    m = poll(
        swarm.model,
        lambda m: swarm.node(m, "a")["state"] == "expired",
        NODE_TTL + 30,
        "a expired",
    )
    # its records last at most a TTL after its last refresh; reads and pings add seconds
    assert time.monotonic() - killed < NODE_TTL + 20
    assert m["coverage"][0] == 0 and m["gaps"] == [[0, 1]]
    assert m["full_route"] is False and m["throughput"] == 0.0
    with urllib.request.urlopen(swarm.url, timeout=10) as r:
        page = r.read().decode()
    assert 'id="route">no<' in page and "blocks 0<" in page
    assert f'data-peer="{swarm.nodes["a"].peer}" data-state="expired"' in page
    if CHROMIUM:
        shot = tmp_path / "health-gap.png"
        chromium(f"--screenshot={shot}", "--window-size=1280,900", swarm.url, tmp_path=tmp_path)
        print(f"screenshot: {shot}")


def test_a_node_that_stops_gracefully_shows_offline(swarm):
    poll(swarm.state, lambda s: bool(s["models"]), 60, "the model")
    swarm.signal("c", signal.SIGTERM)
    m = poll(swarm.model, lambda m: swarm.node(m, "c")["state"] == "offline", 30, "c offline")
    assert not swarm.node(m, "c")["usable"]
    assert m["coverage"][5] == 0


async def test_pages_stay_fast_while_the_dht_and_every_node_are_frozen(swarm):
    port = int(swarm.url.rstrip("/").rsplit(":", 1)[1])
    frozen = [n.proc.pid for n in swarm.nodes.values() if n.proc.poll() is None]
    frozen.append(swarm.dht.pid)
    for pid in frozen:
        signal_tree(pid, signal.SIGSTOP)
    try:
        await trio.sleep(3)  # long enough for a refresh to start and hang on them
        statuses, slowest = await burst(port, "/", 200)
        assert statuses == [200] * 200
        assert slowest < 10
        statuses, _ = await burst(port, "/api/v1/state", 50)
        assert statuses == [200] * 50
    finally:
        for pid in frozen:
            signal_tree(pid, signal.SIGCONT)


# ---- the stand-in node ---------------------------------------------------------------------


def fake_node_main(argv: list[str]) -> None:
    import argparse

    from swarm.dht import announce, node_id, start_dht, visible_maddrs
    from swarm.protocol import Pong, to_wire
    from swarm.wire import FrameDecoder, encode_frame

    p = argparse.ArgumentParser()
    p.add_argument("--span", required=True)
    p.add_argument("--initial-peers", nargs="*", default=[], help="none: start a new swarm")
    p.add_argument("--ttl", type=float, default=10.0)
    p.add_argument("--throughput", type=float, default=10.0)
    p.add_argument("--hang", action="store_true", help="accept connections, never answer")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--fingerprint", default=FINGERPRINT)
    p.add_argument("--num-layers", type=int, default=LAYERS)
    p.add_argument("--weights", default="float32")
    a = p.parse_args(argv)
    start, end = map(int, a.span.split(":"))
    dht = start_dht(a.initial_peers)
    for maddr in visible_maddrs(dht):
        print(f"  --initial-peers {maddr}", flush=True)

    async def handle(stream: trio.SocketStream) -> None:
        if a.hang:
            await trio.sleep_forever()
        decoder = FrameDecoder(4096)
        async for data in stream:
            decoder.feed(data)
            while (msg := decoder.next_message()) is not None:
                if msg.get("t") == "ping":
                    await stream.send_all(encode_frame(to_wire(Pong(nonce=msg["nonce"]))))

    async def main() -> None:
        from hivemind.utils import get_dht_time

        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        addr = f"127.0.0.1:{listeners[0].socket.getsockname()[1]}"

        def publish(state: str) -> None:
            record = NodeRecord(
                peer=node_id(),
                addr=addr,
                model=a.model,
                start=start,
                end=end,
                state=state,
                fingerprint=a.fingerprint,
                version="0.1.0-fake",
                num_layers=a.num_layers,
                free_cache_tokens=32768,
                throughput=a.throughput,
                link={"bandwidth_Bps": 12.5e6, "rtt_s": 0.004, "queue_delay_s": 0.0012},
                updated=get_dht_time(),
                weights=a.weights,
            )
            try:
                announce(dht, [record], a.ttl)
            except Exception as exc:  # a slow DHT must not kill the node, as in swarm.node
                print(f"announce {state} failed: {exc!r}", flush=True)

        await trio.to_thread.run_sync(publish, "online")
        print(f"serving blocks {start}:{end} on {addr} (peer {node_id()})", flush=True)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, handle, listeners)

            async def refresh() -> None:
                while True:
                    await trio.sleep(a.ttl / 3)
                    await trio.to_thread.run_sync(publish, "online")

            nursery.start_soon(refresh)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break
            nursery.cancel_scope.cancel()
        await trio.to_thread.run_sync(publish, "offline")

    try:
        trio.run(main)
    finally:
        dht.shutdown()


if __name__ == "__main__":
    if sys.argv[1:2] == ["fake-node"]:
        fake_node_main(sys.argv[2:])
