"""Bad input to a live node gets a typed error, and the node keeps serving its other sessions."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest
import torch
import trio

from swarm.client.client import Client
from swarm.errors import RouteUnavailable
from swarm.protocol import Error, Hop, Open, Opened, Step
from swarm.transport import connect
from swarm.wire import pack_tensor
from tests.conftest import reference_greedy

HIDDEN = 64


@pytest.fixture(scope="module")
def client(tiny_swarm, tiny_model_dir):
    c = Client(tiny_swarm[0].maddrs[:1], model=str(tiny_model_dir), wire_dtype="float32")
    yield c
    c.close()


def first_node(tiny_swarm) -> tuple[str, int]:
    return tiny_swarm[0].host_port


async def expect_error(conn, code: str) -> Error:
    with trio.fail_after(10):
        msg = await conn.receive()
    assert isinstance(msg, Error), msg
    assert msg.code == code, msg
    return msg


def one_hop_open(client: Client, tiny_swarm, sid: str, **overrides) -> Open:
    host, port = first_node(tiny_swarm)
    fields = dict(
        sid=sid,
        route=(Hop(host, port, 0, 2, tiny_swarm[0].peer),),
        hop=0,
        fingerprint=client.fingerprint,
        wire_dtype="float32",
        max_length=32,
        sink_token="t" * 32,
    )
    fields.update(overrides)
    return Open(**fields)


async def test_unknown_session_is_refused(tiny_swarm):
    conn = await connect(*first_node(tiny_swarm), tls=tiny_swarm[0].tls)
    hidden = pack_tensor(torch.zeros(1, 1, HIDDEN), "float32")
    await conn.send(Step(sid="f" * 32, phase="prefill", pos=0, end=1, hidden=hidden))
    err = await expect_error(conn, "session_not_found")
    assert "no session" in err.message
    await conn.aclose()


async def test_wrong_model_fingerprint_is_refused(tiny_swarm, client):
    conn = await connect(*first_node(tiny_swarm), tls=tiny_swarm[0].tls)
    await conn.send(one_hop_open(client, tiny_swarm, "a" * 32, fingerprint="0" * 16))
    err = await expect_error(conn, "fingerprint_mismatch")
    assert "0" * 16 in err.message
    await conn.aclose()


async def test_blocks_outside_the_node_span_are_refused(tiny_swarm, client):
    host, port = first_node(tiny_swarm)
    conn = await connect(host, port, tls=tiny_swarm[0].tls)
    msg = one_hop_open(client, tiny_swarm, "b" * 32, route=(Hop(host, port, 0, 4, ""),))
    await conn.send(msg)
    err = await expect_error(conn, "span")
    assert "0:4" in err.message and "0:2" in err.message
    await conn.aclose()


async def test_wrong_tensor_shape_is_refused_and_the_session_survives(tiny_swarm, client):
    conn = await connect(*first_node(tiny_swarm), tls=tiny_swarm[0].tls)
    await conn.send(one_hop_open(client, tiny_swarm, "c" * 32))
    with trio.fail_after(10):
        assert isinstance(await conn.receive(), Opened)
    bad = pack_tensor(torch.zeros(1, 3, HIDDEN + 1), "float32")
    await conn.send(Step(sid="c" * 32, phase="prefill", pos=0, end=3, hidden=bad))
    err = await expect_error(conn, "shape_mismatch")
    assert str(HIDDEN) in err.message
    nan = torch.zeros(1, 1, HIDDEN)
    nan[0, 0, 3] = float("nan")
    await conn.send(
        Step(sid="c" * 32, phase="prefill", pos=0, end=1, hidden=pack_tensor(nan, "float32"))
    )
    await expect_error(conn, "shape_mismatch")
    # the same session still takes a well-formed step at position 0
    good = pack_tensor(torch.randn(1, 2, HIDDEN), "float32")
    await conn.send(Step(sid="c" * 32, phase="prefill", pos=5, end=7, hidden=good))
    err = await expect_error(conn, "protocol")
    assert "out of order" in err.message
    await conn.aclose()


async def test_oversize_frame_is_refused_before_it_is_read(tiny_swarm):
    conn = await connect(*first_node(tiny_swarm), tls=tiny_swarm[0].tls)
    await conn.stream.send_all(struct.pack(">I", 2**31))
    err = await expect_error(conn, "frame_too_large")
    assert str(2**31) in err.message
    with trio.fail_after(10):
        assert await conn.receive() is None  # the node closes a stream it can no longer frame
    await conn.aclose()


def test_bad_input_on_one_connection_leaves_other_sessions_intact(
    tiny_swarm, client, tiny_reference
):
    ids = [3, 9, 27, 81, 243]
    with client.session(len(ids) + 6) as s:
        logits = s.feed(ids)

        async def garbage():
            conn = await connect(*first_node(tiny_swarm), tls=tiny_swarm[0].tls)
            await conn.send_raw(struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1")
            await expect_error(conn, "protocol")
            await conn.aclose()

        trio.run(garbage)
        out = []
        for _ in range(6):
            out.append(int(logits.argmax()))
            logits = s.feed([out[-1]])
    assert out == reference_greedy(tiny_reference, ids, 6)


def test_no_route_names_the_missing_blocks(tiny_swarm, client):
    with pytest.raises(RouteUnavailable, match=r"blocks 2:4 of tiny"):
        client.route(exclude={tiny_swarm[1].peer})


def test_span_beyond_the_model_is_refused_at_start(tiny_model_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "swarm.node", "--model", str(tiny_model_dir), "--layers", "4:9"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "layers 4:9" in proc.stderr and "0:6" in proc.stderr
