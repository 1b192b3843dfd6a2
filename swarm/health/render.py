"""The health page as one server-rendered HTML document: inline CSS, no script, no external asset.

Every string that came from the DHT goes through `html.escape`: records are written by strangers.
"""

from __future__ import annotations

import time
from html import escape

from swarm.health.badges import (
    borrowable,
    kv_lending,
    moved,
    reported,
    role,
    session_cap,
    throttled,
)
from swarm.health.snapshot import EXPIRED, ModelView, NodeView, Snapshot, short_peer
from swarm.records import format_blocks

# numbers inside the bar's cells stop fitting beyond this many blocks; the tooltip keeps them
MAX_LABELLED_BLOCKS = 48
GROUP_FROM = 24  # more nodes than this: one collapsed table per span, so the page stays short

CSS = """
:root{color-scheme:light dark;--ok:#188038;--warn:#b06000;--bad:#d93025;--muted:#5f6368;
--bg:#fff;--fg:#1f2328;--card:#f3f4f6;--line:#dfe1e5;--accent:#1a73e8}
@media (prefers-color-scheme:dark){:root{--ok:#5bb974;--warn:#fcad70;--bad:#f28b82;
--muted:#9aa0a6;--bg:#121417;--fg:#e8eaed;--card:#1d2126;--line:#30363d;--accent:#8ab4f8}}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);
font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif}
header,main,footer{max-width:1280px;margin:0 auto;padding:10px 16px}
h1{font-size:1.45rem;margin:.3em 0 .1em}
h2{font-size:1.2rem;margin:.9em 0 .2em;overflow-wrap:anywhere}
h2 small{font-weight:400;color:var(--muted);font-size:.8rem}
.meta{color:var(--muted);font-size:.88rem;margin:.2em 0}
.alert{border-left:4px solid var(--bad);background:var(--card);padding:6px 10px;margin:8px 0}
.stats{display:grid;grid-template-columns:repeat(auto-fit,minmax(150px,1fr));gap:8px;margin:10px 0}
.stat{background:var(--card);border-radius:8px;padding:8px 12px}
.stat span{display:block;color:var(--muted);font-size:.78rem;text-transform:uppercase;
letter-spacing:.03em}
.stat b{font-size:1.15rem;overflow-wrap:anywhere}
.ok{color:var(--ok)}.bad{color:var(--bad)}.warn{color:var(--warn)}.muted{color:var(--muted)}
.bar{display:flex;height:36px;border-radius:6px;overflow:hidden;border:1px solid var(--line)}
.bar i{flex:1 1 0;min-width:0;display:flex;align-items:center;justify-content:center;
font-style:normal;font-size:.75rem;font-weight:600;border-right:1px solid var(--bg)}
.bar i:last-child{border-right:0}
.c0{background:var(--bad);color:#fff}.c1{background:#fbbc04;color:#202124}
.c2{background:#81c995;color:#0d3b1e}.c3{background:#188038;color:#fff}
.axis{display:flex;justify-content:space-between;color:var(--muted);font-size:.75rem;margin-top:2px}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;color:var(--muted);font-size:.8rem;margin:6px 0}
.legend i{display:inline-block;width:.9em;height:.9em;border-radius:2px;vertical-align:-.1em;
margin-right:4px}
.gaps{font-weight:600}
.tablewrap{overflow-x:auto;margin-top:8px}
details.group{font-size:inherit;color:inherit;margin-top:6px}details.group>summary{padding:4px 0}
table{border-collapse:collapse;width:100%;font-size:.86rem}
th,td{text-align:left;padding:6px 8px;border-bottom:1px solid var(--line);vertical-align:top}
th{color:var(--muted);font-weight:600;white-space:nowrap}
td.num{text-align:right;white-space:nowrap}
code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:.92em}
.span{position:relative;height:6px;background:var(--line);border-radius:3px;margin-top:4px;
min-width:70px}
.span i{position:absolute;top:0;bottom:0;background:var(--accent);border-radius:3px}
.badge{display:inline-block;padding:0 8px;border-radius:10px;font-size:.8rem;font-weight:600;
white-space:nowrap;background:var(--card)}
.s-online{color:var(--ok)}.s-joining{color:var(--warn)}.s-offline,.s-expired{color:var(--muted)}
.s-unreachable{color:#fff;background:var(--bad)}
tr.gone{opacity:.6}
.link{white-space:nowrap}
details{font-size:.8rem;color:var(--muted)}summary{cursor:pointer}
@media (max-width:760px){
header,main,footer{padding:8px 10px}
table,tbody,tr,td{display:block;width:100%}
thead{display:none}
tr{border:1px solid var(--line);border-radius:8px;margin:8px 0;padding:4px 10px}
td{border:0;display:flex;gap:10px;padding:3px 0;text-align:left}
td.num{text-align:left}
td::before{content:attr(data-label);color:var(--muted);flex:0 0 7.2em}
td>div{flex:1;min-width:0}
.bar{height:28px}.bar i{font-size:0}
}
"""

