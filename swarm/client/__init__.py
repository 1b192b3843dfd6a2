"""The swarm client: `generate()` for text, `Client` and `InferenceSession` for more control."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from swarm.client.cache import ClientCache
from swarm.client.client import Client, InferenceSession, ReplyStream, Sampler
from swarm.client.options import MAX_NEW_TOKENS, ClientOptions, Sampling, split_options

__all__ = [
    "Client",
    "ClientOptions",
    "Clients",
    "InferenceSession",
    "ReplyStream",
    "Sampler",
    "Sampling",
    "generate",
    "stream",
    "get_client",
]

Prompt = str | list[dict[str, str]]


class Clients:
    """Clients kept open for reuse, one per (peers, ClientOptions): the DHT and head load once
    per swarm. At most `size`; the one least recently asked for is closed when one more is
    needed. `with Clients() as clients: clients.generate(...)` closes them all at the end."""

    def __init__(self, size: int = 4):
        self._cache = ClientCache(size)

    def __enter__(self) -> Clients:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close every client (one still streaming a reply, when the reply ends)."""
        self._cache.close()

    def get(self, initial_peers: Sequence[str], **options) -> Client:
        """The client for these peers and ClientOptions fields (model, wire_dtype, ...)."""
        return self._cache.get(*_key(initial_peers, ClientOptions(**options)))

    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = MAX_NEW_TOKENS,
        *,
        initial_peers: Sequence[str],
        stop: Sequence[str] = (),
        **options,
    ) -> Iterator[str]:
        """Yield the reply as text pieces while tokens arrive. `options`: the fields of
        ClientOptions (model, wire_dtype, ...) and of Sampling (greedy unless temperature > 0)."""
        speculative = options.pop("speculative", None)  # the reply's, not the client's
        client_options, sampling = split_options(options)
        with self._cache.use(*_key(initial_peers, client_options)) as client:
            yield from client.stream(
                prompt, max_new_tokens, stop, speculative=speculative, **vars(sampling)
            )

    def generate(self, prompt: Prompt, max_new_tokens: int = MAX_NEW_TOKENS, **kwargs) -> str:
        """The reply to a prompt (a string, or chat messages [{"role", "content"}]) as text;
        `kwargs` as stream()'s."""
        return "".join(self.stream(prompt, max_new_tokens, **kwargs))


def _key(initial_peers: Sequence[str], options: ClientOptions):
    """The cache key of the client for these arguments, and how to make that client."""

    def make() -> Client:
        return Client(list(initial_peers), options)

    return (tuple(initial_peers), options), make


# The convenience functions below keep their clients here, process-wide: `generate()` called
# twice must not start a DHT and load a head twice, and a caller of a one-line API owns nothing
# it could keep them in. A program that wants them closed, or kept apart, owns a `Clients`.
_process_clients = Clients(4)


def get_client(initial_peers: Sequence[str], **options) -> Client:
    """One Client per (peers, ClientOptions) per process (see Clients): the DHT and head load
    once. The process keeps four; the one least recently asked for is closed for a fifth."""
    return _process_clients.get(initial_peers, **options)


def stream(prompt: Prompt, max_new_tokens: int = MAX_NEW_TOKENS, **kwargs) -> Iterator[str]:
    """Yield the reply as text pieces while tokens arrive (see Clients.stream: `initial_peers`
    is required, the other keywords are ClientOptions' and Sampling's fields, and `stop`)."""
    return _process_clients.stream(prompt, max_new_tokens, **kwargs)


def generate(prompt: Prompt, max_new_tokens: int = MAX_NEW_TOKENS, **kwargs) -> str:
    """The reply to a prompt (a string, or chat messages [{"role", "content"}]) as text."""
    return _process_clients.generate(prompt, max_new_tokens, **kwargs)
