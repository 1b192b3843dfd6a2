"""One model served through one shared Client: its route check, and each request's reply.

Every request gets its own swarm session (`AsyncSession`): its steps run in worker threads, so
many requests step at once and the nodes batch them. A request cancelled anywhere (its HTTP
client went away) closes its session on the nodes on the way out.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from swarm.api.fair import FairSlots
from swarm.api.schema import ApiError, GenerationRequest
from swarm.client.aio import AsyncSession
from swarm.client.client import Client
from swarm.client.decoding import SpeculationStats
from swarm.client.options import Sampling
from swarm.client.reply import Sampler
from swarm.client.routing import missing_blocks, usable
from swarm.errors import CacheFull, DhtUnavailable, NoChatTemplate, SwarmError
from swarm.records import format_blocks


@dataclass
class Reply:
    """A reply in progress: its counts and, once over, why it ended."""

    prompt_tokens: int
    completion_tokens: int = 0
    finish_reason: str | None = None  # "stop" (end of text or a stop string) or "length"
    speculation: SpeculationStats | None = None  # drafts proposed and accepted so far

    def usage(self) -> dict:
        """OpenAI's usage object; speculative decoding's drafts as its predicted outputs'
        accepted and rejected prediction tokens."""
        drafts = self.speculation or SpeculationStats()
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens_details": {
                "accepted_prediction_tokens": drafts.accepted,
                "rejected_prediction_tokens": drafts.proposed - drafts.accepted,
            },
        }


# a token is rarely longer than this many characters: a prompt longer than the context times it
# cannot fit, and is refused before it costs the tokenizer seconds of CPU
MAX_CHARS_PER_TOKEN = 32


class Backend:
    """A model the server answers for: its Client, shared by every request."""

    ROUTE_FRESH_S = 2.0  # a full route seen this recently is not read again before a request

    def __init__(self, client: Client, sessions: FairSlots, default_max_tokens: int):
        self.client = client
        self.name = client.config.name
        self.context = client.config.max_position
        self.default_max_tokens = default_max_tokens
        # past its slots requests queue here, fairly by caller, not at the nodes' address share
        self.sessions = sessions
        self._routed_at = -math.inf  # when the DHT last showed a full route

    def gaps(self) -> list[tuple[int, int]]:
        """Blocks no usable node serves right now (blocking: reads the DHT)."""
        records = usable(
            self.client.nodes(), self.client.fingerprint, plaintext=self.client.options.plaintext
        )
        return missing_blocks(records, self.client.config.num_layers)

    async def gaps_now(self) -> list[tuple[int, int]]:
        """`gaps()` from a worker thread; ApiError 503 if the DHT cannot be read."""
        try:
            return await trio.to_thread.run_sync(self.gaps, abandon_on_cancel=True)
        except DhtUnavailable as exc:
            raise ApiError(
                503,
                f"the swarm's directory cannot be read: {exc}",
                code="dht_unavailable",
                type="server_error",
            ) from None

    async def check_route(self) -> None:
        """ApiError 503 naming the missing blocks if the swarm has no full route. A route seen
        in the last ROUTE_FRESH_S passes unread: the session's own routing reads the DHT
        again, and a read per request is what many requests at once would queue on."""
        if trio.current_time() - self._routed_at < self.ROUTE_FRESH_S:
            return
        gaps = await self.gaps_now()
        if not gaps:
            self._routed_at = trio.current_time()
        else:
            raise ApiError(
                503,
                f"the swarm has no route for {self.name}: no online node serves blocks"
                f" {format_blocks(gaps)}",
                code="route_unavailable",
                type="server_error",
            )

    async def encode(self, request: GenerationRequest) -> list[int]:
        text = sum(len(m.get("content") or "") for m in request.messages) if request.chat else 0
        if isinstance(request.prompt, str):
            text += len(request.prompt)
        if text > self.context * MAX_CHARS_PER_TOKEN:  # refused before the tokenizer's CPU
            raise ApiError(
                400,
                f"the prompt's {text} characters cannot fit this model's context of"
                f" {self.context} tokens",
                param="messages" if request.chat else "prompt",
                code="context_length_exceeded",
            )
        if request.chat:
            try:
                return await trio.to_thread.run_sync(self.client.encode, list(request.messages))
            except NoChatTemplate as exc:
                raise ApiError(
                    400, f"{exc}; use /v1/completions", param="messages", code=exc.code
                ) from exc
        if isinstance(request.prompt, tuple):
            vocab = self.client.config.vocab
            if max(request.prompt) >= vocab:
                raise ApiError(400, f"token ids must be below {vocab}", param="prompt")
            return list(request.prompt)
        return await trio.to_thread.run_sync(self.client.encode, request.prompt)

    def budget(self, request: GenerationRequest, prompt_tokens: int) -> int:
        """How many tokens the reply may have; ApiError if the prompt leaves no room for them."""
        room = self.context - prompt_tokens
        asked = request.sampling.max_tokens
        if asked is None and room >= 1:
            return min(self.default_max_tokens, room)
        if asked is None or asked > room:
            wanted = prompt_tokens + (asked or 1)
            raise ApiError(
                400,
                f"this model's context is {self.context} tokens; the request needs {wanted}"
                f" ({prompt_tokens} in the prompt, {asked or 1} for the reply)",
                param="max_tokens" if asked else ("messages" if request.chat else "prompt"),
                code="context_length_exceeded",
            )
        return asked


@asynccontextmanager
async def open_reply(
    backend: Backend, request: GenerationRequest, caller: str
) -> AsyncIterator[tuple[Reply, AsyncIterator[str]]]:
    """Check, encode and prefill (errors raise here, before any byte is sent); then the reply's
    counts and its text pieces. Leaving the block closes the session on the swarm. `caller`:
    whose share of the server's slots the request takes (tokenizing it too)."""
    if not request.prompt and not request.chat:
        raise ApiError(400, "prompt is empty", param="prompt")
    s = request.sampling
    async with backend.sessions.slot(caller):
        ids = await backend.encode(request)
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens", param="prompt")
        max_tokens = backend.budget(request, len(ids))
        await backend.check_route()
        # the request's "speculative": false decodes a token a step; else the server's way
        speculative = None if s.speculative else "off"
        try:
            async with AsyncSession(backend.client, len(ids) + max_tokens, speculative) as session:
                sampler = Sampler(Sampling(temperature=s.temperature, top_p=s.top_p, seed=s.seed))
                tokens = session.tokens(ids, max_tokens, sampler)
                first = await anext(tokens)  # the prompt's pass: its errors before any byte
                reply = Reply(prompt_tokens=len(ids), speculation=session.decoding.stats)
                text = backend.client.reply_text(s.stop)

                async def pieces() -> AsyncIterator[str]:
                    token = first
                    while token is not None:
                        piece, done = text.add(token)
                        reply.completion_tokens += 1
                        if piece:
                            yield piece
                        if done:
                            reply.finish_reason = "stop"
                            return
                        token = await anext(tokens, None)
                    reply.finish_reason = "length"
                    if tail := text.flush():
                        yield tail

                yield reply, pieces()
        except SwarmError as exc:
            raise swarm_error(exc) from exc


def swarm_error(exc: SwarmError) -> ApiError:
    """What a client should see of a swarm failure: its own fault (400) or the swarm's (503)."""
    if isinstance(exc, CacheFull):
        return ApiError(400, str(exc), code="context_length_exceeded")
    return ApiError(
        503, f"the swarm failed this request: {exc}", code=exc.code, type="server_error"
    )