# what the issue asks to see of a node's link; any other figure goes behind "N more"
HEADLINE_LINK_KEYS = (
    "bandwidth_Bps",
    "rtt_s",
    "queue_delay_s",
    "decode_delay_p99_s",
    "decode_queued_bytes",
    "prefill_queued_bytes",
)

COLUMNS = (
    "Peer",
    "Address",
    "Span",
    "State",
    "Version",
    "Weights",
    "Throughput",
    "Free cache",
    "Sessions",
    "Link (reported)",
    "RTT (measured)",
    "Refreshed",
)


def render_page(snapshot: Snapshot, refresh_seconds: int) -> str:
    """The whole page for one snapshot."""
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width,initial-scale=1">',
        f'<meta http-equiv="refresh" content="{int(refresh_seconds)}">',
        "<title>swarm health</title>",
        f"<style>{CSS}</style></head><body>",
        "<header><h1>swarm health</h1>",
        _meta(snapshot, int(refresh_seconds)),
        "</header><main>",
    ]
    if not snapshot.models:
        parts.append(
            '<p class="muted" id="empty">No models found on the DHT yet. Nodes announce'
            " themselves within seconds of starting.</p>"
        )
    for model in snapshot.models:
        parts.append(_model_section(model))
    parts.append(
        '</main><footer class="meta">The same data as JSON: <a href="/api/v1/state">'
        f"/api/v1/state</a> · swarm {escape(snapshot.version)}</footer></body></html>"
    )
    return "".join(parts)


def _meta(s: Snapshot, refresh_seconds: int) -> str:
    d = s.dht
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(s.taken_at))
    items = [f'Snapshot <time id="taken">{when}</time>']
    if d.state == "ok":
        items.append(f'DHT <span class="ok">ok</span>, read in {_duration(d.read_seconds)}')
    elif d.state == "starting":
        items.append('DHT <span class="warn">joining…</span>')
    else:
        items.append('DHT <span class="bad">failing</span>')
    items.append(
        f"DHT read every {s.refresh_interval:g} s · page reloads every {refresh_seconds} s"
    )
    if s.skipped_records:
        items.append(
            f'<span class="warn" id="skipped">{s.skipped_records} malformed or foreign'
            " DHT records skipped</span>"
        )
    out = f'<p class="meta">{" · ".join(items)}</p>'
    if d.error:
        stale = ""
        if d.last_ok is not None:
            stale = f" Showing what was read {_age(s.taken_at - d.last_ok)} ago."
        out += f'<p class="alert">{escape(d.error)}.{stale}</p>'
    return out


def _model_section(m: ModelView) -> str:
    name = escape(m.model.model)
    gaps = m.gaps
    online = sum(1 for n in m.nodes if n.usable)
    route = (
        '<b class="ok" id="route">yes</b>' if m.full_route else '<b class="bad" id="route">no</b>'
    )
    gap_text = ", ".join(f"{a}" if b == a + 1 else f"{a}–{b - 1}" for a, b in gaps)
    stats = [
        ("Full route now", route),
        ("Throughput", f"<b>{_num(m.throughput)} tok/s</b>"),
        ("Nodes usable", f"<b>{online}</b> <small class='muted'>of {len(m.nodes)}</small>"),
        (
            "Gaps",
            f'<b class="bad gaps">blocks {gap_text}</b>' if gaps else '<b class="ok">none</b>',
        ),
    ]
    if m.unreachable:
        stats.append(("Unreachable", f'<b class="bad">{m.unreachable}</b>'))
    stat_html = "".join(f'<div class="stat"><span>{k}</span>{v}</div>' for k, v in stats)
    return (
        f'<section class="model" data-model="{name}">'
        f"<h2>{name} <small>{escape(m.model.arch) + ' · ' if m.model.arch else ''}"
        f"{m.model.num_layers} blocks · fingerprint "
        f"<code>{escape(m.model.fingerprint[:16])}</code></small></h2>"
        f'<div class="stats">{stat_html}</div>'
        f"{_bar(m)}{_table(m)}</section>"
    )


