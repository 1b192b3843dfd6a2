"""The route's last node picks a reply's tokens: the same tokens as the client picking them from
the logits, greedy or sampled under a seed, plain or speculative, several sessions in one
decode pass; a client whose route picks loads no head; bad picking fields and results are
typed errors."""

from __future__ import annotations

import threading

import pytest

from devtools.launch import start_swarm, stop_all
from swarm.client.client import Client
from swarm.client.session import RemoteSession
from swarm.errors import ProtocolError
from swarm.protocol import Hop, Open, Picking, Result, parse_message, to_wire

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Repeat after me: the quick brown fox jumps over it."}]
NEW = 24


@pytest.fixture(scope="module")
def clients():
    """(a client whose routes' last node picks, one that picks itself) of one 2-node swarm."""
    nodes = start_swarm([(0, 15), (15, 30)], extra=["--threads", "1"])
    picked = Client(nodes[0].maddrs[:1])
    itself = Client(nodes[0].maddrs[:1], last_hop_picks=False)
    yield picked, itself
    picked.close()
    itself.close()
    stop_all(nodes)


def reply(client: Client, prompt=PROMPT, **kwargs) -> list[int]:
    stream = client.stream(prompt, max_new_tokens=NEW, **kwargs)
    for _ in stream:
        pass
    return stream.tokens


@pytest.mark.parametrize("speculative", ["off", "lookup"])
@pytest.mark.parametrize(
    "sampling", [{}, {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 11}]
)
def test_the_last_hop_picks_the_tokens_the_client_would(clients, speculative, sampling):
    picked, itself = clients
    want = reply(itself, speculative=speculative, **sampling)
    assert reply(picked, speculative=speculative, **sampling) == want
    assert len(want) > 8


def test_a_client_whose_last_hop_picks_loads_no_head(clients):
    picked, _ = clients
    reply(picked, speculative="off")
    assert picked._heads == {}  # the first hop embeds, the last one picks


def test_replies_picked_in_one_decode_pass_are_each_their_own(clients):
    picked, itself = clients
    prompts = [[{"role": "user", "content": f"Count from {n} to {n + 9}."}] for n in (1, 20, 300)]
    want = [
        reply(itself, p, speculative="off", temperature=0.7, seed=n) for n, p in enumerate(prompts)
    ]
    got: list = [None] * len(prompts)

    def run(i: int) -> None:
        got[i] = reply(picked, prompts[i], speculative="off", temperature=0.7, seed=i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def open_with(picking: list) -> dict:
    msg = Open("s", (Hop("h", 1, 0, 30),), 0, "f", "", 8, "t", picking=Picking(0.0, 1.0, 0, 1))
    wire = to_wire(msg)
    wire["picking"] = picking
    return wire


@pytest.mark.parametrize(
    "picking",
    [[-1.0, 1.0, 0, 1], [0.5, 0.0, 0, 1], [0.5, 1.5, 0, 1], [1, 1.0, 0, 1], [0.5, 1.0, -2, 1],
     [0.5, 1.0, 0, 2**64], [float("nan"), 1.0, 0, 1], [0.5, 1.0]],
)  # fmt: skip
def test_a_bad_picking_field_is_a_protocol_error(picking):
    with pytest.raises(ProtocolError):
        parse_message(open_with(picking))


def test_a_good_picking_field_reads_back():
    assert parse_message(open_with([0.5, 0.9, 40, 2**63])).picking == Picking(0.5, 0.9, 40, 2**63)


def test_a_result_with_picks_not_due_blames_the_last_hop():
    route = [Hop("a", 1, 0, 15, peer="p0"), Hop("b", 2, 15, 30, peer="p1")]
    session = RemoteSession(route, "f", 576, 64, picking=Picking(0.0, 1.0, 0, 1))
    with pytest.raises(ProtocolError) as err:
        session._picks(Result("s", 5, None, None, (1, 2)), 1)
    assert err.value.hop == 1 and err.value.peer == "p1"
    unasked = RemoteSession(route, "f", 576, 64)
    with pytest.raises(ProtocolError):
        unasked._picks(Result("s", 5, None, None, (1,)), 1)
    assert session._picks(Result("s", 5, None, None, (3, 4)), 2) == (3, 4)
