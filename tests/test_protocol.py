"""The data-plane messages as declared (swarm.protocol over swarm.schema): each class of check a
declaration makes refuses with a ProtocolError, and the bytes on the wire stay as they were."""

from __future__ import annotations

import typing

import pytest

from swarm.errors import ProtocolError
from swarm.protocol import (
    Error,
    Handover,
    Hop,
    Message,
    Open,
    Pong,
    Relay,
    Resume,
    Step,
    parse_message,
    to_wire,
)
from swarm.wire import encode_frame

H1 = Hop("10.0.0.1", 4000, 0, 3)
H2 = Hop("::1", 4001, 3, 6, "peer", "key", "relay")
OPEN = Open("s", (H1,), 0, "fp", "float16", 8, "tok")

# frames as the hand-written encoder before the declarations wrote them (commit 347a19e)
GOLDEN = [
    (
        Open("s", (H1, H2), 1, "fp", "float16", 512, "tok", origin="1.2.3.4", handoff=H2),
        "000000b48aa174a46f70656ea3736964a173a5726f7574659297a831302e302e302e31cd0fa00003a0a0a097"
        "a33a3a31cd0fa10306a470656572a36b6579a572656c6179a3686f7001ab66696e6765727072696e74a26670"
        "aa776972655f6474797065a7666c6f61743136aa6d61785f6c656e677468cd0200aa73696e6b5f746f6b656e"
        "a3746f6ba66f726967696ea7312e322e332e34a768616e646f666697a33a3a31cd0fa10306a470656572a36b"
        "6579a572656c6179",
    ),
    (
        Handover(OPEN, 4),
        "0000009084a174a868616e646f766572a46f70656e89a174a46f70656ea3736964a173a5726f757465919"
        "7a831302e302e302e31cd0fa00003a0a0a0a3686f7000ab66696e6765727072696e74a26670aa776972655f"
        "6474797065a7666c6f61743136aa6d61785f6c656e67746808aa73696e6b5f746f6b656ea3746f6ba66f7269"
        "67696ea0a66c656e67746804a470656572a0",
    ),
    (
        Step("s", "decode", 5, 6, None),
        "0000002d86a174a473746570a3736964a173a57068617365a66465636f6465a3706f7305a3656e6406a66869"
        "6464656ec0",
    ),
    (Pong(7), "0000002084a174a4706f6e67a56e6f6e636507a872785f627974657300a572785f757300"),
    (
        Error("busy", "later"),
        "0000002b85a174a56572726f72a4636f6465a462757379a76d657373616765a56c61746572a3736964a0a368"
        "6f70ff",
    ),
    (
        Resume("s", "tok", False, True),
        "0000002c85a174a6726573756d65a3736964a173aa73696e6b5f746f6b656ea3746f6ba56f776e6572c2a473"
        "696e6bc3",
    ),
]


@pytest.mark.parametrize("message, frame", GOLDEN, ids=lambda v: type(v).__name__)
def test_a_message_encodes_to_the_bytes_it_always_did_and_parses_back(message, frame):
    assert encode_frame(to_wire(message)).hex() == frame
    assert parse_message(to_wire(message)) == message


def test_every_message_type_has_its_own_tag():
    tags = [cls.t for cls in typing.get_args(Message)]
    assert len(set(tags)) == len(tags)


@pytest.mark.parametrize("kind", [None, "nope", 5, ["open"], {"t": "open"}])
def test_an_unknown_or_missing_message_type_is_a_protocol_error(kind):
    with pytest.raises(ProtocolError, match="unknown message type"):
        parse_message({"t": kind, "sid": "s"})


def test_a_field_nobody_declared_is_ignored():
    assert parse_message({**to_wire(OPEN), "newer": [1, 2]}) == OPEN


def test_a_required_field_left_out_is_a_protocol_error():
    raw = to_wire(OPEN)
    del raw["fingerprint"]
    with pytest.raises(ProtocolError, match="'fingerprint' must be a string"):
        parse_message(raw)


