"""Options declared once: a dataclass field says its default, its help, its flag and its bounds,
and a command line is derived from the fields.

Durations are seconds everywhere in the code (fields end in `_s`); a flag that reads
milliseconds says so in its name (`--prefill-gather-ms`) and its field in `ms=True`.
Every number a flag reads has its bounds checked at parse (`bounded`): a bad value is a one-line
usage error, not a traceback from deep in the program.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import Field, field, fields
from typing import Any


def option(default, help: str = "", *, flag: str | None = None, ms: bool = False, **argparse_kw):
    """A config field with its command-line flag (default: --field-name); `ms`: the flag reads
    milliseconds into a field in seconds. Other keywords go to argparse's add_argument: `type`
    is where a number's bounds go (`bounded`)."""
    return field(
        default=default, metadata={"flag": flag, "help": help, "ms": ms, "argparse": argparse_kw}
    )


def is_option(f: Field) -> bool:
    return "argparse" in f.metadata


def bounded(
    kind: type = int,
    low: float | None = None,
    high: float | None = None,
    *,
    above: float | None = None,
) -> Callable[[str], Any]:
    """An argparse `type` reading a `kind` (int or float) in [low, high], or (above, high]."""

    def _number(x: float) -> str:
        return f"{x:g}" if isinstance(x, float) else str(x)

    if above is not None:
        rule = f"> {_number(above)}" + (f" and <= {_number(high)}" if high is not None else "")
    elif high is None:
        rule = f"at least {low}" if kind is int else f">= {_number(low)}"
    else:
        rule = f"{low}..{high}" if kind is int else f"in [{_number(low)}, {_number(high)}]"
    rule = rule if kind is int else f"a number {rule}"

    def parse(text: str):
        value = kind(text)
        ok = (  # NaN fails every comparison, so it is refused too
            (above is None or value > above)
            and (low is None or value >= low)
            and (high is None or value <= high)
        )
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid int value: 'x'"
    return parse


positive_int = bounded(int, 1)
non_negative_int = bounded(int, 0)
non_negative_float = bounded(float, 0)
positive_float = bounded(float, above=0)
nice_steps = bounded(int, 0, 19)  # how far below a process's own priority a thread or child runs
port_number = bounded(int, 0, 65535)


def input_terms_arg(text: str) -> int | None:
    """--input-terms: auto (None: each instruction set's own), 1 or 2."""
    if text == "auto":
        return None
    if text in ("1", "2"):
        return int(text)
    raise argparse.ArgumentTypeError(f"auto, 1 or 2, not {text!r}")


def _metavar(name: str, default, ms: bool) -> str:
    if ms:
        return "MS"
    if name.endswith("_s"):
        return "SECONDS"
    if isinstance(default, int):
        return "N"
    if isinstance(default, float):
        return "X"
    return name.upper()


def add_option(parser: argparse._ActionsContainer, name: str, f: Field, dest: str = "") -> None:
    """Add option field `f` (the field `name` of its dataclass) to `parser` (or a group), read
    into `dest` (default: `name`)."""
    meta = f.metadata
    flag = meta["flag"] or "--" + name.replace("_", "-")
    kw = dict(meta["argparse"])
    default = f.default * 1000 if meta["ms"] and f.default is not None else f.default
    if "type" not in kw and "nargs" not in kw and "action" not in kw and default is not None:
        kw["type"] = non_negative_float if meta["ms"] else type(default)
    if kw.get("type") in (int, float) and "choices" not in kw:
        raise TypeError(f"{flag} reads a number: give its bounds, type=bounded(...)")
    if not {"metavar", "choices", "nargs", "action"} & kw.keys():
        kw["metavar"] = _metavar(name, default, meta["ms"])
    if isinstance(default, tuple):
        default = list(default)
    helptext = meta["help"] + (" (default: %(default)s)" if default not in (None, []) else "")
    parser.add_argument(flag, dest=dest or name, default=default, help=helptext, **kw)


def add_options(parser: argparse._ActionsContainer, **options: Field) -> None:
    """Add each option field, as `name=option(...)`, read into `name`."""
    for name, f in options.items():
        add_option(parser, name, f)


def option_fields(cls) -> list[Field]:
    """The fields of dataclass `cls` that are options, in order."""
    return [f for f in fields(cls) if is_option(f)]


def add_fields(parser: argparse._ActionsContainer, cls) -> None:
    """Add every option field of dataclass `cls`, each read into its field's name."""
    for f in option_fields(cls):
        add_option(parser, f.name, f)


def from_args(cls, args: argparse.Namespace, **given):
    """A `cls` of the option fields' values parsed into `args`, and the other fields `given`."""
    values = {f.name: read_option(f, getattr(args, f.name)) for f in option_fields(cls)}
    return cls(**values, **given)


def read_option(f: Field, value: Any) -> Any:
    """A parsed flag's value as its field holds it: seconds, tuples."""
    if f.metadata["ms"] and value is not None:
        return value / 1000
    if isinstance(value, list):
        return tuple(value)
    return value
