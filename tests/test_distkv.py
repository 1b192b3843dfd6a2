"""Sessions longer than a node's cache (issue #52, DistKV): the hop keeps the newest positions,
lends the oldest blocks to another node, and merges that node's attention with its own; the
tokens are the unsplit model's. Real DHT, node processes, TLS."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import trio

from devtools.launch import start_node, start_swarm, stop_all
from swarm.client.client import Client
from swarm.dht import read_lenders
from swarm.node.config import parse_args
from swarm.node.directory import REFRESH_S
from swarm.protocol import Error, Open
from swarm.transport import connect
from tests.conftest import reference_greedy
from tests.helpers.flags import exact_flags
from tests.helpers.relay import free_port, shaped_relay

PROMPT = [(7 * i + 3) % 500 + 5 for i in range(40)]
NEW = 40  # 80 tokens in all: more than any node's cache
SHORT = ["--max-cache-tokens", "64"]
ROUTE_TTL = 9  # s: records (and what they say a node could borrow) come every 3 s
CAPPED = 48  # tokens a session: one_can_borrow's second node, below its cache of 64


@pytest.fixture(scope="module")
def short_swarm(tiny_model_dir):
    """Two nodes, blocks 0:3 and 3:6, each with a cache of 64 tokens: each lends to the other."""
    nodes = start_swarm(
        [(0, 3), (3, 6)], model=str(tiny_model_dir), extra=[*exact_flags(ttl=20), *SHORT]
    )
    yield nodes
    stop_all(nodes)


def _client(nodes, path, **kw) -> Client:
    return Client(nodes[0].maddrs[:1], model=str(path), wire_dtype="float32", **kw)


def _generate(client: Client, fault=None, at: int = 10, new: int = NEW):
    out = []
    with client.session(len(PROMPT) + new) as s:
        logits = s.feed(PROMPT)
        for i in range(new):
            if i == at and fault is not None:
                fault(s)
            out.append(int(logits.argmax()))
            logits = s.feed([out[-1]])
        return out, s.recoveries, len(s.remote.route)


def test_a_session_longer_than_every_nodes_cache_gives_the_unsplit_tokens(
    short_swarm, tiny_model_dir, tiny_reference
):
    client = _client(short_swarm, tiny_model_dir)
    try:
        out, recoveries, hops = _generate(client)
    finally:
        client.close()
    assert out == reference_greedy(tiny_reference, PROMPT, NEW)
    assert not recoveries and hops == 2  # both hops borrowed


def test_records_say_what_a_node_lends_and_how_many_of_its_sessions_borrow(
    short_swarm, tiny_model_dir
):
    client = _client(short_swarm, tiny_model_dir)
    try:
        with client.session(len(PROMPT) + NEW) as s:
            s.feed(PROMPT)  # 40 positions: each hop keeps 32, lends 16 to the other node
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                records = client.nodes()
                if all(r.borrowing == 1 and r.lent_mb > 0 for r in records):
                    break
                time.sleep(1)
    finally:
        client.close()
    assert [(r.borrowing, r.lent_mb > 0) for r in records] == [(1, True), (1, True)]


@pytest.fixture(scope="module")
def lending_swarm(tiny_model_dir):
    """Two nodes serving every block with a cache of 64 tokens each, and a `--role cache` node:
    a long session's lender is the cache node or the other serving node."""
    nodes = start_swarm(
        [(0, 6), (0, 6)], model=str(tiny_model_dir), extra=[*exact_flags(ttl=20), *SHORT]
    )
    extra = [*exact_flags(ttl=20), "--role", "cache"]
    cache = start_node(None, nodes[0].maddrs[:1], model=str(tiny_model_dir), extra=extra)
    nodes.append(cache)
    try:
        cache.wait_serving()
    except BaseException:
        stop_all(nodes)
        raise
    yield nodes
    stop_all(nodes)


@pytest.fixture
def lone_borrower(tiny_model_dir):
    """One node serving every block with a cache of 64 tokens, and a `--role cache` node."""
    nodes = start_swarm([(0, 6)], model=str(tiny_model_dir), extra=[*exact_flags(ttl=20), *SHORT])
    extra = [*exact_flags(ttl=20), "--role", "cache"]
    nodes.append(start_node(None, nodes[0].maddrs[:1], model=str(tiny_model_dir), extra=extra))
    try:
        nodes[-1].wait_serving()
    except BaseException:
        stop_all(nodes)
        raise
    yield nodes
    stop_all(nodes)