def test_a_field_with_a_default_left_out_takes_it_and_a_none_one_is_not_sent():
    raw = to_wire(Error("busy", "later", sid="s", hop=2))
    del raw["sid"], raw["hop"]
    assert parse_message(raw) == Error("busy", "later")
    assert "handoff" not in to_wire(OPEN)
    assert parse_message(to_wire(OPEN)).handoff is None


@pytest.mark.parametrize("value", [None, 7, b"s", "s" * 65])
def test_a_string_of_another_type_or_too_long_is_a_protocol_error(value):
    with pytest.raises(ProtocolError, match=r"field 'sid' must be a string of at most 64"):
        parse_message({**to_wire(OPEN), "sid": value})


@pytest.mark.parametrize("value", [0, (1 << 20) + 1, -1, True, 1.0, "8", None])
def test_an_integer_out_of_range_or_of_another_type_is_a_protocol_error(value):
    with pytest.raises(ProtocolError, match=r"field 'max_length' must be an integer in \[1, "):
        parse_message({**to_wire(OPEN), "max_length": value})


def test_an_open_for_a_hop_beyond_its_route_is_a_protocol_error():
    raw = {**to_wire(Open("s", (H1, H2), 0, "fp", "float16", 8, "tok")), "hop": 2}
    with pytest.raises(ProtocolError, match=r"field 'hop' must be an integer in \[0, 1\]"):
        parse_message(raw)


@pytest.mark.parametrize("hops", [0, 65])
def test_a_route_empty_or_over_64_hops_long_is_a_protocol_error(hops):
    raw = {**to_wire(OPEN), "route": [H1.to_wire()] * hops}
    with pytest.raises(ProtocolError, match=r"field 'route' must be a list of 1\.\.64 hops"):
        parse_message(raw)


@pytest.mark.parametrize(
    "hop", [["h", 1, 2, 3], ["h", 1, 2, 3, "p", "t", "r", "x"], ["h", True, 2, 3, "p"], "h:1"]
)
def test_a_hop_of_the_wrong_shape_is_a_protocol_error(hop):
    with pytest.raises(ProtocolError, match="route hop must be"):
        parse_message({**to_wire(OPEN), "handoff": hop})


def test_a_hop_without_its_later_fields_reads_with_their_defaults():
    raw = {**to_wire(OPEN), "route": [["10.0.0.1", 4000, 0, 3, ""]]}
    assert parse_message(raw) == OPEN


def test_a_value_outside_its_choices_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="field 'phase' must be one of"):
        parse_message({**to_wire(Step("s", "decode", 0, 1, None)), "phase": "think"})
    with pytest.raises(ProtocolError, match="field 'op' must be one of"):
        parse_message({**to_wire(Relay("listen")), "op": "x" * 1000})


@pytest.mark.parametrize("owner, sink", [(False, False), (1, True), (True, None)])
def test_a_resume_as_neither_owner_nor_sink_or_not_booleans_is_a_protocol_error(owner, sink):
    raw = {**to_wire(Resume("s", "tok", True, True)), "owner": owner, "sink": sink}
    with pytest.raises(ProtocolError, match="'owner' and 'sink' must be booleans"):
        parse_message(raw)


@pytest.mark.parametrize("inner", [None, {**to_wire(OPEN), "t": "opened"}, [to_wire(OPEN)]])
def test_a_handover_whose_open_is_not_an_open_message_is_a_protocol_error(inner):
    with pytest.raises(ProtocolError, match="field 'open' must be an open message"):
        parse_message({**to_wire(Handover(OPEN, 4)), "open": inner})


def test_the_open_inside_a_handover_is_checked_like_any_open():
    raw = to_wire(Handover(OPEN, 4))
    raw["open"]["sink_token"] = "t" * 65
    with pytest.raises(ProtocolError, match="'sink_token' must be a string"):
        parse_message(raw)


def test_an_error_about_a_long_value_still_makes_a_frame_its_peer_parses():
    exc = ProtocolError("bad phase " + "x" * 10_000)
    back = parse_message(to_wire(Error.of(exc, sid="s")))
    assert back.code == exc.code and str(exc).startswith(back.message)
