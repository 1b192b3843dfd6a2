"""Sessions a node hands over count on the replica in their users' shares, not in the sending
node's own address's (swarm/node/admission.py), and as their owners' own once claimed: users on
127.0.0.2, 127.0.0.3, ... each hold a session on a node that leaves, towards a replica that
takes 2 sessions an address."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch
import trio

from devtools.launch import NodeProcess, stop_all
from swarm.model.source import open_model
from swarm.node.admission import share_of
from swarm.node.config import Limits
from swarm.node.handover.receive import claim, release
from swarm.node.session import Session
from swarm.node.session_state import Install
from swarm.protocol import PREFILL, Attach, Attached, Hop, Open, Opened, Result, Resume, Step
from swarm.tls import dial
from swarm.transport import FramedStream
from swarm.wire import pack_tensor
from tests.helpers.handover import left_with, start_full_node, wait_for_lines

USERS = [f"127.0.0.{i}" for i in range(2, 6)]  # 4 sessions: twice one address's share
PROMPT = 7


async def expect(conn: FramedStream, kind: type):
    with trio.fail_after(30):
        msg = await conn.receive()
    assert isinstance(msg, kind), msg
    return msg


async def session_from(user: str, node: NodeProcess, model_dir) -> FramedStream:
    """A one-hop session opened from loopback address `user`, its prompt computed: the
    connection that holds it (owner and sink)."""
    model = open_model(str(model_dir))
    stream = await trio.open_tcp_stream(node.hop().host, node.hop().port, local_address=user)
    conn = FramedStream(await dial(stream, node.tls, node.addr))
    sid, token = os.urandom(16).hex(), os.urandom(16).hex()
    await conn.send(
        Open(
            sid=sid,
            route=(node.hop(),),
            hop=0,
            fingerprint=model.fingerprint(),
            wire_dtype="float32",
            max_length=32,
            sink_token=token,
        )
    )
    await expect(conn, Opened)
    await conn.send(Attach(sid=sid, sink_token=token))
    await expect(conn, Attached)
    hidden = torch.randn(1, PROMPT, model.config.hidden)
    await conn.send(
        Step(sid=sid, phase=PREFILL, pos=0, end=PROMPT, hidden=pack_tensor(hidden, "float32"))
    )
    await expect(conn, Result)
    return conn


@pytest.mark.slow
def test_a_drain_past_one_addresss_share_hands_every_users_session_over(
    dht_peers,  # noqa: F811
    tiny_model_dir,
):
    leaving = start_full_node(tiny_model_dir, dht_peers, "--grace", "20")
    replica = None
    try:

        async def main() -> None:
            nonlocal replica
            conns = [await session_from(user, leaving, tiny_model_dir) for user in USERS]
            try:
                replica = await trio.to_thread.run_sync(
                    lambda: start_full_node(tiny_model_dir, dht_peers, "--max-host-sessions", "2")
                )
                leaving.proc.send_signal(signal.SIGTERM)
                await trio.to_thread.run_sync(wait_for_lines, leaving, "handed over to", len(USERS))
            finally:
                for conn in conns:
                    await conn.aclose()

        trio.run(main)
        refused = [line for line in leaving.lines if "cannot hand" in line or "refused" in line]
        assert refused == []
        assert left_with(replica)[1] == len(USERS)  # all moved in
    finally:
        stop_all([leaving] + ([replica] if replica else []))


class Peer:
    """A connection as admission sees it: its peer's address."""

    def __init__(self, host: str):
        self.socket = SimpleNamespace(getpeername=lambda: (host, 40000))


def test_a_handed_over_session_counts_as_forwarded_then_as_its_owners_once_claimed():
    sender, client = Peer("127.0.0.1"), Peer("127.0.0.9")
    token = "t" * 32
    opening = Open(
        sid="s" * 32,
        route=(Hop("127.0.0.3", 31337, 0, 6),),
        hop=0,
        fingerprint="f",
        wire_dtype="float32",
        max_length=16,
        sink_token=token,
        origin="127.0.0.9",  # the user's host, as the sender saw it
    )
    config = SimpleNamespace(wire_dtype="float32", limits=Limits())
    ctx = SimpleNamespace(config=config, span=SimpleNamespace(config=config))
    share = share_of("127.0.0.1", opening, handed=True)
    s = Session(ctx, sender, opening, 0.0, share, coming=True)
    assert (s.host, s.via, s.origin) == ("127.0.0.9 via 127.0.0.1", "127.0.0.1", "127.0.0.9")
    s.intake = object()  # its cache came and was checked
    s.moved(Install())
    claim(s, client, Resume(sid=opening.sid, sink_token=token, owner=True, sink=False))
    release(s, sender)  # the sender's last steps are in: the client owns it now
    assert s.owner is client
    assert (s.host, s.via, s.origin) == ("127.0.0.9", "", "127.0.0.9")
