"""A node nobody can dial still serves, through a relay it connects out to; direct stays the
path wherever it works.

On loopback (`--relay always`, and the reachability check itself), then with real network
namespaces: a node whose firewall drops every inbound connection attempt, and one behind a
router namespace doing NAT (MASQUERADE). Each serves blocks 3:6 of a real route whose blocks
0:3 are served by a node in the root namespace (which relays for them); the text equals a direct
route's, and a relayed node killed mid-generation is recovered from as a direct one is.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest
import trio

from devtools.launch import start_node, stop_all
from swarm.address import parse_host_port
from swarm.client.client import Client
from swarm.errors import PeerFailed
from swarm.protocol import Hop, Ping, Pong
from swarm.transport import dial_hop
from swarm.transport_sync import dial_sync
from swarm.wire import DEFAULT_MAX_FRAME
from tests.conftest import reference_greedy
from tests.helpers.flags import exact_flags

FLAGS = exact_flags(ttl=6)
PROMPT = [5, 50, 150, 250, 350, 450]
NEW_TOKENS = 12


def generate(client: Client, exclude: set[str] = frozenset(), on_token=None) -> list[int]:
    """Greedy tokens after PROMPT through the swarm; `on_token(i)` runs after each."""
    out: list[int] = []
    with client.session(len(PROMPT) + NEW_TOKENS) as s:
        s.excluded.update(exclude)
        logits = s.feed(PROMPT)
        for i in range(NEW_TOKENS):
            out.append(int(logits.argmax()))
            if on_token:
                on_token(i)
            logits = s.feed([out[-1]])
    return out


def record_of(client: Client, peer: str, wait_s: float = 20.0):
    """The peer's record as the client reads it; a relayed node's refreshes cross NAT and can
    be late (TTL 6 s here), so a record missing for a moment is read again."""
    deadline = time.monotonic() + wait_s
    while (found := [r for r in client.nodes() if r.peer == peer]) == [] and (
        time.monotonic() < deadline
    ):
        time.sleep(0.5)
    assert found, f"no record of {peer} within {wait_s:g} s"
    return found[0]


# ---- loopback ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loopback(tiny_model_dir):
    first = start_node((0, 3), model=str(tiny_model_dir), extra=FLAGS)
    first.wait_serving()
    peers = first.maddrs[:1]
    checked = start_node((3, 6), peers, model=str(tiny_model_dir), extra=FLAGS)
    relayed = start_node(
        (3, 6), peers, model=str(tiny_model_dir), extra=[*FLAGS, "--relay", "always"]
    )
    nodes = [first, checked, relayed]
    try:
        checked.wait_serving()
        relayed.wait_serving()
    except BaseException:
        stop_all(nodes)
        raise
    client = Client(peers, model=str(tiny_model_dir), wire_dtype="float32")
    yield nodes, client
    client.close()
    stop_all(nodes)


def test_a_node_others_can_dial_says_so_and_serves_directly(loopback):
    (first, checked, _), client = loopback
    log = "\n".join(checked.lines)
    assert f"reachability: direct (node {first.peer[-8:]}" in log
    assert record_of(client, checked.peer).relay == ""
    assert record_of(client, checked.peer).reach == "direct"
    assert record_of(client, first.peer).reach == "unknown"
    assert "reachability: unknown (no other node" in "\n".join(first.lines)


def test_a_relayed_node_announces_its_relay_and_serves_the_same_text(loopback, tiny_reference):
    (first, checked, relayed), client = loopback
    rec = record_of(client, relayed.peer)
    relay = next(n for n in (first, checked) if n.peer == rec.relay)  # either direct node
    assert rec.addr == relay.addr
    assert f"relayed by {relay.peer[-8:]} at {relay.addr}" in "\n".join(relayed.lines)
    want = reference_greedy(tiny_reference, PROMPT, NEW_TOKENS)
    assert generate(client, exclude={checked.peer}) == want


async def test_a_relay_asked_for_a_node_it_does_not_hold_names_it(loopback):
    (first, checked, _), _client = loopback
    # a direct node, asked for at the relay as though it were behind it
    stranger = Hop(*parse_host_port(first.addr), 3, 6, checked.peer, checked.tls, first.peer)
    with pytest.raises(PeerFailed, match="no node .* behind it"):
        await dial_hop(stranger)


async def test_the_relay_sees_only_tls_and_the_node_proves_its_own_key(loopback):
    (_, _, relayed), client = loopback
    conn = await dial_hop(record_of(client, relayed.peer).hop())
    assert conn.encrypted
    await conn.send(Ping(nonce=42))
    with trio.fail_after(10):
        assert await conn.receive() == Pong(nonce=42)
    await conn.aclose()


def test_a_blocking_dial_reaches_a_relayed_node_through_its_relay(loopback):
    """As a borrower's compute thread reaches a lender behind a relay (swarm.transport_sync)."""
    (_, _, relayed), client = loopback
    conn = dial_sync(record_of(client, relayed.peer).hop(), DEFAULT_MAX_FRAME, timeout=10)
    conn.send(Ping(nonce=43), timeout=10)
    assert conn.receive(timeout=10) == Pong(nonce=43)
    conn.close()


