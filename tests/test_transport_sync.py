"""A blocking connection to a node (swarm.transport_sync: a borrower's compute thread to its
lender) is the trio one's twin: TLS with the key the node's record names, and a node's
plaintext refusal read as its typed error."""

from __future__ import annotations

import socket
import threading

import pytest

from swarm.errors import NodeBusy, WrongPeer
from swarm.protocol import Error, Hop, Ping, Pong, to_wire
from swarm.transport_sync import dial_sync
from swarm.wire import DEFAULT_MAX_FRAME, encode_frame


def test_a_blocking_dial_talks_tls_to_the_node_its_record_names(tiny_swarm):
    conn = dial_sync(tiny_swarm[0].hop(), DEFAULT_MAX_FRAME, timeout=10)
    conn.send(Ping(nonce=7), timeout=10)
    assert conn.receive(timeout=10) == Pong(nonce=7)
    conn.close()


def test_a_blocking_dial_expecting_another_nodes_key_is_refused_as_wrong_peer(tiny_swarm):
    node, other = tiny_swarm[0].hop(), tiny_swarm[1].hop()
    impostor = Hop(node.host, node.port, node.start, node.end, other.peer, other.tls)
    with pytest.raises(WrongPeer, match="not the node its record names"):
        dial_sync(impostor, DEFAULT_MAX_FRAME, timeout=10)


def test_a_nodes_plaintext_refusal_before_tls_is_raised_as_its_error():
    """A full node answers a connection with an error frame, not a handshake."""
    listener = socket.create_server(("127.0.0.1", 0))
    refusal = encode_frame(to_wire(Error.of(NodeBusy("this node holds 3 connections from you"))))

    def refuse() -> None:
        conn, _ = listener.accept()
        conn.sendall(refusal)
        conn.close()

    thread = threading.Thread(target=refuse)
    thread.start()
    hop = Hop("127.0.0.1", listener.getsockname()[1], 0, 1, "p" * 16, "k" * 64)
    try:
        with pytest.raises(NodeBusy, match="3 connections from you"):
            dial_sync(hop, DEFAULT_MAX_FRAME, timeout=10)
    finally:
        thread.join()
        listener.close()
