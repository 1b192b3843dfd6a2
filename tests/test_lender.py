"""A lender of KV blocks (swarm.node.lender): what it holds is bounded and belongs to the
connection that lent it; bad or forged lend messages get typed errors, and what else it holds
goes on being served. The bounds on the table itself, then a live node (the shared tiny swarm,
TLS)."""

from __future__ import annotations

import pytest
import torch
import trio

from swarm.errors import BlocksNotHeld, LendRefused, ProtocolError, ShapeMismatch
from swarm.lending import AttendLent, Lend, LendLeaving, Lent, LentPartial, Reclaim
from swarm.model.partial_attention import partial_attention
from swarm.node.lender import LendTable
from swarm.protocol import Error, KvChunk, parse_message, to_wire
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


# ---- a lender leaving ------------------------------------------------------------------------


def test_a_leaving_lender_refuses_new_loans_and_still_takes_the_rest_of_those_it_holds():
    table = LendTable(max_bytes=10 * BLOCK_BYTES, max_host_bytes=10 * BLOCK_BYTES)
    table.lend("conn", "h", lend())
    assert table.leave() == [("conn", "s" * 16)]
    with pytest.raises(LendRefused, match="leaving"):
        table.lend("conn", "h", lend(sid="t" * 16))
    assert table.lend("conn", "h", lend(pos=16)).length == 32  # its borrower has yet to move


def test_what_a_connection_lent_comes_back_in_order_in_chunks_of_the_frame_size():
    table = LendTable(max_bytes=10 * BLOCK_BYTES, max_host_bytes=10 * BLOCK_BYTES)
    sent = [lend(layer=layer, n=20, seed=layer) for layer in (3, 1)]
    for frame in sent:
        table.lend("conn", "h", frame)
    per_position = 2 * WIDTH * 4
    chunks = list(table.reclaim("conn", Reclaim("s" * 16), 8 * per_position))
    assert [(c.layer, c.pos) for c in chunks] == [(1, 0), (1, 8), (1, 16), (3, 0), (3, 8), (3, 16)]
    for frame in sent:
        mine = [c for c in chunks if c.layer == frame.layer]
        for part in ("keys", "values"):
            back = torch.cat(
                [unpack_tensor(getattr(c, part), hidden=WIDTH, max_tokens=20) for c in mine], 1
            )
            want = unpack_tensor(getattr(frame, part), hidden=WIDTH, max_tokens=20)
            assert torch.equal(back, want)


def test_a_loan_asked_back_counts_as_handed_on_once_its_connection_ends():
    table = LendTable(max_bytes=10 * BLOCK_BYTES, max_host_bytes=10 * BLOCK_BYTES)
    table.lend("moved", "h", lend())
    table.lend("stayed", "h", lend())
    list(table.reclaim("moved", Reclaim("s" * 16), 1 << 20))
    table.forget("moved")
    table.forget("stayed")
    assert table.handed_on == 1


def test_asking_back_what_this_connection_never_lent_is_refused():
    table = LendTable(max_bytes=10 * BLOCK_BYTES, max_host_bytes=10 * BLOCK_BYTES)
    table.lend("owner", "h", lend())
    with pytest.raises(BlocksNotHeld, match="lent nothing"):
        table.reclaim("forger", Reclaim("s" * 16), 1 << 20)


async def test_a_forged_reclaim_gets_blocks_not_held_and_a_leaving_notice_to_a_node_protocol(
    tiny_swarm,
):
    owner, forger = await _dial(tiny_swarm), await _dial(tiny_swarm)
    await owner.send(lend())
    await _reply(owner, Lent)
    await _error(forger, Reclaim("s" * 16), "blocks_not_held")  # the owner's sid, forged
    await _error(forger, LendLeaving("s" * 16), "protocol")  # a lender's notice, sent upstream
    await owner.send(Reclaim("s" * 16))  # the owner still gets its blocks back
    assert (await _reply(owner, KvChunk)).layer == 0
    await owner.aclose()
    await forger.aclose()
