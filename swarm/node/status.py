"""A node's figures at one moment (`Status`), read in one place, and its periodic status line:
short and human at INFO, every figure at DEBUG. The DHT record announces the same figures."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from swarm.model.kvcache import KVCache
from swarm.node.borrow import local_tokens, longest_borrowing, session_room
from swarm.node.borrow_link import lenders_of
from swarm.records import DEFAULT_WEIGHTS, MAX_TOKENS

if TYPE_CHECKING:
    from swarm.node.server import Node

log = logging.getLogger("swarm.node")

STATUS_INTERVAL = 30.0


@dataclass(frozen=True)
class Status:
    """What a node can tell about itself now; `Status()` is a node not serving yet (it announces
    that while it joins)."""

    sessions: int = 0
    free_cache_tokens: int = 0  # what a newcomer could reserve now
    tokens: int = 0  # computed since the node started (prompt and decode, through the whole span)
    link: dict[str, float] = field(default_factory=dict)  # the uplink's (bandwidth_Bps, ...)
    refused: int = 0  # opens and connections turned away for want of room or share, so far
    evicted: int = 0  # sessions that gave their place to a newcomer, so far
    throttled_hosts: int = 0  # addresses either happened to
    throttled: int = 0  # refusals and evictions in the last minute
    throughput: float = 0.0  # tokens/s through the whole span
    weights: str = DEFAULT_WEIGHTS  # the format the span computes with
    decode_batch: float = 1.0  # decode steps per decode pass, on average
    decode_passes: int = 0  # since the node started
    prompt_passes: int = 0  # since the node started (a replayed session costs some)
    moved_in: int = 0  # sessions handed over to this node by leaving ones, so far
    moved_out: int = 0  # sessions this node handed over to replicas, so far
    transfers: int = 0  # caches being handed over, either way, now
    rounds: int = 0  # verification rounds computed, so far (speculative decoding)
    rounds_dropped: int = 0  # of those sent here, dropped uncomputed: a rejection made them stale
    lent_mb: float = 0.0  # KV blocks it holds for other nodes' sessions, now
    borrowing: int = 0  # its sessions whose oldest KV blocks are at a lender, now
    lend_free_mb: float = 0.0  # what one more borrowing node could get here, now
    cache_tokens: int = 0  # what one session may keep here (session_room): longer ones borrow
    session_tokens: int = 0  # --max-session-tokens: it takes no longer session
    borrow_tokens: int = 0  # the longest session it could take now by borrowing (0: none)


def status_of(node: Node) -> Status:
    """`node`'s figures now."""
    throttle, free = node.throttle, node.sessions.free_cache_tokens
    return Status(
        sessions=len(node.sessions),
        free_cache_tokens=free,
        tokens=node.tokens_done,
        link=node.uplink.stats(),
        refused=throttle.refused,
        evicted=throttle.evicted,
        throttled_hosts=len(throttle.hosts),
        throttled=throttle.recent(time.monotonic()),
        throughput=node.throughput,
        weights=node.span.format,
        decode_batch=node.compute.mean_decode_batch,
        decode_passes=node.compute.decode_passes,
        prompt_passes=node.counters.prompt_passes,
        moved_in=node.counters.moved_in,
        moved_out=node.counters.moved_out,
        transfers=node.counters.transfers,
        rounds=node.counters.rounds_done,
        rounds_dropped=node.counters.steps_dropped,
        lent_mb=node.lends.lent_bytes / 2**20,
        borrowing=sum(1 for s in node.sessions if s.lender is not None and s.lender.lending),
        lend_free_mb=node.lends.free_for_one / 2**20,
        cache_tokens=min(session_room(node.config.limits), MAX_TOKENS),
        session_tokens=min(node.config.limits.max_session_tokens, MAX_TOKENS),
        borrow_tokens=borrowable(node, free),
    )


def may_borrow(node: Node) -> bool:
    """Some session could borrow here: --max-session-tokens allows one longer than one session
    may keep here (session_room), and the model's cache can be split (local_tokens)."""
    lim = node.config.limits
    if lim.max_session_tokens <= session_room(lim):
        return False
    return local_tokens(node.span.config, lim, lim.max_session_tokens) is not None


def borrowable(node: Node, free: int) -> int:
    """The longest session `node` could take now by borrowing (0: none), with `free` cache
    tokens a newcomer could reserve. Such a session, longer than one session may keep here
    (`session_room`: the cache, or an address's share of it if less), keeps `local_tokens`
    positions here (half the cache, or that share if less, whatever its length: they must be
    free) and lends the rest to one lender, which keeps all of them:
    the lender offering one borrower the most (`lend_free_mb`) among those last read bounds
    it, each position costing the bytes of every layer of the span; --max-session-tokens
    bounds it too. Records are seconds old and the lender is chosen by round trip: a figure
    to route by, not a promise."""
    lim, span = node.config.limits, node.span
    if not may_borrow(node):
        return 0
    cap = local_tokens(span.config, lim, lim.max_session_tokens) or 0
    if cap > free:
        return 0
    per_token = KVCache.bytes_per_token(
        span.config, span.end - span.start, span.cache_dtype, span.start
    )
    lenders = lenders_of(node.directory.records(), node.key.peer, node.directory.plaintext)
    most = max((r.lend_free_mb for r in lenders), default=0.0)
    lendable = int(most * 2**20) // per_token
    longest = min(lim.max_session_tokens, MAX_TOKENS, longest_borrowing(cap, lendable))
    return longest if longest > session_room(lim) else 0


def status_line(now: Status, before: Status, seconds: float) -> str:
    """E.g. `3 sessions, 41.2 tokens/s, link 4.8 Mbit/s, RTT 23 ms`, then the speculative
    decoding rounds checked and what admission turned away since `before`, if anything."""
    rate = (now.tokens - before.tokens) / seconds if seconds > 0 else 0.0
    bandwidth = now.link.get("bandwidth_Bps", 0.0)
    rtt = now.link.get("rtt_s", 0.0)
    link = (
        f"link {bandwidth * 8 / 1e6:.1f} Mbit/s, RTT {rtt * 1000:.0f} ms"
        if bandwidth > 0 or rtt > 0
        else "link not measured yet"
    )
    s = "" if now.sessions == 1 else "s"
    line = f"{now.sessions} session{s}, {rate:.1f} tokens/s, {link}"
    rounds, dropped = now.rounds - before.rounds, now.rounds_dropped - before.rounds_dropped
    if rounds or dropped:
        line += f", {rounds} verification rounds ({dropped} more dropped stale)"
    if now.lent_mb or now.borrowing:
        line += f", KV lent here {now.lent_mb:.1f} MB, {now.borrowing} sessions borrowing"
    refused, evicted = now.refused - before.refused, now.evicted - before.evicted
    if refused or evicted:
        line += (
            f"; throttled: {refused} refused, {evicted} evicted in {seconds:.0f} s"
            f" ({now.throttled_hosts} addresses so far)"
        )
    return line


async def log_status(read: Callable[[], Status], interval: float = STATUS_INTERVAL) -> None:
    """Every `interval` seconds, log `read()`'s Status as one line (and all of it at DEBUG)."""
    before = read()
    while True:
        await trio.sleep(interval)
        now = read()
        log.info("%s", status_line(now, before, interval))
        if log.isEnabledFor(logging.DEBUG):
            figures = {k: round(v, 4) for k, v in now.link.items()}
            log.debug("free cache %d tokens, link %s", now.free_cache_tokens, figures)
        before = now