def test_a_borrowing_session_waiting_on_its_lender_holds_no_other_sessions_steps(
    lone_borrower, tiny_model_dir, tiny_reference
):
    cache = lone_borrower[-1]
    client = _client(lone_borrower, tiny_model_dir)
    stalled: dict = {}
    try:
        with client.session(len(PROMPT) + NEW) as long:
            token = int(long.feed(PROMPT).argmax())  # 40 positions: 32 kept, 16 lent
            os.kill(cache.proc.pid, signal.SIGSTOP)  # the lender answers nothing now
            try:
                waiting = threading.Thread(
                    target=lambda: stalled.setdefault("logits", long.feed([token]))
                )
                waiting.start()
                time.sleep(0.5)  # its step is in, each layer waiting on the lender
                started = time.monotonic()
                short = PROMPT[:8]
                with client.session(len(short) + 4) as other:
                    logits = other.feed(short)
                    for _ in range(3):
                        logits = other.feed([int(logits.argmax())])
                other_s = time.monotonic() - started
                pending = waiting.is_alive()
            finally:
                os.kill(cache.proc.pid, signal.SIGCONT)
            waiting.join(60)
    finally:
        client.close()
    assert pending and other_s < 10  # the other session's steps went on meanwhile
    reference = reference_greedy(tiny_reference, PROMPT, 2)
    assert [token, int(stalled["logits"].argmax())] == reference  # and the long one, after


# the next test kills the lending swarm's cache node: this one runs first
def test_a_cache_node_serves_no_blocks_and_announces_itself_as_a_lender(
    lending_swarm, tiny_model_dir
):
    cache = lending_swarm[-1]
    client = _client(lending_swarm, tiny_model_dir)
    try:
        serving = {r.peer for r in client.nodes()}
        lenders = read_lenders(client.dht, client.config.name)
    finally:
        client.close()
    assert cache.layers == (0, 0) and cache.peer not in serving
    assert [(r.peer, r.role) for r in lenders] == [(cache.peer, "cache")]
    assert lenders[0].free_cache_tokens > 0


def test_a_lender_killed_mid_session_replays_to_the_same_tokens(
    lending_swarm, tiny_model_dir, tiny_reference
):
    client = _client(lending_swarm, tiny_model_dir, step_timeout=5.0)

    def kill_the_lender(_session) -> None:
        by_peer = {n.peer: n for n in lending_swarm}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # records say what each node lends (every ttl/3)
            records = client.nodes() + read_lenders(client.dht, client.config.name)
            if lending := [r.peer for r in records if r.lent_mb > 0]:
                by_peer[lending[0]].proc.kill()
                return
            time.sleep(0.5)
        raise AssertionError("no node says it lends")

    try:
        out, recoveries, _ = _generate(client, fault=kill_the_lender)
    finally:
        client.close()
    assert out == reference_greedy(tiny_reference, PROMPT, NEW)
    assert len(recoveries) == 1  # the lender held the session's oldest blocks


def test_a_lender_killed_under_the_only_serving_node_replays_there_to_the_same_tokens(
    lone_borrower, tiny_model_dir, tiny_reference
):
    """The node that borrowed is sound: the replay goes through it again, borrowing anew."""
    cache = lone_borrower[-1]
    extra = [*exact_flags(ttl=20), "--role", "cache"]

    def another_lender_then_kill(_session):
        spare = start_node(None, cache.maddrs[:1], model=str(tiny_model_dir), extra=extra)
        lone_borrower.append(spare)  # stopped with the rest
        spare.wait_serving()
        cache.proc.kill()

    client = _client(lone_borrower, tiny_model_dir, step_timeout=5.0)
    try:
        out, recoveries, _ = _generate(client, fault=another_lender_then_kill)
    finally:
        client.close()
    assert out == reference_greedy(tiny_reference, PROMPT, NEW)
    assert len(recoveries) == 1


def test_a_session_borrows_from_the_lender_with_the_shorter_round_trip(
    tiny_model_dir, tiny_reference, tmp_path
):
    """Of two lenders, the one 30 ms away announces more free memory; the near one lends."""
    out, recoveries, lends, far = _borrow_beside(tiny_model_dir, tmp_path)
    assert out == reference_greedy(tiny_reference, PROMPT, NEW) and recoveries == []
    assert lends and not any(far in line for line in lends)


def test_a_session_borrows_from_a_farther_lender_with_room_for_all_it_lends(
    tiny_model_dir, tiny_reference, tmp_path
):
    """The near lender offers 0.03 MB: its first 16 positions (24 KB), not the 64 the session
    lends at most; it would refuse the next ones and the session would replay."""
    out, recoveries, lends, far = _borrow_beside(tiny_model_dir, tmp_path, near_mb="0.03")
    assert out == reference_greedy(tiny_reference, PROMPT, NEW) and recoveries == []
    assert lends and all(far in line for line in lends)


