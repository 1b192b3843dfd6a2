"""A lender of KV blocks (swarm.node.lender): what it holds is bounded and belongs to the
connection that lent it; bad or forged lend messages get typed errors, and what else it holds
goes on being served. The bounds on the table itself, then a live node (the shared tiny swarm,
TLS)."""

from __future__ import annotations

import pytest
import torch
import trio

from swarm.errors import BlocksNotHeld, LendRefused, ProtocolError, ShapeMismatch
from swarm.model.partial_attention import partial_attention
from swarm.node.lender import LendTable
from swarm.protocol import AttendLent, Error, Lend, Lent, LentPartial, parse_message, to_wire
from swarm.transport import connect
from swarm.wire import pack_tensor, unpack_tensor

KV_HEADS, HEAD_DIM, HEADS = 2, 16, 4
WIDTH = KV_HEADS * HEAD_DIM


def lend(sid: str = "s" * 16, layer: int = 0, pos: int = 0, n: int = 16, seed: int = 0) -> Lend:
    g = torch.Generator().manual_seed(seed)
    k, v = (pack_tensor(torch.randn(1, n, WIDTH, generator=g), "float32") for _ in range(2))
    return Lend(sid, layer, pos, KV_HEADS, HEAD_DIM, k, v)


def ask(sid: str = "s" * 16, layer: int = 0, upto: int = 16, rows: int = 1) -> AttendLent:
    q = pack_tensor(torch.randn(1, rows, HEADS * HEAD_DIM), "float32")
    return AttendLent(sid=sid, layer=layer, upto=upto, heads=HEADS, scale=0.25, q=q)


BLOCK_BYTES = 2 * 16 * WIDTH * 4  # keys and values of one 16-position lend, float32


def test_a_lend_over_the_borrowers_share_is_refused_and_nothing_kept():
    table = LendTable(max_bytes=10 * BLOCK_BYTES, max_host_bytes=2 * BLOCK_BYTES)
    table.lend("conn", "10.0.0.1", lend(pos=0))
    table.lend("conn", "10.0.0.1", lend(pos=16))
    with pytest.raises(LendRefused, match="share"):
        table.lend("conn", "10.0.0.1", lend(pos=32))
    assert table.lent_bytes == 2 * BLOCK_BYTES
    table.lend("other", "10.0.0.2", lend())  # another borrower still has its share


def test_a_lend_over_the_lenders_memory_is_refused():
    table = LendTable(max_bytes=BLOCK_BYTES, max_host_bytes=BLOCK_BYTES)
    table.lend("a", "10.0.0.1", lend())
    with pytest.raises(LendRefused, match="free to lend"):
        table.lend("b", "10.0.0.2", lend())


def test_what_a_connection_lent_goes_with_it():
    table = LendTable(max_bytes=10 * BLOCK_BYTES, max_host_bytes=10 * BLOCK_BYTES)
    table.lend("conn", "h", lend())
    table.forget("conn")
    assert table.lent_bytes == 0
    with pytest.raises(BlocksNotHeld):
        table.query("conn", ask())


def test_a_query_naming_more_positions_than_lent_is_refused():
    table = LendTable(max_bytes=10 * BLOCK_BYTES, max_host_bytes=10 * BLOCK_BYTES)
    table.lend("conn", "h", lend())
    with pytest.raises(BlocksNotHeld, match="holds 16 positions .* names 32"):
        table.query("conn", ask(upto=32))


def test_query_heads_that_do_not_group_over_the_key_heads_are_refused():
    table = LendTable(max_bytes=10 * BLOCK_BYTES, max_host_bytes=10 * BLOCK_BYTES)
    table.lend("conn", "h", lend())
    odd = AttendLent(sid="s" * 16, layer=0, upto=16, heads=3, scale=0.25, q=None)
    with pytest.raises(ShapeMismatch, match="do not group"):
        table.query("conn", odd)


@pytest.mark.parametrize("scale", [float("nan"), -1.0, True])
def test_an_attend_with_a_bad_scale_is_refused_at_the_edge(scale):
    raw = {**to_wire(ask()), "scale": scale}
    with pytest.raises(ProtocolError, match="scale"):
        parse_message(raw)


# ---- a live node -----------------------------------------------------------------------------


async def _reply(conn, kind=None):
    with trio.fail_after(10):
        msg = await conn.receive()
    if kind is not None:
        assert isinstance(msg, kind), msg
    return msg


async def _error(conn, msg, code: str) -> None:
    await conn.send(msg)
    reply = await _reply(conn, Error)
    assert reply.code == code, reply


async def _dial(tiny_swarm):
    return await connect(*tiny_swarm[0].host_port, tls=tiny_swarm[0].tls)


async def test_a_query_for_blocks_never_lent_gets_blocks_not_held(tiny_swarm):
    conn = await _dial(tiny_swarm)
    await _error(conn, ask(), "blocks_not_held")
    await conn.aclose()


async def test_another_connection_cannot_read_what_one_lent(tiny_swarm):
    owner, forger = await _dial(tiny_swarm), await _dial(tiny_swarm)
    await owner.send(lend())
    await _reply(owner, Lent)
    await _error(forger, ask(), "blocks_not_held")  # the same sid, forged
    await _error(forger, lend(pos=16), "protocol")  # nor extend it
    await owner.aclose()
    await forger.aclose()


async def test_bad_lends_get_typed_errors_and_the_good_loan_is_still_served(tiny_swarm):
    conn = await _dial(tiny_swarm)
    good = lend(n=20, seed=3)
    await conn.send(good)
    assert (await _reply(conn, Lent)).length == 20
    await _error(conn, lend(pos=5), "protocol")  # out of order
    short = {**good.keys, "data": good.keys["data"][:-4]}
    await _error(
        conn, Lend("t" * 16, 0, 0, KV_HEADS, HEAD_DIM, short, good.values), "shape_mismatch"
    )
    nan = pack_tensor(torch.full((1, 4, WIDTH), float("nan")), "float32")
    await _error(conn, Lend("t" * 16, 0, 0, KV_HEADS, HEAD_DIM, nan, nan), "shape_mismatch")
    await _error(conn, ask(upto=21), "blocks_not_held")
    query = ask(upto=20, rows=3)
    await conn.send(query)
    reply = await _reply(conn, LentPartial)
    keys, values = (
        unpack_tensor(t, hidden=WIDTH, max_tokens=20)[0]
        .view(20, KV_HEADS, HEAD_DIM)
        .transpose(0, 1)
        for t in (good.keys, good.values)
    )
    q = unpack_tensor(query.q, hidden=HEADS * HEAD_DIM, max_tokens=3)[0].view(3, HEADS, HEAD_DIM)
    want, lse = partial_attention(q, keys, values, 0.25)
    out = unpack_tensor(reply.out, hidden=HEADS * HEAD_DIM, max_tokens=3)[0]
    torch.testing.assert_close(out.view(3, HEADS, HEAD_DIM), want, rtol=0, atol=1e-6)
    await conn.aclose()
