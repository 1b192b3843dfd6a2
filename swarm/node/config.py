"""Everything a node is told at start-up: typed option groups, each option declared once.

Each field says its default, its help and, where the command line names it differently, its
flag (swarm/options.py); the parser is derived from the fields. The link scheduler's options
are its own (swarm/link/options.py), the flags every program shares are swarm/cli.py's.
The tuning knobs, measured defaults that experiments vary, get their own `--help` group.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields

from swarm.cli import initial_peers_option, model_option, wire_dtype_option
from swarm.link.options import LinkOptions
from swarm.model.linear import WEIGHT_FORMATS
from swarm.options import (
    add_option,
    input_terms_arg,
    is_option,
    nice_steps,
    non_negative_float,
    non_negative_int,
    option,
    port_number,
    positive_float,
    positive_int,
    read_option,
)
from swarm.records import BOTH, CACHE, MAX_TTL_S, PREFILL, ROLES
from swarm.wire import DEFAULT_MAX_FRAME


def record_ttl(text: str) -> float:
    value = float(text)
    if not 0 < value <= MAX_TTL_S:  # NaN too
        raise argparse.ArgumentTypeError(
            f"must be in (0, {MAX_TTL_S:g}]: the swarm's DHT peers refuse longer-lived records"
        )
    return value


PASS_ORDERS = ("shortest", "round-robin")  # how the prompt lane orders passes (swarm.node.compute)


@dataclass(frozen=True)
class Limits:
    """What keeps a node's memory, connections and lifetime bounded."""

    max_sessions: int = option(64, "sessions served at once", type=positive_int)
    max_cache_tokens: int = option(
        32768, "KV-cache tokens this node holds across all sessions", type=positive_int
    )
    max_session_tokens: int = option(
        8192,
        "longest session this node takes; one longer than --max-host-cache-tokens (or"
        " --max-cache-tokens, if less) keeps at most that many here and borrows KV blocks"
        " for the rest from other nodes",
        type=positive_int,
    )
    # KV blocks this node holds for sessions of other nodes short of cache (swarm.node.lender)
    max_lend_mb: float = option(
        256.0,
        "memory for KV blocks lent to other nodes' sessions (0: lend none)",
        flag="--max-lend",
        type=non_negative_float,
        metavar="MB",
    )
    max_lend_host_mb: float = option(
        128.0,
        "of --max-lend, what one borrowing node may hold",
        flag="--max-lend-host",
        type=non_negative_float,
        metavar="MB",
    )
    max_frame: int = option(
        DEFAULT_MAX_FRAME, "largest frame accepted, in bytes", type=positive_int
    )
    # one source address (a host, or everyone behind one NAT) gets at most these shares, so a
    # flood from one host leaves room for the others
    max_host_sessions: int = option(16, "sessions one source address may hold", type=positive_int)
    max_host_cache_tokens: int = option(
        8192,
        "KV-cache tokens one source address may reserve; also the most one session keeps here"
        " (a longer one borrows)",
        type=positive_int,
    )
    # the node before this one on a route forwards many users' sessions, each in its user's
    # share (swarm.node.admission); all of them together get at most half the node
    max_forwarded_sessions: int = option(
        32,
        "sessions the previous node of their routes may forward here, all users together",
        type=positive_int,
    )
    max_forwarded_cache_tokens: int = option(
        16384,
        "KV-cache tokens the previous node of their routes may reserve here",
        type=positive_int,
    )
    max_connections: int = option(256, "inbound connections at once", type=positive_int)
    max_host_connections: int = option(
        32, "inbound connections from one source address", type=positive_int
    )
    max_relayed: int = option(
        8,
        "nodes nobody can dial this node relays for, when others can dial it (0: none)",
        type=non_negative_int,
    )
    # a client may load its LM head between the open and its first step: seconds on a busy PC
    open_deadline_s: float = option(
        30.0,
        "drop a session not attached or stepped this many seconds after it opened",
        flag="--open-deadline",
        type=positive_float,
    )
    evict_idle_s: float = option(
        5.0,
        "when the node is full, a session idle this long (or opened this long ago and unused)"
        " gives its place to a newcomer",
        flag="--evict-idle",
        type=non_negative_float,
    )
    session_idle_s: float = option(
        300.0,
        "close a session after this many idle seconds",
        flag="--session-idle",
        type=positive_float,
    )
    connection_idle_s: float = option(
        60.0,
        "close a connection without sessions after this many idle seconds",
        flag="--connection-idle",
        type=positive_float,
    )
    open_timeout_s: float = 60.0  # how long the next hop may take to answer an open
    announce_ttl_s: float = option(
        30.0,
        f"seconds a DHT record lives unless refreshed (at most {MAX_TTL_S:g})",
        flag="--announce-ttl",
        type=record_ttl,
    )
    grace_s: float = option(
        30.0,
        "on SIGTERM, seconds open sessions may finish or be handed over, the whole drain",
        flag="--grace",
        type=non_negative_float,
    )
    handover: str = option(
        "on",
        "when leaving, move each session's cache to a replica serving its blocks (on), or let"
        " its client replay it elsewhere (off)",
        choices=("on", "off"),
    )


