"""Hostile bytes against the sans-IO wire layer: the codec and parsers fail only with our errors.

No sockets: hypothesis drives FrameDecoder, parse_message, unpack_tensor, the DHT record reader
and the address parser directly. Each property runs inside its test so the test can count and
report how many examples it ran.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import typing
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarm.address import join_host_port, parse_host_port
from swarm.errors import FrameTooLarge, ProtocolError, ShapeMismatch, SwarmError
from swarm.protocol import (
    PHASES,
    Attach,
    Attached,
    Close,
    Error,
    Open,
    Opened,
    Ping,
    Pong,
    Result,
    Step,
    parse_message,
    to_wire,
)
from swarm.records import BOTH, DEFAULT_WEIGHTS, PREFILL, ROLES, NodeRecord
from swarm.wire import WIRE_DTYPES, FrameDecoder, encode_frame, pack_tensor, unpack_tensor
from tests.helpers.strategies import hops, hostile_scalars, scalars, sids, small_ints

MAX_FRAME = 512  # small, so random prefixes land on both sides of the limit
HIDDEN = 8
MAX_TOKENS = 6
MESSAGE_TYPES = (Open, Opened, Attach, Attached, Step, Result, Close, Ping, Pong, Error)
KINDS = ["open", "opened", "attach", "attached", "step", "result", "close", "ping", "pong"]
KINDS += ["error"]

FAST = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)


class Examples:
    def __init__(self) -> None:
        self.count = 0

    def tick(self) -> None:
        self.count += 1


@pytest.fixture
def examples(request, record_property):
    """Counts a property's examples; reports them as a junit property and on stdout (-s)."""
    counter = Examples()
    yield counter
    record_property("hypothesis_examples", counter.count)
    print(f"\n{request.node.name}: {counter.count} hypothesis examples")
    assert counter.count > 0


# ---- strategies -------------------------------------------------------------------------------

# what msgpack can carry and give back unchanged: str-keyed maps, lists, scalars
packable = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)
hostile = st.recursive(
    hostile_scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.binary(max_size=4), inner, max_size=4)
    ),
    max_leaves=16,
)
maps = st.dictionaries(st.text(max_size=8), packable, max_size=6)


@st.composite
def opens(draw) -> Open:
    route = tuple(draw(st.lists(hops, min_size=1, max_size=4)))
    return Open(
        sid=draw(sids),
        route=route,
        hop=draw(st.integers(0, len(route) - 1)),
        fingerprint=draw(st.text(max_size=128)),
        wire_dtype=draw(st.text(max_size=16)),
        max_length=draw(st.integers(1, 1 << 20)),
        sink_token=draw(st.text(max_size=64)),
        handoff=draw(st.none() | hops),
    )


valid_messages = st.one_of(
    opens(),
    st.builds(Opened, sids),
    st.builds(Attach, sids, st.text(max_size=64)),
    st.builds(Attached, sids),
    st.builds(Step, sids, st.sampled_from(PHASES), small_ints, st.integers(1, 2**31), packable),
    st.builds(Result, sids, st.integers(1, 2**31), packable),
    st.builds(Close, sids),
    st.builds(Ping, st.integers(0, 2**63)),
    st.builds(Pong, st.integers(0, 2**63), st.integers(0, 2**31), st.integers(0, 2**31)),
    st.builds(Error, st.text(max_size=64), st.text(max_size=200), sids, st.integers(-1, 1024)),
)


def field_accepts(kind: str, name: str, value: Any) -> bool:
    """Whether parse_message may accept `value` in field `name` of a `kind` message."""
    if name == "hidden":
        return True  # a tensor map, checked by the receiver that knows the expected shape
    if name == "route":
        return isinstance(value, list)  # the hop checks are a separate matter
    if name in ("sid", "code", "message", "fingerprint", "wire_dtype", "sink_token", "origin"):
        return isinstance(value, str)
    if name == "phase":
        return value in PHASES
    return isinstance(value, int) and not isinstance(value, bool)


# ---- FrameDecoder -----------------------------------------------------------------------------


def run_decoder(stream: bytes, cuts: list[int]) -> list[tuple[str, Any]]:
    """Feed `stream` cut at `cuts` the way the node reads a socket; return what came out."""
    decoder = FrameDecoder(MAX_FRAME)
    events: list[tuple[str, Any]] = []
    bounds = [0, *sorted(set(cuts)), len(stream)]
    for a, b in zip(bounds, bounds[1:]):
        try:
            decoder.feed(stream[a:b])
            while True:
                try:
                    message = decoder.next_message()
                except FrameTooLarge:
                    raise
                except ProtocolError as exc:  # the frame is consumed; the stream goes on
                    events.append(("protocol", str(exc)))
                    continue
                if message is None:
                    break
                assert isinstance(message, dict)
                events.append(("message", message))
        except FrameTooLarge:
            events.append(("too_large", None))  # the stream cannot be framed any more
            return events
        assert decoder.buffered <= MAX_FRAME + 4, decoder.buffered
    return events


