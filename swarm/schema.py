"""Wire fields declared once: a message dataclass names each field's bounds in its declaration
(`sid: str = text(64)`), and one `Codec` parses a decoded map against them and encodes back.

Sans-IO like the frame codec: maps in, typed messages out. Every refusal is a `ProtocolError`
naming the field; keys a message does not declare are ignored, so a newer peer may add fields.
A field with a default may be left out; one whose default is None is also left out when None.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from swarm.errors import ProtocolError

WIRE = "wire"  # the dataclass field metadata key that holds a field's Spec


class Spec(Protocol):
    """How one field travels: `read` checks a decoded value (`parsed`: the fields before it,
    for bounds that depend on them) and returns what the message holds; `write` undoes it."""

    def read(self, name: str, value: Any, parsed: dict[str, Any]) -> Any: ...

    def write(self, value: Any) -> Any: ...


class _Plain:
    """A value that travels as it is held."""

    def write(self, value: Any) -> Any:
        return value


@dataclass(frozen=True)
class Text(_Plain):
    max_len: int = 256

    def read(self, name: str, value: Any, parsed: dict[str, Any]) -> str:
        if not isinstance(value, str) or len(value) > self.max_len:
            raise ProtocolError(
                f"field {name!r} must be a string of at most {self.max_len} characters"
            )
        return value


@dataclass(frozen=True)
class Integer(_Plain):
    """An int (never a bool) in [lo, hi]; `hi` may be computed from the fields read before."""

    lo: int = 0
    hi: int | Callable[[dict[str, Any]], int] = 2**31

    def read(self, name: str, value: Any, parsed: dict[str, Any]) -> int:
        hi = self.hi(parsed) if callable(self.hi) else self.hi
        if not isinstance(value, int) or isinstance(value, bool) or not self.lo <= value <= hi:
            raise ProtocolError(
                f"field {name!r} must be an integer in [{self.lo}, {hi}], got {value!r}"
            )
        return value


@dataclass(frozen=True)
class Number(_Plain):
    """A finite float (an int is taken too, never a bool) in [lo, hi]."""

    lo: float
    hi: float

    def read(self, name: str, value: Any, parsed: dict[str, Any]) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok or not self.lo <= value <= self.hi:  # NaN fails both
            raise ProtocolError(
                f"field {name!r} must be a number in [{self.lo:g}, {self.hi:g}], got {value!r}"
            )
        return float(value)


@dataclass(frozen=True)
class OneOf(_Plain):
    """One of a fixed set of values; `cut` bounds the error's length (None: whole)."""

    choices: tuple[Any, ...]
    cut: int | None = None

    def read(self, name: str, value: Any, parsed: dict[str, Any]) -> Any:
        if value not in self.choices:
            raise ProtocolError(
                f"field {name!r} must be one of {self.choices}, got {value!r}"[: self.cut]
            )
        return value


@dataclass(frozen=True)
class AnyTrue(_Plain):
    """Booleans of which at least one is true, declared on each of `names` in order."""

    names: tuple[str, ...]

    def read(self, name: str, value: Any, parsed: dict[str, Any]) -> bool:
        last = name == self.names[-1]
        if not isinstance(value, bool) or (
            last and not (value or any(parsed[n] for n in self.names[:-1]))
        ):
            named = " and ".join(repr(n) for n in self.names)
            raise ProtocolError(f"fields {named} must be booleans, one of them true")
        return value


@dataclass(frozen=True)
class Unchecked(_Plain):
    """Anything msgpack carries (None if left out): checked later by whoever knows its shape,
    as a wire tensor is against the shape expected where it lands (swarm.wire.unpack_tensor)."""

    def read(self, name: str, value: Any, parsed: dict[str, Any]) -> Any:
        return value


@dataclass(frozen=True)
class Row:
    """A small dataclass travelling as the list of its fields' values in declaration order; the
    first `required` of them must be there. Each value has its field's type, str or int."""

    cls: type
    required: int
    what: str
    _names: tuple[str, ...] = field(init=False, repr=False)
    _types: tuple[type, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(self.cls)
        names = tuple(f.name for f in dataclasses.fields(self.cls))
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "_types", tuple(hints[n] for n in names))

    def read(self, name: str, value: Any, parsed: dict[str, Any]) -> Any:
        if not (
            isinstance(value, list)
            and self.required <= len(value) <= len(self._types)
            and all(_is(v, t) for v, t in zip(value, self._types))
        ):
            names = ", ".join(self._names)
            raise ProtocolError(f"{self.what} must be [{names}], got {value!r}"[:300])
        return self.cls(*value)

    def write(self, value: Any) -> list:
        return [getattr(value, n) for n in self._names]


