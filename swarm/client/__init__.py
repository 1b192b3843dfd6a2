"""The swarm client: `generate()` for text, `Client` and `InferenceSession` for more control."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from swarm.client.cache import ClientCache
from swarm.client.client import Client, InferenceSession, ReplyStream, Sampler

__all__ = [
    "Client",
    "InferenceSession",
    "ReplyStream",
    "Sampler",
    "generate",
    "stream",
    "get_client",
]

# the process's clients for generate() and stream(): the DHT and head load once per swarm
_clients = ClientCache(4)


def _key(initial_peers: Sequence[str], model: str | None, wire_dtype: str | None):
    """The cache key of the client for these arguments, and how to make that client."""

    def make() -> Client:
        return Client(list(initial_peers), model=model, wire_dtype=wire_dtype)

    return (tuple(initial_peers), model, wire_dtype), make


def get_client(
    initial_peers: Sequence[str], model: str | None = None, wire_dtype: str | None = None
) -> Client:
    """One Client per (peers, model, wire dtype) per process: the DHT and head load once. The
    process keeps four; the one least recently asked for is closed when a fifth is needed."""
    return _clients.get(*_key(initial_peers, model, wire_dtype))


def stream(
    prompt: str | list[dict[str, str]],
    max_new_tokens: int = 64,
    *,
    initial_peers: Sequence[str],
    model: str | None = None,
    wire_dtype: str | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
) -> Iterator[str]:
    """Yield the reply as text pieces while tokens arrive. Greedy unless temperature > 0."""
    with _clients.use(*_key(initial_peers, model, wire_dtype)) as client:
        yield from client.stream(
            prompt,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
        )


def generate(
    prompt: str | list[dict[str, str]],
    max_new_tokens: int = 64,
    **kwargs,
) -> str:
    """The reply to a prompt (a string, or chat messages [{"role", "content"}]) as text."""
    return "".join(stream(prompt, max_new_tokens, **kwargs))
