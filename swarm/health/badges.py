"""The badges beside a node's figures on the health page: what it turned away, moved, lends and
borrows (or could), the longest session it takes, its role, and what clients reported of it.
Every string from a record is escaped."""

from __future__ import annotations

from html import escape

from swarm.records import BOTH, DECODE, MAX_TTL_S, PREFILL, NodeRecord, Reported, format_blocks


def throttled(n: int) -> str:
    if n <= 0:
        return ""
    return (
        ' <span class="warn throttled" title="opens and connections refused, sessions evicted,'
        f' in the last minute: someone wants more than a fair share">· {n:,} turned away</span>'
    )


def moved(r) -> str:
    """Sessions whose caches moved between nodes (a leaving node hands them over)."""
    if not (r.moved_in or r.moved_out or r.transfers):
        return ""
    parts = [f"{r.moved_in} in", f"{r.moved_out} out"]
    if r.transfers:
        parts.append(f"{r.transfers} moving")
    return (
        ' <span class="muted moved" title="sessions handed over with their caches by leaving'
        f' nodes (in) and to replicas (out), and transfers in flight">· moved'
        f" {', '.join(parts)}</span>"
    )


def role(role: str) -> str:
    if role == BOTH:
        return ""
    title = {
        PREFILL: "takes long prompts, then hands each session with its cache to a decode node",
        DECODE: "decodes; takes no prompts meant for prefill nodes",
    }.get(role, "")
    return f' <span class="badge role" title="{title}">{escape(role)}</span>'


def reported(r: Reported | None) -> str:
    if r is None:
        return ""
    k = len(r.reporters)
    title = (
        f"clients' checks (signed by {k} distinct key{'s' if k != 1 else ''}) found its"
        f" activations outvoted by other routes on blocks {format_blocks(r.blocks)} in the last"
        f" {MAX_TTL_S / 60:.0f} min; anyone can make a key: a signal, not a verdict"
    )
    return f' <span class="badge reported warn" title="{escape(title)}">reported by {k}</span>'


def kv_lending(r: NodeRecord) -> str:
    """KV blocks it holds for other nodes' sessions, and its sessions whose oldest blocks are
    elsewhere (swarm.node.lender, swarm.node.borrow)."""
    if not (r.lent_mb or r.borrowing):
        return ""
    parts = []
    if r.lent_mb:
        parts.append(f"lends {r.lent_mb:,.1f} MB")
    if r.borrowing:
        parts.append(f"{r.borrowing} borrowing")
    return (
        ' <span class="muted lending" title="KV blocks it holds for other nodes\' sessions'
        ' (lends), and its sessions whose oldest KV blocks are at a lender (borrowing)">'
        f"· {', '.join(parts)}</span>"
    )


def borrowable(r: NodeRecord) -> str:
    """The longest session it could take now by lending its oldest KV blocks to another node,
    beside its free cache where that is more (swarm.node.status.borrowable)."""
    if r.borrow_tokens <= r.free_cache_tokens:
        return ""
    return (
        ' <span class="muted borrowable" title="the longest session it could take now, keeping'
        ' part of its cache and lending the oldest KV blocks to another node">'
        f"· {r.borrow_tokens:,} by borrowing</span>"
    )


def session_cap(r: NodeRecord) -> str:
    """The longest session it takes (`--max-session-tokens`), beside its free cache where that
    is less: a route for a longer session goes elsewhere (swarm.client.routing)."""
    if not 0 < r.session_tokens < max(r.free_cache_tokens, r.borrow_tokens):
        return ""
    return (
        ' <span class="muted session-cap" title="the longest session it takes'
        ' (--max-session-tokens)">'
        f"· {r.session_tokens:,} a session at most</span>"
    )