def _borrow_beside(tiny_model_dir, tmp_path, near_mb: str = "256"):
    """A long session through a node beside two cache lenders: one 30 ms away (a shaped relay)
    with more memory to lend, one on loopback lending `near_mb`. (tokens, recoveries, the
    borrower's log lines naming where it lent, the far lender's address)."""
    port = free_port()
    log_path = tmp_path / "borrower.stderr"
    with open(log_path, "w") as log:
        flags = [*exact_flags(ttl=20), *SHORT]
        nodes = [start_node((0, 6), model=str(tiny_model_dir), extra=flags, stderr=log)]
    with shaped_relay(port, rate_mbps=100, delay_ms=15) as public:
        out, recoveries = _lend_at(nodes, tiny_model_dir, port, public, near_mb)
    lends = [line for line in log_path.read_text().splitlines() if "lends its oldest" in line]
    return out, recoveries, lends, f"127.0.0.1:{public}"


def _lend_at(nodes, tiny_model_dir, port: int, public: int, near_mb: str):
    cache = [*exact_flags(ttl=20), "--role", "cache"]
    try:
        nodes[0].wait_serving()  # its address, which the lenders join by, comes with it
        peers, model = nodes[0].maddrs[:1], str(tiny_model_dir)
        far = [*cache, "--max-lend", "512", "--port", str(port)]
        far += ["--public-address", f"127.0.0.1:{public}"]
        nodes.append(start_node(None, peers, model=model, extra=far))
        nodes.append(start_node(None, peers, model=model, extra=[*cache, "--max-lend", near_mb]))
        for n in nodes[1:]:
            n.wait_serving()
        client = _client(nodes, tiny_model_dir)
        try:
            deadline = time.monotonic() + 30
            while len(read_lenders(client.dht, client.config.name)) < 2:  # both announced
                seen = [(r.addr, r.role) for r in read_lenders(client.dht, client.config.name)]
                assert time.monotonic() < deadline, f"the lenders never all came: {seen}"
                time.sleep(0.5)
            out, recoveries, _ = _generate(client)
        finally:
            client.close()
    finally:
        stop_all(nodes)
    return out, recoveries


@pytest.fixture(scope="module")
def one_can_borrow(tiny_model_dir):
    """Two nodes serving every block with a cache of 64 tokens each, and a `--role cache` node;
    the second node allows no session longer than CAPPED, below its cache: only the first
    can borrow, or take a session between the two."""
    flags, model = [*exact_flags(ttl=ROUTE_TTL), *SHORT], str(tiny_model_dir)
    nodes = [start_node((0, 6), model=model, extra=flags)]
    try:
        nodes[0].wait_serving()
        peers = nodes[0].maddrs[:1]
        capped = [*flags, "--max-session-tokens", str(CAPPED)]
        nodes.append(start_node((0, 6), peers, model=model, extra=capped))
        cache = [*exact_flags(ttl=ROUTE_TTL), "--role", "cache"]
        nodes.append(start_node(None, peers, model=model, extra=cache))
        for n in nodes[1:]:
            n.wait_serving()
    except BaseException:
        stop_all(nodes)
        raise
    yield nodes
    stop_all(nodes)


def test_a_session_longer_than_every_nodes_cache_goes_first_to_the_node_that_can_borrow_it(
    one_can_borrow, tiny_model_dir, tiny_reference
):
    borrower, capped = one_can_borrow[0].peer, one_can_borrow[1].peer
    length = len(PROMPT) + NEW
    client = _client(one_can_borrow, tiny_model_dir)
    try:
        deadline = time.monotonic() + 30
        while True:  # the borrower's record counts the lender once it has read it
            said = {r.peer: (r.cache_tokens, r.borrow_tokens) for r in client.nodes()}
            if said.get(borrower, (0, 0))[1] >= length and capped in said:
                break
            assert time.monotonic() < deadline, f"no node says it could borrow: {said}"
            time.sleep(0.5)
        routes = {tuple(h.peer for h in client.route(max_length=length)) for _ in range(20)}
        out, recoveries, _ = _generate(client)
    finally:
        client.close()
    assert said[capped] == (64, 0) and said[borrower][0] == 64
    assert routes == {(borrower,)}  # without the figure, half of them went to the other node
    assert out == reference_greedy(tiny_reference, PROMPT, NEW) and recoveries == []