def _bar(m: ModelView) -> str:
    n = len(m.coverage)
    label = n <= MAX_LABELLED_BLOCKS
    cells = []
    for b, count in enumerate(m.coverage):
        tip = f"block {b}: {count} node{'s' if count != 1 else ''}"
        text = str(count) if label else ""
        cells.append(f'<i class="c{min(count, 3)}" title="{tip}" data-count="{count}">{text}</i>')
    summary = "every block served" if not m.gaps else f"gaps at blocks {format_blocks(m.gaps)}"
    mid = f"<span>{n // 2}</span>" if n >= 4 else ""
    return (
        f'<div class="bar" role="img" aria-label="nodes per block; {summary}">{"".join(cells)}'
        f'</div><div class="axis"><span>0</span>{mid}<span>{n}</span></div>'
        '<div class="legend"><span><i class="c0"></i>no node (gap)</span>'
        '<span><i class="c1"></i>1 node</span><span><i class="c2"></i>2 nodes</span>'
        '<span><i class="c3"></i>3+ nodes</span></div>'
    )


def _table(m: ModelView) -> str:
    if not m.nodes:
        return '<p class="muted">No node records.</p>'
    if len(m.nodes) <= GROUP_FROM:
        return _node_table(m.nodes, m.model.num_layers)
    return "".join(_group(nodes, m.model.num_layers) for nodes in _by_span(m.nodes))


def _node_table(nodes, num_layers: int) -> str:
    head = "".join(f"<th>{c}</th>" for c in COLUMNS)
    rows = "".join(_row(n, num_layers) for n in nodes)
    return (
        f'<div class="tablewrap"><table><thead><tr>{head}</tr></thead>'
        f"<tbody>{rows}</tbody></table></div>"
    )


def _by_span(nodes) -> list[list[NodeView]]:
    """The nodes in runs of one span each, in the view's order (sorted by span)."""
    groups: dict[tuple[int, int], list[NodeView]] = {}
    for n in nodes:
        groups.setdefault((n.record.start, n.record.end), []).append(n)
    return list(groups.values())


def _group(nodes: list[NodeView], num_layers: int) -> str:
    """One span's nodes under a line that sums them up; the rows open on demand (no script),
    and open already where a node is not usable, so trouble shows at a glance."""
    r = nodes[0].record
    usable = sum(1 for n in nodes if n.usable)
    throughput = sum(n.record.throughput for n in nodes if n.usable)
    sessions = sum(n.record.sessions for n in nodes if n.usable)
    trouble = usable < len(nodes)
    summary = (
        f'<span class="spantext">blocks {r.start}:{r.end}</span> · {len(nodes)} nodes'
        f" ({usable} usable) · {_num(throughput)} tok/s · {sessions} sessions"
    )
    return (
        f'<details class="group" data-span="{r.start}:{r.end}"{" open" if trouble else ""}>'
        f"<summary>{summary}</summary>{_node_table(nodes, num_layers)}</details>"
    )


