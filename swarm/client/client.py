"""The client: DHT discovery, routing, the model head, sessions that survive node failures."""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Generator, Iterator, Sequence

import torch
import trio

from swarm.client.head_batch import LogitsBatcher
from swarm.client.routing import block_seconds, bounded, find_route, missing_blocks, usable
from swarm.client.runtime import TrioThread
from swarm.client.session import PREFILL_CHUNK, RemoteSession
from swarm.client.verify import Reports, Verdict, check_last_step
from swarm.dht import read_nodes, start_dht
from swarm.errors import (
    FingerprintMismatch,
    NoChatTemplate,
    ProtocolError,
    SpanError,
    SwarmError,
)
from swarm.link.estimator import ewma
from swarm.model.head import Head
from swarm.model.source import open_model
from swarm.protocol import Hop
from swarm.records import NodeRecord
from swarm.transport import ping

log = logging.getLogger("swarm.client")
MEASURE_GAIN = 0.3  # EWMA gain of a node's measured seconds a block
SHUN_S = 600.0  # how long a node that answered as no honest one would stays out of routes


class Client:
    """Connects to a swarm serving one model. Reuse one per process: it holds the DHT and head."""

    def __init__(
        self,
        initial_peers: Sequence[str],
        model: str | None = None,
        wire_dtype: str | None = None,
        step_timeout: float = 30.0,
        max_retries: int = 4,
        prefill_chunk: int = PREFILL_CHUNK,
        plaintext: bool = False,
    ):
        """`plaintext`: also route through nodes run with --plaintext (an experiment; by
        default every connection is TLS, checked against the key each node's record names)."""
        if not initial_peers:
            raise ValueError("initial_peers is empty: pass the multiaddr a node printed")
        self.source = open_model(model)
        self.config = self.source.config
        self.fingerprint = self.source.fingerprint()
        self._heads: dict[str, Head] = {}
        self._weights: dict[str, str] = {}  # peer -> the weight format its record announces
        self.wire_dtype = wire_dtype
        self.step_timeout = step_timeout
        self.max_retries = max_retries
        self.prefill_chunk = prefill_chunk
        self.plaintext = plaintext
        self._tokenizer = None
        self._loading = threading.Lock()  # tokenizer and heads load once, whatever the threads
        self.dht = start_dht(initial_peers, client_mode=True)
        self.loop = TrioThread()
        self.logits = LogitsBatcher()  # sessions stepping together share the head's matmul
        self._rtts: dict[str, float] = {}
        self._block_seconds: dict[str, float] = {}  # peer -> seconds a block, as measured here
        self.suspects: set[str] = set()  # nodes a check found computing wrongly (verify.py)
        self.reports = Reports()  # what those checks found, as this client keeps it in the DHT
        self.shunned: dict[str, float] = {}  # peer -> until when routes leave it out (monotonic)

    @property
    def tokenizer(self):
        with self._loading:  # transformers' lazy imports fail when raced
            if self._tokenizer is None:
                self._tokenizer = self.source.tokenizer()
        return self._tokenizer

    def close(self) -> None:
        self.loop.close()
        self.dht.shutdown()

    # ---- routing ----------------------------------------------------------------------------

    def nodes(self) -> list[NodeRecord]:
        records, _exp, _bad = read_nodes(self.dht, self.config.name, self.config.num_layers)
        return records

    def route(self, exclude: set[str] = frozenset()) -> list[Hop]:
        now = time.monotonic()
        shunned = {peer for peer, until in self.shunned.items() if until > now}
        exclude = {*exclude, *self.suspects, *shunned}
        every = self.nodes()
        records = usable(every, self.fingerprint, exclude, self.plaintext)
        if missing_blocks(records, self.config.num_layers):
            without_tls = len(usable(every, self.fingerprint, exclude, True)) - len(records)
            model = self.config.name
            if without_tls:
                model += f" ({without_tls} nodes run without TLS: Client(plaintext=True) uses them)"
            find_route(records, self.config.num_layers, self.fingerprint, model=model)
        records = bounded(records, self._rtts)
        self._weights.update({r.peer: r.weights for r in records})
        rtts = self.loop.run(ping_all, {r.peer: r.hop() for r in records}, 2.0)
        self._rtts.update(rtts)
        reachable = [r for r in records if r.peer in rtts]
        return find_route(
            reachable,
            self.config.num_layers,
            self.fingerprint,
            self._rtts,
            exclude,
            model=self.config.name,
            plaintext=self.plaintext,
            measured=self._block_seconds,
        )

    def observe_step(self, route: list[Hop], seconds: float) -> None:
        """A one-token step through `route` took `seconds`: what each of its nodes really does
        replaces what its record claims, in the routes chosen from now on."""
        per_block = block_seconds(route, seconds, self._rtts)
        for hop in route:
            before = self._block_seconds.get(hop.peer)
            self._block_seconds[hop.peer] = ewma(before, per_block, MEASURE_GAIN)

    # ---- sessions ----------------------------------------------------------------------------

    def remote_session(self, route: list[Hop], max_length: int) -> RemoteSession:
        """A session on the nodes of `route`, not opened yet."""
        return RemoteSession(
            route,
            self.fingerprint,
            self.config.hidden,
            max_length,
            self.wire_dtype,
            self.step_timeout,
            prefill_chunk=self.prefill_chunk,
            own_dtype=self.config.wire_dtype,
        )

    def head(self, route: list[Hop]) -> Head:
        """The head for `route`: float32 where every hop computes in float32 (the exact path,
        token-identical to transformers), else the file's own formats, as the nodes keep theirs."""
        exact = route and all(self._weights.get(h.peer) == "float32" for h in route)
        weights = "float32" if exact else "auto"
        with self._loading:
            if weights not in self._heads:
                self._heads[weights] = Head.load(self.source, weights)
        return self._heads[weights]

    def session(self, max_length: int) -> InferenceSession:
        return InferenceSession(self, max_length)

    def stream(
        self,
        prompt: str | list[dict[str, str]],
        max_new_tokens: int = 64,
        stop: Sequence[str] = (),
        **sampling,
    ) -> ReplyStream:
        """The reply's text piece by piece as tokens arrive: iterate the ReplyStream, whose
        `tokens` are this reply's own, however many threads share the client. `sampling`: the
        Sampler's temperature, top_p, top_k and seed (greedy by default)."""
        text = ReplyText(self, stop)
        sampler = Sampler(**sampling)
        return ReplyStream(self._pieces(prompt, max_new_tokens, sampler, text), text)

    def _pieces(
        self,
        prompt: str | list[dict[str, str]],
        max_new_tokens: int,
        sampler: Sampler,
        text: ReplyText,
    ) -> Generator[str, None, None]:
        ids = self.encode(prompt)
        with self.session(len(ids) + max_new_tokens) as session:
            logits = session.feed(ids)
            for i in range(max_new_tokens):
                piece, done = text.add(sampler(logits))
                if piece:
                    yield piece
                if done:
                    break
                if i + 1 < max_new_tokens:
                    logits = session.feed([text.tokens[-1]])
            else:
                if tail := text.flush():
                    yield tail

    def generate(self, prompt: str | list[dict[str, str]], **kwargs) -> str:
        return "".join(self.stream(prompt, **kwargs))

    @property
    def chat(self) -> bool:
        """Whether the model has a chat template (base models have none)."""
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: str | list[dict[str, str]]) -> list[int]:
        if isinstance(prompt, list):
            if not self.chat:
                raise NoChatTemplate(
                    f"{self.config.name} has no chat template (a base model): send plain text"
                )
            enc = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
            if hasattr(enc, "keys"):
                enc = enc["input_ids"]
            return list(enc)
        return self.tokenizer.encode(prompt)