@dataclass(frozen=True)
class ListOf:
    """A list of `lo`..`hi` items of one spec, held as a tuple."""

    item: Spec
    lo: int
    hi: int
    noun: str

    def read(self, name: str, value: Any, parsed: dict[str, Any]) -> tuple:
        if not isinstance(value, list) or not self.lo <= len(value) <= self.hi:
            raise ProtocolError(
                f"field {name!r} must be a list of {self.lo}..{self.hi} {self.noun}"
            )
        return tuple(self.item.read(name, v, parsed) for v in value)

    def write(self, value: Any) -> list:
        return [self.item.write(v) for v in value]


@dataclass(frozen=True)
class Nested:
    """A whole message inside another, tag included."""

    cls: type
    _slots: tuple[Slot, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_slots", slots_of(self.cls))

    def read(self, name: str, value: Any, parsed: dict[str, Any]) -> Any:
        if not isinstance(value, dict) or value.get("t") != self.cls.t:
            raise ProtocolError(f"field {name!r} must be an {self.cls.t} message")
        return read_fields(self.cls, self._slots, value)

    def write(self, value: Any) -> dict[str, Any]:
        return write_fields(value, self._slots)


def _is(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


# ---- declaring fields -------------------------------------------------------------------------


def declare(spec: Spec, default: Any = MISSING) -> Any:
    """A dataclass field travelling as `spec`; with a default it may be left out on the wire."""
    return field(default=default, metadata={WIRE: spec})


def text(max_len: int = 256, default: Any = MISSING) -> Any:
    return declare(Text(max_len), default)


def integer(
    lo: int = 0, hi: int | Callable[[dict[str, Any]], int] = 2**31, default: Any = MISSING
) -> Any:
    return declare(Integer(lo, hi), default)


def number(lo: float, hi: float, default: Any = MISSING) -> Any:
    return declare(Number(lo, hi), default)


def one_of(choices: tuple[Any, ...], cut: int | None = None) -> Any:
    return declare(OneOf(choices, cut))


def unchecked() -> Any:
    return declare(Unchecked())


def tag(name: str) -> Any:
    """The message's type on the wire (the map's "t"); not an argument of the constructor."""
    return field(default=name, init=False)


# ---- one parse, one encode --------------------------------------------------------------------


@dataclass(frozen=True)
class Slot:
    """One declared field as the codec walks it."""

    name: str
    spec: Spec
    optional: bool  # has a default, so it may be left out
    omit_none: bool  # its default is None: left out while None


def slots_of(cls: type) -> tuple[Slot, ...]:
    """The wire fields of message class `cls`, in declaration order (its tag excluded)."""
    return tuple(
        Slot(
            f.name,
            f.metadata[WIRE],
            f.default is not MISSING or f.default_factory is not MISSING,
            f.default is None,
        )
        for f in dataclasses.fields(cls)
        if f.init
    )


def read_fields(cls: type, slots: tuple[Slot, ...], raw: dict[str, Any]) -> Any:
    """`cls` from the decoded map `raw`, every declared field checked against its spec."""
    parsed: dict[str, Any] = {}
    for slot in slots:
        if slot.optional and slot.name not in raw:
            continue
        parsed[slot.name] = slot.spec.read(slot.name, raw.get(slot.name), parsed)
    return cls(**parsed)


def write_fields(message: Any, slots: tuple[Slot, ...]) -> dict[str, Any]:
    """The map `message` travels as: its tag first, then its fields in declaration order."""
    out: dict[str, Any] = {"t": message.t}
    for slot in slots:
        value = getattr(message, slot.name)
        if value is None and slot.omit_none:
            continue
        out[slot.name] = slot.spec.write(value)
    return out


class Codec:
    """Parses and encodes the messages of one protocol, each found by its tag."""

    def __init__(self, *classes: type):
        self._by_tag = MappingProxyType({c.t: (c, slots_of(c)) for c in classes})
        if len(self._by_tag) != len(classes):
            raise ValueError(f"two message types share a tag: {[c.t for c in classes]}")
        self._by_class = MappingProxyType({c: slots for c, slots in self._by_tag.values()})

    def parse(self, raw: dict[str, Any]) -> Any:
        kind = raw.get("t")
        found = self._by_tag.get(kind) if isinstance(kind, str) else None
        if found is None:
            raise ProtocolError(f"unknown message type {kind!r}")
        return read_fields(*found, raw)

    def encode(self, message: Any) -> dict[str, Any]:
        return write_fields(message, self._by_class[type(message)])