def _row(n: NodeView, num_layers: int) -> str:
    r = n.record
    left = 100.0 * r.start / max(num_layers, 1)
    width = 100.0 * (min(r.end, num_layers) - r.start) / max(num_layers, 1)
    state = f'<span class="badge s-{escape(n.state)}">{escape(n.state)}</span>'
    if not n.fingerprint_ok:
        state += (
            ' <span class="badge s-unreachable" title="fingerprint differs from the model">'
            "other weights</span>"
        )
    state += reported(n.reported) + role(r.role)
    if n.reach is None:
        rtt = '<span class="muted">—</span>'
    elif n.reach.reachable:
        rtt = _duration(n.reach.rtt_s)
    else:
        rtt = (
            f'<span class="badge s-unreachable" title="{escape(n.reach.error or "")}">'
            f"unreachable</span>"
        )
    if n.state == EXPIRED:
        refreshed = f"{_age(n.updated_ago_s)} ago <span class='muted'>(expired)</span>"
    else:
        refreshed = f"{_age(n.updated_ago_s)} ago"
    addr = f"<code>{escape(r.addr)}</code>"
    if r.relay:
        addr += (
            f' <span class="badge" title="nobody can dial it; relayed by {escape(r.relay)}">'
            f"via relay {escape(short_peer(r.relay))}</span>"
        )
    if not r.tls:
        addr += (
            ' <span class="badge s-unreachable" title="run with --plaintext: its traffic is'
            ' not encrypted">plaintext</span>'
        )
    cells = [
        f'<code title="{escape(r.peer)}">{escape(n.short_peer)}</code>',
        addr,
        f'<span class="spantext">{r.start}:{r.end}</span><div class="span">'
        f'<i style="left:{left:.2f}%;width:{width:.2f}%"></i></div>',
        state,
        escape(r.version[:32]),
        f"<code>{escape(r.weights)}</code>",
        f"{_num(r.throughput)} tok/s",
        f"{r.free_cache_tokens:,}" + session_cap(r) + borrowable(r) + kv_lending(r),
        f'{r.sessions} <span class="muted" title="decode steps per pass, on average">'
        f"· batch {r.decode_batch:.1f}</span>" + throttled(r.throttled) + moved(r),
        _link(r.link),
        rtt,
        refreshed,
    ]
    num = {"Throughput", "Free cache", "Sessions", "RTT (measured)"}
    tds = "".join(
        f'<td data-label="{c}"{" class=num" if c in num else ""}><div>{v}</div></td>'
        for c, v in zip(COLUMNS, cells, strict=True)
    )
    cls = ' class="gone"' if n.state == EXPIRED or n.state == "offline" else ""
    return f'<tr{cls} data-peer="{escape(r.peer)}" data-state="{escape(n.state)}">{tds}</tr>'


def _link(link: dict[str, float]) -> str:
    if not link:
        return '<span class="muted">—</span>'
    head = [k for k in HEADLINE_LINK_KEYS if k in link] or sorted(link)[:3]
    rest = sorted(k for k in link if k not in head)

    def lines(keys: list[str]) -> str:
        return "<br>".join(
            f"{escape(_link_label(k))} {escape(_link_value(k, link[k]))}" for k in keys
        )

    out = f'<span class="link">{lines(head)}</span>'
    if rest:
        # <details> opens without script, so the page stays short and nothing is hidden
        out += (
            f"<details><summary>{len(rest)} more</summary>"
            f'<span class="link">{lines(rest[:64])}</span></details>'
        )
    return out


def _link_label(key: str) -> str:
    for suffix in ("_Bps", "_bps", "_bytes", "_s", "_ms"):
        if key.endswith(suffix):
            key = key[: -len(suffix)]
            break
    return key.replace("_", " ")[:40]


def _link_value(key: str, value: float) -> str:
    # the node names its units in the key's suffix (swarm.node's uplink: bandwidth_Bps, rtt_s)
    if value == 0 and key in ("bandwidth_Bps", "rtt_s"):
        return "not measured yet"  # a link that has carried nothing yet reports 0
    if key.endswith("_Bps"):
        return _bytes_per_s(value)
    if key.endswith("_bps"):
        return _bytes_per_s(value / 8)
    if key.endswith("_s"):
        return _duration(value)
    if key.endswith("_bytes"):
        return _bytes(value)
    if key.endswith("_ms"):
        return f"{_num(value)} ms"
    return _num(value)


def _bytes_per_s(v: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if abs(v) >= scale:
            return f"{_num(v / scale)} {unit}"
    return f"{_num(v)} B/s"


def _bytes(v: float) -> str:
    return _bytes_per_s(v)[: -len("/s")]


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    if abs(seconds) < 1:
        return f"{_num(seconds * 1000)} ms"
    return f"{_num(seconds)} s"


def _age(seconds: float) -> str:
    s = max(0.0, seconds)
    if s < 90:
        return f"{s:.0f} s"
    if s < 90 * 60:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _num(x: float | None) -> str:
    """Three significant figures, no exponent for everyday magnitudes."""
    if x is None:
        return "—"
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    if x == 0:
        return "0"
    a = abs(x)
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    if a >= 0.001:
        return f"{x:.3f}"
    return f"{x:.2g}"
