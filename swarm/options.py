"""Options declared once: a dataclass field says its default, its help and its flag, and a
command line is derived from the fields.

Durations are seconds everywhere in the code (fields end in `_s`); a flag that reads
milliseconds says so in its name (`--prefill-gather-ms`) and its field in `ms=True`.
"""

from __future__ import annotations

import argparse
from dataclasses import Field, field
from typing import Any


def option(default, help: str = "", *, flag: str | None = None, ms: bool = False, **argparse_kw):
    """A config field with its command-line flag (default: --field-name); `ms`: the flag reads
    milliseconds into a field in seconds. Other keywords go to argparse's add_argument."""
    return field(
        default=default, metadata={"flag": flag, "help": help, "ms": ms, "argparse": argparse_kw}
    )


def is_option(f: Field) -> bool:
    return "argparse" in f.metadata


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def nice_steps(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 19:
        raise argparse.ArgumentTypeError(f"must be 0..19, got {value}")
    return value


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


def read_option(f: Field, value: Any) -> Any:
    """A parsed flag's value as its field holds it: seconds, tuples."""
    if f.metadata["ms"] and value is not None:
        return value / 1000
    if isinstance(value, list):
        return tuple(value)
    return value