# ---- network namespaces -----------------------------------------------------------------------

NETNS = os.geteuid() == 0 and shutil.which("ip") and shutil.which("iptables")
needs_netns = pytest.mark.skipif(
    not NETNS, reason="needs root, ip and iptables (.ci/run installs iproute2 and iptables)"
)


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class Network:
    """Root namespace plus: `fw`, a host whose firewall drops every inbound connection attempt
    (10.N.1.2, next to the root's 10.N.1.1); `router`, doing NAT for `home` (192.168.N.2): the
    root namespace has no route to the home network at all."""

    def __init__(self):
        tag = os.getpid() % 10000
        self.n = 100 + os.getpid() % 100
        self.fw, self.router, self.home = f"swfw{tag}", f"swrt{tag}", f"swhm{tag}"
        self.root_ip = f"10.{self.n}.1.1"
        self.fw_ip = f"10.{self.n}.1.2"
        self.home_ip = f"192.168.{self.n}.2"
        self.links = [f"vf{tag}a", f"vr{tag}a"]

    def up(self) -> None:
        n, fw, rt, hm = self.n, self.fw, self.router, self.home
        for ns in (fw, rt, hm):
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        va, vb = self.links[0], self.links[0][:-1] + "b"
        sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb, "netns", fw)
        sh("ip", "addr", "add", f"{self.root_ip}/24", "dev", va)
        sh("ip", "link", "set", va, "up")
        sh("ip", "-n", fw, "addr", "add", f"{self.fw_ip}/24", "dev", vb)
        sh("ip", "-n", fw, "link", "set", vb, "up")
        sh("ip", "-n", fw, "route", "add", "default", "via", self.root_ip)
        sh("ip", "netns", "exec", fw, "iptables", "-A", "INPUT", "-p", "tcp", "--syn", "-j", "DROP")
        ra, rb = self.links[1], self.links[1][:-1] + "b"
        sh("ip", "link", "add", ra, "type", "veth", "peer", "name", rb, "netns", rt)
        sh("ip", "addr", "add", f"10.{n}.2.1/24", "dev", ra)
        sh("ip", "link", "set", ra, "up")
        sh("ip", "-n", rt, "addr", "add", f"10.{n}.2.2/24", "dev", rb)
        sh("ip", "-n", rt, "link", "set", rb, "up")
        sh("ip", "-n", rt, "route", "add", "default", "via", f"10.{n}.2.1")
        ha, hb = f"{ra[:-1]}h", f"{ra[:-1]}i"
        sh("ip", "-n", rt, "link", "add", ha, "type", "veth", "peer", "name", hb, "netns", hm)
        sh("ip", "-n", rt, "addr", "add", f"192.168.{n}.1/24", "dev", ha)
        sh("ip", "-n", rt, "link", "set", ha, "up")
        sh("ip", "-n", hm, "addr", "add", f"{self.home_ip}/24", "dev", hb)
        sh("ip", "-n", hm, "link", "set", hb, "up")
        sh("ip", "-n", hm, "route", "add", "default", "via", f"192.168.{n}.1")
        sh("ip", "netns", "exec", rt, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        nat = ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", rb, "-j", "MASQUERADE"]
        sh("ip", "netns", "exec", rt, *nat)

    def down(self) -> None:
        for ns in (self.fw, self.router, self.home):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)

    def node(self, ns: str, ip: str, layers, peers, model: str, *extra: str):
        flags = [*FLAGS, "--host", ip, "--dht-host", ip, *extra]
        prefix = ("ip", "netns", "exec", ns) if ns else ()
        return start_node(layers, peers, model=model, extra=flags, prefix=prefix)