def frame_of(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


segments = st.one_of(
    st.binary(max_size=64),  # raw garbage, usually a huge prefix
    st.binary(max_size=MAX_FRAME).map(frame_of),  # a well-framed garbage body
    maps.map(encode_frame).filter(lambda f: len(f) <= MAX_FRAME + 4),
    packable.map(lambda v: frame_of(msgpack.packb([v]))),  # valid msgpack, not a map
    st.integers(MAX_FRAME + 1, 2**32 - 1).map(lambda n: struct.pack(">I", n)),
    maps.map(encode_frame).flatmap(lambda f: st.integers(0, len(f) - 1).map(lambda k: f[:k])),
)


@st.composite
def cut_stream(draw, parts):
    stream = b"".join(draw(st.lists(parts, max_size=8)))
    cuts = draw(st.lists(st.integers(0, len(stream)), max_size=12))
    return stream, cuts


def test_decoder_yields_maps_or_protocol_errors_under_any_split(examples):
    @FAST
    @given(cut_stream(segments))
    def prop(case):
        examples.tick()
        stream, cuts = case
        events = run_decoder(stream, cuts)
        # splitting never changes what comes out; compared as text, since a garbage body can
        # decode to a NaN, which equals nothing, not even itself
        assert repr(events) == repr(run_decoder(stream, []))

    prop()


def test_decoder_refuses_a_huge_prefix_without_buffering_its_frame(examples):
    @FAST
    @given(st.integers(MAX_FRAME + 1, 2**32 - 1), st.binary(max_size=64))
    def prop(length, tail):
        examples.tick()
        decoder = FrameDecoder(MAX_FRAME)
        with pytest.raises(FrameTooLarge, match=str(length)):
            decoder.feed(struct.pack(">I", length) + tail)

    prop()


def test_any_msgpack_map_round_trips_through_frames_under_any_split(examples):
    @FAST
    @given(
        st.lists(maps, min_size=1, max_size=3).flatmap(lambda ms: st.tuples(st.just(ms), _cuts(ms)))
    )
    def prop(case):
        examples.tick()
        messages, cuts = case
        stream = b"".join(encode_frame(m) for m in messages)
        decoder = FrameDecoder(len(stream))
        out = []
        bounds = [0, *sorted(set(cuts)), len(stream)]
        for a, b in zip(bounds, bounds[1:]):
            decoder.feed(stream[a:b])
            while (message := decoder.next_message()) is not None:
                out.append(message)
        assert out == messages
        assert decoder.buffered == 0

    prop()


def _cuts(messages):
    total = sum(len(encode_frame(m)) for m in messages)
    return st.lists(st.integers(0, total), max_size=16)


# ---- parse_message ----------------------------------------------------------------------------


def assert_well_typed(message) -> None:
    """Every field of a parsed message has the type its dataclass declares."""
    assert isinstance(message, MESSAGE_TYPES), message
    hints = typing.get_type_hints(type(message))
    for f in dataclasses.fields(message):
        value, hint = getattr(message, f.name), hints[f.name]
        if hint is str:
            assert isinstance(value, str), (f.name, value)
        elif hint is int:
            assert isinstance(value, int) and not isinstance(value, bool), (f.name, value)
        elif f.name == "route":
            assert isinstance(value, tuple) and value
            for hop in value:
                assert isinstance(hop.host, str) and isinstance(hop.peer, str)
                for n in (hop.port, hop.start, hop.end):
                    assert isinstance(n, int) and not isinstance(n, bool)
    assert parse_message(to_wire(message)) == message


def parse_or_protocol_error(raw: dict) -> None:
    try:
        message = parse_message(raw)
    except ProtocolError:
        return
    assert_well_typed(message)


field_names = st.sampled_from(
    ["sid", "route", "hop", "fingerprint", "wire_dtype", "max_length", "sink_token", "phase"]
    + ["pos", "end", "hidden", "nonce", "code", "message"]
)


def test_arbitrary_maps_parse_to_typed_messages_or_protocol_errors(examples):
    @FAST
    @given(
        st.sampled_from(KINDS) | hostile,
        st.dictionaries(field_names | st.text(max_size=6), hostile, max_size=8),
    )
    def prop(kind, fields):
        examples.tick()
        parse_or_protocol_error({**fields, "t": kind})

    prop()


def test_valid_messages_parse_back_to_themselves(examples):
    @FAST
    @given(valid_messages)
    def prop(message):
        examples.tick()
        assert parse_message(to_wire(message)) == message
        assert parse_message(msgpack.unpackb(msgpack.packb(to_wire(message)), raw=False)) == message

    prop()


def test_a_field_of_the_wrong_type_is_a_protocol_error(examples):
    @FAST
    @given(valid_messages, st.data())
    def prop(message, data):
        examples.tick()
        raw = to_wire(message)
        name = data.draw(st.sampled_from(sorted(raw)))
        value = data.draw(hostile)
        raw[name] = value
        if name == "t":
            if value not in KINDS:
                with pytest.raises(ProtocolError):
                    parse_message(raw)
            else:
                parse_or_protocol_error(raw)
        elif field_accepts(raw["t"], name, value):
            parse_or_protocol_error(raw)
        else:
            with pytest.raises(ProtocolError):
                parse_message(raw)

    prop()


def test_a_missing_or_extra_field_is_a_protocol_error_or_ignored(examples):
    @FAST
    @given(valid_messages, st.data())
    def prop(message, data):
        examples.tick()
        raw = to_wire(message)
        # fields with a default may be left out (added to the protocol later, or optional)
        none = dataclasses.MISSING
        optional = {"hidden"} | {
            f.name
            for f in dataclasses.fields(message)
            if f.init and (f.default is not none or f.default_factory is not none)
        }
        name = data.draw(st.sampled_from(sorted(raw)))
        del raw[name]
        if name in optional:
            parse_or_protocol_error(raw)
        else:
            with pytest.raises(ProtocolError):
                parse_message(raw)
        raw[name] = to_wire(message)[name]
        raw[data.draw(st.text(max_size=8).filter(lambda k: k not in raw))] = data.draw(hostile)
        assert parse_message(raw) == message

    prop()


def test_route_hops_of_the_wrong_shape_are_protocol_errors(examples):
    @FAST
    @given(opens(), st.data())
    def prop(message, data):
        examples.tick()
        raw = to_wire(message)
        i = data.draw(st.integers(0, len(raw["route"]) - 1))
        raw["route"][i] = data.draw(
            hostile.filter(
                lambda h: (
                    not (
                        isinstance(h, list)
                        and len(h) == 5
                        and isinstance(h[0], str)
                        and isinstance(h[4], str)
                        and all(isinstance(x, int) and not isinstance(x, bool) for x in h[1:4])
                    )
                )
            )
        )
        with pytest.raises(ProtocolError):
            parse_message(raw)

    prop()


# ---- unpack_tensor ----------------------------------------------------------------------------


def unpack_or_shape_mismatch(obj: Any, tokens: int | None = None) -> torch.Tensor | None:
    try:
        t = unpack_tensor(obj, hidden=HIDDEN, max_tokens=MAX_TOKENS, tokens=tokens)
    except ShapeMismatch as exc:
        assert isinstance(exc, SwarmError)
        return None
    assert t.dtype == torch.float32 and t.shape[0] == 1 and t.shape[2] == HIDDEN
    assert 1 <= t.shape[1] <= MAX_TOKENS and torch.isfinite(t).all()
    return t


tensor_keys = st.sampled_from(["dtype", "shape", "data"])


def test_arbitrary_objects_unpack_to_valid_tensors_or_shape_mismatch(examples):
    @FAST
    @given(
        st.one_of(
            hostile,
            st.dictionaries(tensor_keys | st.text(max_size=5), hostile, max_size=4),
            st.fixed_dictionaries(
                {
                    "dtype": st.sampled_from(sorted(WIRE_DTYPES)) | hostile,
                    "shape": st.lists(st.integers(-2, 10) | hostile, max_size=4),
                    "data": st.binary(max_size=HIDDEN * MAX_TOKENS * 4 + 4) | hostile,
                }
            ),
        )
    )
    def prop(obj):
        examples.tick()
        unpack_or_shape_mismatch(obj)

    prop()


@st.composite
def wire_tensors(draw):
    dtype = draw(st.sampled_from(sorted(WIRE_DTYPES)))
    tokens = draw(st.integers(1, MAX_TOKENS))
    values = draw(
        st.lists(
            st.floats(-1000, 1000, allow_nan=False, width=16),
            min_size=tokens * HIDDEN,
            max_size=tokens * HIDDEN,
        )
    )
    t = torch.tensor(values, dtype=torch.float32).reshape(1, tokens, HIDDEN)
    return t, dtype, pack_tensor(t, dtype)


def test_a_valid_tensor_unpacks_to_its_values(examples):
    @FAST
    @given(wire_tensors())
    def prop(case):
        examples.tick()
        t, dtype, wire = case
        out = unpack_tensor(wire, hidden=HIDDEN, max_tokens=MAX_TOKENS, tokens=t.shape[1])
        assert torch.equal(out, t.to(WIRE_DTYPES[dtype]).to(torch.float32))

    prop()


def _bad_dtypes(dtype: str):
    other_size = [d for d in WIRE_DTYPES if (d == "float32") != (dtype == "float32")]
    return st.sampled_from(other_size) | hostile.filter(
        lambda v: not (isinstance(v, str) and v in WIRE_DTYPES)
    )


def test_a_corrupted_tensor_is_a_shape_mismatch(examples):
    @FAST
    @given(wire_tensors(), st.data())
    def prop(case, data):
        examples.tick()
        t, dtype, wire = case
        tokens = t.shape[1]
        corruption = data.draw(
            st.sampled_from(["dtype", "shape", "dim", "data", "nonfinite", "tokens", "keys"])
        )
        if corruption == "dtype":
            wire["dtype"] = data.draw(_bad_dtypes(dtype))
        elif corruption == "shape":
            wire["shape"] = data.draw(hostile.filter(lambda s: s != wire["shape"]))
        elif corruption == "dim":
            i = data.draw(st.integers(0, 2))
            wire["shape"][i] = data.draw(
                st.integers(-(2**63), 2**64 - 1).filter(lambda n: n != wire["shape"][i])
                | st.sampled_from([True, False, 1.0, None, "1"])
            )
        elif corruption == "data":
            raw = wire["data"]
            wire["data"] = data.draw(
                st.binary(max_size=len(raw) + 8).filter(lambda b: len(b) != len(raw))
                | st.just(bytearray(raw))
                | st.just(raw.hex())
                | st.just(list(raw))
            )
        elif corruption == "nonfinite":
            bad = t.clone()
            flat = bad.view(-1)
            flat[data.draw(st.integers(0, flat.numel() - 1))] = data.draw(
                st.sampled_from([math.nan, math.inf, -math.inf])
            )
            wire = pack_tensor(bad, dtype)
        elif corruption == "tokens":
            tokens = data.draw(st.integers(0, 2 * MAX_TOKENS).filter(lambda n: n != t.shape[1]))
        else:
            wire[data.draw(st.text(max_size=5).filter(lambda k: k not in wire))] = b""
        with pytest.raises(ShapeMismatch):
            unpack_tensor(wire, hidden=HIDDEN, max_tokens=MAX_TOKENS, tokens=tokens)

    prop()


# ---- DHT records and addresses: what strangers announce -----------------------------------

RECORD = NodeRecord(
    peer="12D3KooWpeer",
    addr="203.0.113.7:31337",
    model="m",
    start=0,
    end=4,
    state="online",
    fingerprint="fp",
    version="0.1.0",
    num_layers=8,
    link={"rtt_s": 0.01},
    weights="int4",
)
record_fields = st.sampled_from(sorted(RECORD.to_wire()))


def test_hostile_record_fields_read_as_a_record_or_value_error(examples):
    @FAST
    @given(st.dictionaries(record_fields | st.text(max_size=6), hostile, max_size=6))
    def prop(changes):
        examples.tick()
        try:
            rec = NodeRecord.from_wire({**RECORD.to_wire(), **changes})
        except ValueError:
            return
        assert 0 <= rec.start < rec.end <= rec.num_layers
        assert isinstance(rec.weights, str) and 0 < len(rec.weights) <= 32
        assert rec.role in ROLES
        parse_host_port(rec.addr)

    prop()


def test_a_record_round_trips_and_one_without_weights_reads_as_float32():
    assert NodeRecord.from_wire(RECORD.to_wire()) == RECORD
    old = {k: v for k, v in RECORD.to_wire().items() if k != "weights"}
    assert NodeRecord.from_wire(old).weights == DEFAULT_WEIGHTS == "float32"


hosts = st.ip_addresses().map(str) | st.from_regex(
    r"[a-z0-9]([a-z0-9.-]{0,20}[a-z0-9])?", fullmatch=True
)


def test_a_record_without_a_role_reads_as_both_and_one_with_another_is_refused():
    old = {k: v for k, v in RECORD.to_wire().items() if k != "role"}
    assert NodeRecord.from_wire(old).role == BOTH
    assert NodeRecord.from_wire({**old, "role": PREFILL}).role == PREFILL
    with pytest.raises(ValueError, match="role"):
        NodeRecord.from_wire({**old, "role": "everything"})


def test_a_joined_address_parses_back_to_its_host_and_port(examples):
    @FAST
    @given(hosts, st.integers(1, 65535))
    def prop(host, port):
        examples.tick()
        assert parse_host_port(join_host_port(host, port)) == (host, port)

    prop()


def test_any_text_parses_to_a_valid_address_or_value_error(examples):
    @FAST
    @given(st.text(max_size=24) | st.from_regex(r"\[?[0-9a-f:.]{0,12}\]?:-?[0-9]{0,7}"))
    def prop(text):
        examples.tick()
        try:
            host, port = parse_host_port(text)
        except ValueError:
            return
        assert host and 1 <= port <= 65535

    prop()
