"""The starlette app: three routes that serve the latest snapshot, rendered once per snapshot."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from swarm.health.render import render_page
from swarm.health.snapshot import Snapshot

# the page needs nothing but its own inline style; say so, so a browser refuses anything else
PAGE_HEADERS = {
    "cache-control": "no-cache",
    "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}
PAGE_REFRESH_S = 10  # how often a page left open reloads itself
API_HEADERS = {
    "cache-control": "no-cache",
    "access-control-allow-origin": "*",
    "x-content-type-options": "nosniff",
}


class Rendered:
    """The page and the JSON of one snapshot, made on first request and reused until the next."""

    def __init__(self, current: Callable[[], Snapshot], refresh_seconds: int):
        self._current = current
        self._refresh = refresh_seconds
        self._serial = -1
        self.html = b""
        self.json = b""

    def latest(self) -> Snapshot:
        snapshot = self._current()
        if snapshot.serial != self._serial:
            self.html = render_page(snapshot, self._refresh).encode()
            self.json = json.dumps(snapshot.to_json(), separators=(",", ":")).encode()
            self._serial = snapshot.serial
        return snapshot


def create_app(
    current: Callable[[], Snapshot],
    refresh_seconds: int = PAGE_REFRESH_S,
    stale_after: float = 60.0,
) -> Starlette:
    """`current` returns the latest snapshot; it must not block (it is called per request)."""
    rendered = Rendered(current, refresh_seconds)

    async def page(_request: Request) -> Response:
        rendered.latest()
        return Response(rendered.html, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    async def state(_request: Request) -> Response:
        rendered.latest()
        return Response(rendered.json, media_type="application/json", headers=API_HEADERS)

    async def healthz(_request: Request) -> Response:
        s = rendered.latest()
        last_ok = s.dht.last_ok
        age = None if last_ok is None else time.time() - last_ok
        healthy = age is not None and age <= stale_after
        body = {
            "status": "ok" if healthy else ("starting" if last_ok is None else "stale"),
            "dht": s.dht.state,
            "last_dht_read_age_s": None if age is None else round(age, 1),
            "error": s.dht.error,
            "models": len(s.models),
        }
        return Response(
            json.dumps(body, separators=(",", ":")),
            status_code=200 if healthy else 503,
            media_type="application/json",
            headers={"cache-control": "no-cache"},
        )

    return Starlette(
        routes=[
            Route("/", page),
            Route("/api/v1/state", state),
            Route("/healthz", healthz),
        ]
    )