@pytest.fixture(scope="module")
def network():
    net = Network()
    net.down()  # a run killed before its teardown left these behind
    try:
        net.up()
    except subprocess.CalledProcessError as exc:
        net.down()
        pytest.skip(f"cannot build network namespaces here: {exc.stderr.strip()}")
    yield net
    net.down()


@pytest.fixture(scope="module")
def behind(network, tiny_model_dir):
    """A root-namespace node on blocks 0:3 (which relays), one behind the firewall and one
    behind NAT, each on blocks 3:6, all letting the reachability check decide."""
    model = str(tiny_model_dir)
    root = network.node("", network.root_ip, (0, 3), (), model)
    root.wait_serving()
    peers = [m for m in root.maddrs if network.root_ip in m][:1]
    fw = network.node(network.fw, network.fw_ip, (3, 6), peers, model)
    home = network.node(network.home, network.home_ip, (3, 6), peers, model)
    nodes = [root, fw, home]
    try:
        fw.wait_serving()
        home.wait_serving()
    except BaseException:
        stop_all(nodes)
        raise
    client = Client(peers, model=model, wire_dtype="float32")
    yield root, fw, home, client
    client.close()
    stop_all(nodes)


@needs_netns
def test_a_node_behind_a_firewall_is_relayed_and_serves_the_same_text(behind, tiny_reference):
    root, fw, home, client = behind
    log = "\n".join(fw.lines)
    assert "reachability: others cannot dial" in log, log
    assert record_of(client, fw.peer).relay == root.peer
    assert record_of(client, fw.peer).reach == "relayed"
    assert generate(client, exclude={home.peer}) == reference_greedy(
        tiny_reference, PROMPT, NEW_TOKENS
    )


@needs_netns
def test_a_node_behind_nat_is_relayed_and_serves_the_same_text(behind, tiny_reference):
    root, fw, home, client = behind
    log = "\n".join(home.lines)
    assert "reachability: others cannot dial" in log, log
    assert record_of(client, home.peer).relay == root.peer
    assert generate(client, exclude={fw.peer}) == reference_greedy(
        tiny_reference, PROMPT, NEW_TOKENS
    )


@needs_netns
def test_a_relayed_node_killed_mid_generation_is_recovered_from(behind, tiny_reference):
    """The session runs through the NATed node; it dies (SIGKILL) after a few tokens; the
    client replays onto the firewalled one and the text is unchanged."""
    root, fw, home, client = behind
    killed_at = 4

    def kill(i: int) -> None:
        if i == killed_at:
            os.killpg(home.pid, signal.SIGKILL)
            time.sleep(0.2)

    want = reference_greedy(tiny_reference, PROMPT, NEW_TOKENS)
    with client.session(len(PROMPT) + NEW_TOKENS) as s:
        s.excluded.add(fw.peer)  # start on the NATed node...
        logits = s.feed(PROMPT)
        assert home.peer in {h.peer for h in s.remote.route}
        s.excluded.discard(fw.peer)  # ...and let the failover find the other one
        out = []
        for i in range(NEW_TOKENS):
            out.append(int(logits.argmax()))
            kill(i)
            logits = s.feed([out[-1]])
        assert fw.peer in {h.peer for h in s.remote.route}
        assert s.recoveries, "no failover happened"
    assert out == want
