"""The hand-over messages (issue 38) under hostile input: any map with their kinds parses to a
message whose fields have their declared types, or is a ProtocolError; valid ones round-trip."""

from __future__ import annotations

import dataclasses
import typing

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.errors import ProtocolError
from swarm.protocol import (
    Handover,
    HandoverEnd,
    HandoverTail,
    Hop,
    KvChunk,
    Moved,
    Open,
    Release,
    Resume,
    Resumed,
    Taken,
    parse_message,
    to_wire,
)
from tests.helpers.strategies import hops, hostile_scalars, sids

KINDS = ["handover", "kv", "handover_tail", "handover_end", "taken", "moved", "resume"]
KINDS += ["resumed", "release"]
TYPES = (Handover, KvChunk, HandoverTail, HandoverEnd, Taken, Moved, Resume, Resumed, Release)
FIELDS = ["open", "length", "peer", "sid", "layer", "pos", "keys", "values", "digest", "key"]
FIELDS += ["proof", "hop", "to", "sink_token", "owner", "sink"]
FAST = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)

# the wire fuzz test's hostile values, in lists up to 7 long so that junk reaches the length of a
# hop ([host, port, start, end, peer, tls, relay])
hostile = st.recursive(
    hostile_scalars,
    lambda inner: (
        st.lists(inner, max_size=7) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)
lengths = st.integers(1, 1 << 20)
opens = st.builds(
    Open,
    sids,
    st.lists(hops, min_size=1, max_size=3).map(tuple),
    st.just(0),
    st.text(max_size=64),
    st.text(max_size=16),
    lengths,
    st.text(max_size=64),
)
valid = st.one_of(
    st.builds(Handover, opens, lengths, st.text(max_size=64)),
    st.builds(KvChunk, sids, st.integers(0, 4096), st.integers(0, 1 << 20), st.none(), st.none()),
    st.builds(HandoverTail, sids, lengths),
    st.builds(
        HandoverEnd,
        sids,
        st.text(max_size=64),
        st.text(max_size=64),
        st.text(max_size=64),
        st.text(max_size=64),
    ),  # fmt: skip
    st.builds(Taken, sids),
    st.builds(Moved, sids, st.integers(0, 63), hops, lengths),
    st.builds(Resume, sids, st.text(max_size=64), st.just(True), st.booleans()),
    st.builds(Resumed, sids),
    st.builds(Release, sids),
)


def assert_typed(message) -> None:
    assert isinstance(message, TYPES), message
    hints = typing.get_type_hints(type(message))
    for f in dataclasses.fields(message):
        value, hint = getattr(message, f.name), hints[f.name]
        if hint in (str, bool):
            assert type(value) is hint, (f.name, value)
        elif hint is int:
            assert type(value) is int, (f.name, value)
        elif hint is Open:
            assert isinstance(value, Open)
        elif hint is Hop:
            assert isinstance(value.host, str) and type(value.port) is int


def test_any_map_of_a_handover_kind_parses_typed_or_is_a_protocol_error():
    @FAST
    @given(
        st.sampled_from(KINDS),
        st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), hostile, max_size=8),
    )
    def prop(kind, fields):
        try:
            message = parse_message({**fields, "t": kind})
        except ProtocolError:
            return
        assert_typed(message)

    prop()


def test_a_valid_handover_message_parses_back_to_itself_through_msgpack():
    @FAST
    @given(valid)
    def prop(message):
        raw = msgpack.unpackb(msgpack.packb(to_wire(message)), raw=False)
        assert parse_message(raw) == message

    prop()


def test_a_field_of_a_valid_handover_message_replaced_by_junk_is_typed_or_refused():
    @FAST
    @given(valid, st.data())
    def prop(message, data):
        raw = to_wire(message)
        name = data.draw(st.sampled_from(sorted(k for k in raw if k != "t")))
        raw[name] = data.draw(hostile)
        try:
            parsed = parse_message(raw)
        except ProtocolError:
            return
        assert_typed(parsed)

    prop()