@dataclass(frozen=True)
class ComputeConfig:
    """How forward passes share the CPU: lanes, priorities, and how prompts become passes."""

    lanes: int = option(
        2,
        "2: decode steps and prompt passes in separate threads; 1: one thread, decode first",
        flag="--compute-lanes",
        choices=[1, 2],
    )
    prefill_nice: int = option(
        3,
        "how many nice steps the prompt-pass thread runs below the node's own (0-19; more"
        " yields the CPU to decode steps sooner, at the cost of time to first token)",
        type=nice_steps,
    )
    prefill_order: str = option(
        "shortest",
        "which waiting prompt's pass computes next: the one needing the least compute left,"
        " less the time it has waited (lower mean time to first token), or in turns",
        flag="--prefill-compute-order",
        choices=list(PASS_ORDERS),
    )
    pass_tokens: int = option(
        64,
        "most prompt tokens per forward pass; a decode step waits behind at most one pass",
        flag="--prefill-pass-tokens",
        type=positive_int,
    )
    min_pass_tokens: int = option(
        32,
        "a prompt pass waits (up to --prefill-gather-ms) for this many tokens to arrive, unless"
        " the prompt's end has: each pass has a fixed cost, and a slow link delivers a prompt a"
        " few tokens at a time (1: never waits)",
        flag="--prefill-min-pass-tokens",
        type=positive_int,
    )
    gather_s: float = option(
        0.4,
        "longest a prompt pass waits for --prefill-min-pass-tokens",
        flag="--prefill-gather-ms",
        ms=True,
    )
    spread_tokens: int = option(
        4096,
        "a prompt of at least this many tokens ready at once is computed in one pass, its"
        " later rows by a replica of this node's blocks alongside (0: never)",
        flag="--spread-prompt-tokens",
        type=non_negative_int,
    )
    max_batch: int = option(
        4,
        "most decode steps of different sessions computed as one pass (1: each alone)",
        type=positive_int,
    )
    decode_gather: str = option(
        "measured",
        "measured: a decode pass whose lane is free waits for other sessions' steps due"
        " sooner than the pass's fixed cost (times measured here), so few sessions share"
        " passes; off: a pass takes only what waits",
        choices=["measured", "off"],
    )


