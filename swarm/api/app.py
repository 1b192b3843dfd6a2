"""The starlette app: OpenAI's /v1 routes over the swarm, and the chat page at /."""

from __future__ import annotations

import hmac
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from swarm.api.generation import Backend, open_reply
from swarm.api.page import PAGE_HEADERS, render_page
from swarm.api.schema import ApiError, GenerationRequest, parse_request

MAX_BODY = 4 << 20  # bytes of JSON a request may send
Send = Callable[[dict], Awaitable[None]]


def json_response(body: Any, status: int = 200) -> Response:
    return Response(
        json.dumps(body, separators=(",", ":"), ensure_ascii=False),
        status_code=status,
        media_type="application/json",
    )


def error_response(err: ApiError) -> Response:
    return json_response(err.body(), err.status)


async def read_json(request: Request) -> Any:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise ApiError(413, f"the request body exceeds {MAX_BODY} bytes", code="too_large")
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from exc


class ReplyResponse:
    """An ASGI response that runs one request through the swarm while watching its client:
    when the client goes away the run is cancelled, which closes its swarm session."""

    def __init__(self, backend: Backend, request: GenerationRequest, caller: str):
        self.backend, self.request, self.caller = backend, request, caller
        self.id = ("chatcmpl-" if request.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.started = False  # response headers sent

    async def __call__(self, scope, receive, send: Send) -> None:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            try:
                await self.respond(send)
            except ApiError as err:
                if not self.started:
                    await error_response(err)(scope, receive, send)
                else:  # mid-stream: the status is sent already; say it in the stream
                    await self.event(send, err.body())
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            nursery.cancel_scope.cancel()

    async def start(self, send: Send, media_type: str) -> None:
        headers = [(b"content-type", media_type.encode()), (b"cache-control", b"no-cache")]
        if media_type == "text/event-stream":
            headers.append((b"x-accel-buffering", b"no"))  # a proxy in front must not buffer
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        self.started = True

    async def event(self, send: Send, body: Any) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":"))
        chunk = b"data: " + (data if isinstance(data, bytes) else data.encode()) + b"\n\n"
        await send({"type": "http.response.body", "body": chunk, "more_body": True})

    def choice(self, text: str | None, finish_reason: str | None, first: bool = False) -> dict:
        if self.request.chat:
            delta: dict[str, str] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}

    def envelope(self, choices: list, usage: dict | None, chunk: bool) -> dict:
        kind = "chat.completion" if self.request.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind + ".chunk" if chunk and self.request.chat else kind,
            "created": self.created,
            "model": self.backend.name,
            "choices": choices,
            "usage": usage,
        }

    async def respond(self, send: Send) -> None:
        async with open_reply(self.backend, self.request, self.caller) as (reply, pieces):
            if not self.request.stream:
                async with aclosing(pieces):
                    text = "".join([p async for p in pieces])
                if self.request.chat:
                    message = {"role": "assistant", "content": text}
                    choice = {"index": 0, "message": message, "logprobs": None}
                else:
                    choice = {"index": 0, "text": text, "logprobs": None}
                choice["finish_reason"] = reply.finish_reason
                body = self.envelope([choice], reply.usage(), chunk=False)
                await self.start(send, "application/json")
                data = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
                await send({"type": "http.response.body", "body": data, "more_body": False})
                return
            await self.start(send, "text/event-stream")
            usage = None  # with include_usage every chunk says "usage": null but the last
            if self.request.chat:
                await self.event(send, self.envelope([self.choice("", None, True)], usage, True))
            async with aclosing(pieces):
                async for piece in pieces:
                    await self.event(send, self.envelope([self.choice(piece, None)], usage, True))
            end = self.choice(None if self.request.chat else "", reply.finish_reason)
            await self.event(send, self.envelope([end], usage, True))
            if self.request.include_usage:
                await self.event(send, self.envelope([], reply.usage(), True))
            await self.event(send, b"[DONE]")
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def create_app(backend: Backend, api_key: str | None = None) -> Starlette:
    """The API over `backend`'s model; every /v1 route wants `Bearer api_key` if one is set."""

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), api_key.encode()):
            raise ApiError(
                401,
                "a valid API key is needed: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )

    def model_entry() -> dict:
        return {"id": backend.name, "object": "model", "created": 0, "owned_by": "swarm"}

    async def routed() -> bool:
        return not await backend.gaps_now()

    async def models(request: Request) -> Response:
        authorize(request)
        listed = [model_entry()] if await routed() else []
        return json_response({"object": "list", "data": listed})

    async def model(request: Request) -> Response:
        authorize(request)
        if request.path_params["model"] != backend.name or not await routed():
            raise unknown_model(request.path_params["model"])
        return json_response(model_entry())

    def unknown_model(name: str) -> ApiError:
        return ApiError(
            404,
            f"the model {name!r} does not exist here; this server serves {backend.name!r}",
            param="model",
            code="model_not_found",
        )

    def generation(chat: bool):
        async def endpoint(request: Request):
            authorize(request)
            parsed = parse_request(await read_json(request), chat)
            if parsed.model != backend.name:
                raise unknown_model(parsed.model)
            caller = request.client.host if request.client else "?"
            return ReplyResponse(backend, parsed, caller)

        return endpoint

    async def page(_request: Request) -> Response:
        return Response(render_page(), media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    async def api_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    async def http_error(_request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(ApiError(exc.status_code, str(exc.detail), code=None))

    return Starlette(
        routes=[
            Route("/", page),
            Route("/v1/models", models),
            Route("/v1/models/{model:path}", model),
            Route("/v1/chat/completions", generation(chat=True), methods=["POST"]),
            Route("/v1/completions", generation(chat=False), methods=["POST"]),
        ],
        exception_handlers={ApiError: api_error, HTTPException: http_error},
    )