class InferenceSession:
    """Token ids in, next-token logits out. Survives node failures by rerouting and replaying."""

    def __init__(self, client: Client, max_length: int):
        if max_length > client.config.max_position:
            raise ValueError(
                f"{max_length} tokens exceed the model's context of {client.config.max_position}"
            )
        self.client = client
        self.max_length = max_length
        self.history: list[int] = []
        self.remote: RemoteSession | None = None
        self.excluded: set[str] = set()
        self.recoveries: list[float] = []  # seconds each failure took to recover from
        self.last_hidden: torch.Tensor | None = None  # the final hidden state of the last token

    def __enter__(self) -> InferenceSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.remote is not None:
            self.client.loop.run(self.remote.aclose)
            self.remote = None

    def _open(self) -> None:
        route = self.client.route(self.excluded)
        remote = self.client.remote_session(route, self.max_length)
        try:
            self.client.loop.run(remote.open)
        except BaseException:
            self.client.loop.run(remote.aclose)
            raise
        self.remote = remote
        log.info("route: %s", " -> ".join(f"{h.addr}[{h.start}:{h.end}]" for h in route))

    def feed(self, ids: list[int]) -> torch.Tensor:
        """Append tokens; return logits [vocab] for the next one."""
        failed_at = None
        for attempt in itertools.count():
            try:
                logits = self._step(ids)
            except SwarmError as exc:
                if not _route_may_help(exc) or attempt == self.client.max_retries:
                    raise
                failed_at = failed_at or time.monotonic()
                self._reroute(exc, attempt)
                continue
            if failed_at is not None:
                self.recoveries.append(time.monotonic() - failed_at)
            return logits

    def _step(self, ids: list[int]) -> torch.Tensor:
        """One try at feeding `ids`; on a new route, the tokens so far go first."""
        replay = []
        if self.remote is None:
            self._open()
            replay = self.history  # a new route: rebuild its caches from the tokens so far
        head = self.client.head(self.remote.route)
        hidden = head.embed_tokens(replay + ids)
        started = time.perf_counter()
        out = self.last_hidden = self.client.loop.run(self.remote.step, hidden)
        if len(replay) + len(ids) == 1:  # a decode step: its time is the route's cost a token
            self.client.observe_step(self.remote.route, time.perf_counter() - started)
        self.history += ids
        return self.client.logits.logits(head, out)

    def verify(self, rng: random.Random | None = None) -> Verdict:
        """Recompute the last step on other routes (see swarm.client.verify); nodes found
        computing wrongly go into client.suspects, which every route of the client leaves out,
        and are reported in the DHT, where the health page shows them."""
        if self.remote is None or self.last_hidden is None:
            raise ValueError("nothing to verify yet: feed the session first")
        route = self.remote.route
        verdict = check_last_step(
            self.client, route, self.history, self.last_hidden, rng, self.excluded
        )
        if verdict.suspects:  # every route of the client leaves them out from now on
            log.warning("nodes computing wrongly, left out: %s", ", ".join(verdict.suspects))
            self.client.suspects |= verdict.suspects
            self.client.reports.publish(self.client.dht, self.client.config.name, verdict.outvoted)
            self.close()  # the next step routes anew, replaying
        return verdict

    def _reroute(self, exc: SwarmError, attempt: int) -> None:
        """Leave the route that failed, blaming whom `exc` names (or the hops that went quiet),
        and back off before the next try."""
        self._blame(exc)
        log.warning("route failed (%s); rerouting, attempt %d", exc, attempt + 1)
        self.close()
        time.sleep(min(0.25 * 2**attempt, 4.0))

    def _blame(self, exc: SwarmError) -> None:
        peer = getattr(exc, "peer", None)
        if peer:
            self.excluded.add(peer)
            if _misbehaved(exc):  # every session of this client leaves it out for a while
                self.client.shunned[peer] = time.monotonic() + SHUN_S
            return
        if self.remote is None:
            return
        # nobody named: a hop hung. Ping each; exclude the silent ones.
        hops = {h.peer: h for h in self.remote.route}
        alive = self.client.loop.run(ping_all, hops, 2.0)
        self.excluded.update(p for p in hops if p not in alive)