def test_a_session_goes_to_the_node_whose_session_limit_allows_it_though_both_have_the_cache(
    one_can_borrow, tiny_model_dir, tiny_reference
):
    """56 tokens: both nodes' caches hold them, the second allows 48 a session (`cache_full`,
    which ended the session at once before records said so)."""
    allows, capped = one_can_borrow[0].peer, one_can_borrow[1].peer
    new = 16
    client = _client(one_can_borrow, tiny_model_dir)
    try:
        said = _await_records(client, lambda r: {allows, capped} <= r.keys())
        length = len(PROMPT) + new
        routes = {tuple(h.peer for h in client.route(max_length=length)) for _ in range(20)}
        out, recoveries, _ = _generate(client, new=new)
    finally:
        client.close()
    assert said[capped].session_tokens == CAPPED < length <= said[capped].free_cache_tokens
    assert routes == {(allows,)}
    assert out == reference_greedy(tiny_reference, PROMPT, new) and recoveries == []


def _await_records(client: Client, enough, seconds: float = 30) -> dict:
    """The nodes' records by peer, read until `enough` of them holds."""
    deadline = time.monotonic() + seconds
    while True:
        said = {r.peer: r for r in client.nodes()}
        if enough(said):
            return said
        assert time.monotonic() < deadline, f"the records never said so: {said}"
        time.sleep(0.5)


def test_a_session_longer_than_an_addresss_share_borrows_instead_of_being_refused(
    tiny_model_dir, tiny_reference
):
    """As at the defaults, an address's share is a quarter of the cache (here 32 of 128): a
    session of 80 fits the cache but not the share, so it keeps the share here and borrows
    (before, it kept all 80 and was refused for the share, whatever --max-session-tokens)."""
    share = ["--max-cache-tokens", "128", "--max-host-cache-tokens", "32"]
    nodes = start_swarm(
        [(0, 6)], model=str(tiny_model_dir), extra=[*exact_flags(ttl=ROUTE_TTL), *share]
    )
    try:
        extra = [*exact_flags(ttl=ROUTE_TTL), "--role", "cache"]
        nodes.append(start_node(None, nodes[0].maddrs[:1], model=str(tiny_model_dir), extra=extra))
        nodes[-1].wait_serving()
        client = _client(nodes, tiny_model_dir)
        try:
            node = nodes[0].peer
            said = _await_records(client, lambda r: node in r and r[node].borrow_tokens >= 80)
            out, recoveries, _ = _generate(client)
        finally:
            client.close()
    finally:
        stop_all(nodes)
    assert said[node].cache_tokens == 32  # what one session keeps here: longer ones borrow
    assert out == reference_greedy(tiny_reference, PROMPT, NEW) and recoveries == []


def test_a_lender_refusing_later_blocks_replays_through_the_only_serving_node(
    tiny_model_dir, tiny_reference
):
    """The only lender first offers 0.03 MB: the session's first 16 positions (24 KB), not the
    next. Another comes meanwhile; the replay, through the same sound node, borrows there."""
    flags = [*exact_flags(ttl=20), *SHORT]
    nodes = start_swarm([(0, 6)], model=str(tiny_model_dir), extra=flags)
    cache = [*exact_flags(ttl=20), "--role", "cache"]
    peers, model = nodes[0].maddrs[:1], str(tiny_model_dir)
    try:
        nodes.append(start_node(None, peers, model=model, extra=[*cache, "--max-lend", "0.03"]))
        nodes[-1].wait_serving()
        client = _client(nodes, tiny_model_dir)

        def another_lender(_session) -> None:
            nodes.append(start_node(None, peers, model=model, extra=cache))
            nodes[-1].wait_serving()
            deadline = time.monotonic() + 30
            while len(read_lenders(client.dht, client.config.name)) < 2:
                assert time.monotonic() < deadline, "the second lender never came"
                time.sleep(0.5)
            time.sleep(REFRESH_S + 0.5)  # the node's next look for a lender reads it too

        try:
            out, recoveries, _ = _generate(client, fault=another_lender, at=2)
        finally:
            client.close()
    finally:
        stop_all(nodes)
    assert out == reference_greedy(tiny_reference, PROMPT, NEW)
    assert len(recoveries) == 1  # the later lend refused: one replay, the node not left out


def test_a_cache_node_takes_no_layers(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--role", "cache", "--layers", "0:2"])
    assert "--role cache serves no blocks" in capsys.readouterr().err


async def test_a_long_session_with_no_lender_announced_is_refused_naming_both_sizes(
    tiny_model_dir, fingerprint
):
    nodes = start_swarm([(0, 6)], model=str(tiny_model_dir), extra=[*exact_flags(), *SHORT])
    try:
        node = nodes[0]
        conn = await connect(*node.host_port, tls=node.tls)
        route = (node.hop(),)
        await conn.send(Open("a" * 32, route, 0, fingerprint, "float32", 80, "t" * 32))
        with trio.fail_after(30):
            reply = await conn.receive()
        await conn.aclose()
    finally:
        stop_all(nodes)
    assert isinstance(reply, Error) and reply.code == "busy", reply
    assert "80 cache tokens" in reply.message and "the 64 this node keeps" in reply.message