@dataclass(frozen=True)
class NodeConfig:
    start: int | None  # blocks start:end, from --layers START:END; None: chosen from the swarm
    end: int | None
    model: str | None = model_option()
    weights: str = option(
        "auto",
        "how the node holds its weights: auto keeps the file's own quantization (GGUF Q4 as"
        " packed int4, Q5-Q8 as int8, float as bfloat16); float32 is the exact mode that"
        " matches transformers token for token (4-8x the memory)",
        choices=WEIGHT_FORMATS,
    )
    input_terms: int | None = option(
        None,
        "int8 terms in which swarm's quantized matmuls take their inputs: 1, llama.cpp's"
        " precision (the default model's top-1 agreement with float32 0.956), or 2 (0.997,"
        " perplexity the same; passes of several rows cost up to 1.9x the time);"
        " auto (the default): 1",
        type=input_terms_arg,
        metavar="auto|1|2",
    )
    initial_peers: tuple[str, ...] = initial_peers_option(new_swarm=True)
    host: str = option("127.0.0.1", "data-plane listen address")
    port: int = option(0, "data-plane port (0: any free port)", type=port_number)
    public_address: str | None = option(
        None, "announce this address instead (a relay or NAT mapping)", metavar="HOST:PORT"
    )
    dht_host: str = option("127.0.0.1", "address the DHT listens on")
    relay: str = option(
        "auto",
        "reach this node through another node: auto when others cannot dial its address (found"
        " out at start), always (to measure the relayed path), never",
        choices=("auto", "always", "never"),
    )
    plaintext: bool = option(
        False,
        "an experiment: no TLS on this node's connections (its record and the health page"
        " say so; clients use it only if asked to, TLS nodes never forward to it)",
        action="store_true",
    )
    wire_dtype: str | None = wire_dtype_option(None, "the model's")
    role: str = option(
        BOTH,
        "prefill: take long prompts and hand each session, cache and all, to a decode node"
        " serving the same blocks once its prompt is in (clients route decoding elsewhere);"
        " decode: take no such prompts; both: take everything; cache: serve no blocks, lend"
        " memory (--max-lend) to other nodes' sessions for their KV blocks",
        choices=ROLES,
    )
    threads: int = option(1, "torch threads for compute", type=positive_int)
    dht_nice: int = option(
        10,
        "how many nice steps the DHT process (announcements, lookups) runs below the node's own"
        " (0-19; more leaves the CPU to compute)",
        type=nice_steps,
    )
    num_blocks: int | None = option(
        None,
        "without --layers: serve this many blocks where the swarm is thinnest"
        " (default: as many as --max-memory or the free memory allows)",
        type=positive_int,
        metavar="N",
    )
    max_memory_mb: float | None = option(
        None,
        "without --layers or --num-blocks: memory for blocks and their KV cache, and the head"
        " where the span ends the model (default: 3/4 of the memory free at start)",
        flag="--max-memory",
        type=non_negative_float,
        metavar="MB",
    )
    rebalance_s: float = option(
        60.0,
        "without --layers: how often to check whether moving to other blocks fills a gap"
        " the node would not open (0: never move)",
        flag="--rebalance-interval",
        type=non_negative_float,
        metavar="SECONDS",
    )
    limits: Limits = field(default_factory=Limits)
    link: LinkOptions = field(default_factory=LinkOptions)
    compute: ComputeConfig = field(default_factory=ComputeConfig)

    @property
    def automatic_span(self) -> bool:
        return self.start is None


GROUPS = {  # section of --help for each part of NodeConfig
    "": "node",
    "limits": "limits",
    "link": "tuning (experiments; the defaults are the measured best)",
    "compute": "tuning (experiments; the defaults are the measured best)",
}
TUNING = ("dht_nice",)  # top-level fields that belong with the tuning knobs


def parse_layers(text: str) -> tuple[int, int]:
    try:
        a, b = text.split(":")
        start, end = int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--layers wants START:END (half-open), got {text!r}"
        ) from None
    if not 0 <= start < end:  # the model's layer count is known only once it loads
        raise argparse.ArgumentTypeError(f"need 0 <= START < END, got {text!r}")
    return start, end


def _options(cls, prefix: str = ""):
    """(dest, field, group name) of every option of `cls` and its groups, in order."""
    for f in fields(cls):
        if f.default_factory is not MISSING and f.name in GROUPS:
            yield from _options(f.default_factory, f"{f.name}.")
        elif is_option(f):
            group = GROUPS[prefix.rstrip(".")]
            if f.name in TUNING:
                group = GROUPS["link"]
            yield prefix + f.name, f, group


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m swarm.node", description="Serve a span of a model's layers to the swarm."
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for name in dict.fromkeys(GROUPS.values()):
        groups[name] = p.add_argument_group(name)
    groups["node"].add_argument(
        "--layers",
        type=parse_layers,
        default=None,
        help="START:END, half-open (default: chosen where the swarm is thinnest, and moved"
        " when the swarm changes)",
    )
    for dest, f, group in _options(NodeConfig):
        add_option(groups[group], f.name, f, dest)
    groups[GROUPS["link"]].add_argument(
        "--no-link-pacing", dest="link.pacing", action="store_const", const="off"
    )
    return p


def parse_args(argv: list[str] | None = None) -> NodeConfig:
    ns = vars(build_parser().parse_args(argv))
    values: dict[str, dict] = {"": {}, "limits": {}, "link": {}, "compute": {}}
    for dest, f, _ in _options(NodeConfig):
        group, _, name = dest.rpartition(".")
        values[group][name] = read_option(f, ns[dest])
    start, end = ns["layers"] or (None, None)
    if ns["role"] == CACHE and ns["layers"]:
        build_parser().error("--role cache serves no blocks: it takes no --layers")
    if ns["role"] == PREFILL and ns["limits.handover"] == "off":
        build_parser().error("--role prefill hands every session on: it needs --handover on")
    return NodeConfig(
        start=start,
        end=end,
        **values[""],
        limits=Limits(**values["limits"]),
        link=LinkOptions(**values["link"]),
        compute=ComputeConfig(**values["compute"]),
    )