def _misbehaved(exc: SwarmError) -> bool:
    """A hop named by `exc` answered as no honest node of this model would: blocks it announced
    but does not serve, other weights, a broken message."""
    liar = isinstance(exc, (SpanError, FingerprintMismatch, ProtocolError))
    return liar and bool(getattr(exc, "peer", None))


def _route_may_help(exc: SwarmError) -> bool:
    """Whether another route may succeed: the error says so (a busy or dead peer), or leaving
    out a hop that misbehaved may."""
    return exc.retry_elsewhere or _misbehaved(exc)


class ReplyText:
    """A reply's tokens turned into text as they come: pieces to emit, and whether the reply
    ended (end-of-text token or a stop string; text from a stop string on is never emitted).
    A tail that could be the start of a stop string is held back until the next token settles
    it, or `flush()` at the end lets it out."""

    def __init__(self, client: Client, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = client.tokenizer, [s for s in stop if s]
        self.eos = set(client.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos.add(self.tokenizer.eos_token_id)
        self.tokens: list[int] = []
        self.emitted = ""
        self._text = ""  # the reply so far, cut at a stop string

    def add(self, token: int) -> tuple[str, bool]:
        if token in self.eos:
            return self.flush(), True
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        hit = [text.index(s) for s in self.stop if s in text]
        if hit:
            self._text = text[: min(hit)]
            return self.flush(), True
        self._text = text
        ready = text[: len(text) - self._held(text)]
        piece = ""
        if len(ready) > len(self.emitted) and not ready.endswith("\ufffd"):
            piece, self.emitted = ready[len(self.emitted) :], ready
        return piece, False

    def flush(self) -> str:
        """The text not emitted yet: call once the reply is over."""
        piece = self._text[len(self.emitted) :]
        self.emitted = self._text
        return piece

    def _held(self, text: str) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        return max(
            (n for s in self.stop for n in range(min(len(s) - 1, len(text)), 0, -1)
             if text.endswith(s[:n])),
            default=0,
        )  # fmt: skip


class ReplyStream(Iterator[str]):
    """A reply being generated: iterate it for its text pieces as tokens arrive; `tokens` are
    its token ids so far (an end-of-text token is not among them)."""

    def __init__(self, pieces: Generator[str, None, None], text: ReplyText):
        self._pieces, self._text = pieces, text

    def __next__(self) -> str:
        return next(self._pieces)

    def close(self) -> None:
        """Stop early: the reply's session on the nodes closes now."""
        self._pieces.close()

    @property
    def tokens(self) -> list[int]:
        return list(self._text.tokens)


class Sampler:
    def __init__(
        self, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None
    ):
        self.temperature, self.top_p, self.top_k = temperature, top_p, top_k
        self.generator = torch.Generator().manual_seed(
            seed if seed is not None else random.randrange(2**63)
        )

    def __call__(self, logits: torch.Tensor) -> int:
        if self.temperature <= 0:
            return int(logits.argmax())
        logits = logits / self.temperature
        if self.top_k > 0:
            kth = torch.topk(logits, min(self.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < self.top_p
            mask = torch.zeros_like(probs, dtype=torch.bool)
            mask[order[keep]] = True
            probs = probs.masked_fill(~mask, 0.0)
            probs = probs / probs.sum()
        return int(torch.multinomial(probs, 1, generator=self.generator))


async def ping_all(hops: dict[str, Hop], timeout: float) -> dict[str, float]:
    """Round trips in seconds of the peers that answered a ping within `timeout`."""
    out: dict[str, float] = {}

    async def one(peer: str, hop: Hop) -> None:
        reach = await ping(hop, timeout=timeout)
        if reach.rtt_s is not None:
            out[peer] = reach.rtt_s

    async with trio.open_nursery() as nursery:
        for peer, hop in hops.items():
            nursery.start_soon(one, peer, hop)
    return out
