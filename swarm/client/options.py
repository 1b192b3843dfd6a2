"""What a client is told, each option declared once: how it reaches the swarm (`ClientOptions`)
and how it picks each token of a reply (`Sampling`).

`Client`'s keywords, `generate()`'s and `stream()`'s, and the flags of `python -m swarm.client`
and `python -m swarm.api` are these fields (swarm/options.py derives the flags).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Any

from swarm.cli import model_option, wire_dtype_option
from swarm.client.routing import HANDOFF_MIN_NEW_TOKENS
from swarm.client.session import PREFILL_CHUNK
from swarm.options import (
    bounded,
    non_negative_float,
    non_negative_int,
    option,
    positive_float,
    positive_int,
)

MAX_NEW_TOKENS = 64  # a reply's length where its caller names none


def speculative_arg(text: str) -> str:
    """--speculative: lookup, off, or the path of a draft model that exists."""
    if text in ("lookup", "off") or os.path.exists(text):
        return text
    raise argparse.ArgumentTypeError(f"lookup, off or a draft model's path, not {text!r}")


@dataclass(frozen=True)
class ClientOptions:
    """How a Client reaches the swarm; one Client serves one model."""

    model: str | None = model_option()
    wire_dtype: str | None = wire_dtype_option(None)
    step_timeout: float = option(
        30.0,
        "seconds a step may take (and 50 ms a token more) before its route counts as failed",
        type=positive_float,
        metavar="SECONDS",
    )
    max_retries: int = option(
        4,
        "new routes a step may try after its route failed, before the error reaches the caller",
        type=non_negative_int,
    )
    prefill_chunk: int = option(
        PREFILL_CHUNK, "most prompt tokens sent in one step message", type=positive_int
    )
    plaintext: bool = option(
        False,
        "also route through nodes run with --plaintext (an experiment; by default every"
        " connection is TLS, checked against the key each node's record names)",
        action="store_true",
    )
    disaggregate: bool = option(
        True,
        "send long prompts to prefill nodes where the swarm has them (P/D); --no-disaggregate:"
        " every session computes its prompt where it decodes",
        action=argparse.BooleanOptionalAction,
    )
    handoff_min_new: int = option(
        HANDOFF_MIN_NEW_TOKENS,
        "a session sent to a prefill node moves on to decode elsewhere only if it may generate"
        " at least this many tokens after its prompt",
        type=non_negative_int,
    )
    speculative: str = option(
        "lookup",
        "speculative decoding: 'lookup' drafts from the session's own tokens, a path drafts with"
        " that model (the served model's vocabulary), 'off' decodes a token a step; the output"
        " is the same, token for token",
        metavar="lookup|off|PATH",
        type=speculative_arg,
    )
    last_hop_picks: bool = option(
        True,
        "a reply's route's last node picks each token (greedy or by the seeded sampler) and"
        " sends the token, not its hidden state, where that node holds the model's head;"
        " --no-last-hop-picks: the client computes the logits itself (the same tokens)",
        action=argparse.BooleanOptionalAction,
    )


@dataclass(frozen=True)
class Sampling:
    """How a reply's next token is picked from the logits: greedy unless temperature > 0."""

    temperature: float = option(
        0.0,
        "0: the most likely token (greedy); above: sample, flatter the higher",
        type=non_negative_float,
    )
    top_p: float = option(
        1.0,
        "sample from the fewest most likely tokens whose probabilities reach this (nucleus)",
        type=bounded(float, above=0.0, high=1.0),
    )
    top_k: int = option(
        0, "sample from this many most likely tokens (0: all)", type=non_negative_int
    )
    seed: int | None = option(
        None,
        "seed of the sampler's random draws (default: a new one each reply)",
        type=bounded(int, 0, 2**64 - 1),
        metavar="N",
    )


def split_options(keywords: dict[str, Any]) -> tuple[ClientOptions, Sampling]:
    """`generate()`'s keywords: those of Sampling, and the Client's (a TypeError names any
    keyword that is neither)."""
    names = {f.name for f in fields(Sampling)}
    sampling = {k: v for k, v in keywords.items() if k in names}
    client = {k: v for k, v in keywords.items() if k not in names}
    return ClientOptions(**client), Sampling(**sampling)
