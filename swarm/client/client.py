"""The client: DHT discovery, routing, the model head, sessions that survive node failures."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator, Sequence
from dataclasses import replace

import torch

from swarm.client.decoding import Decoding, Drafter, PromptLookup, SpeculationStats
from swarm.client.draft import DraftModel
from swarm.client.head_batch import LogitsBatcher
from swarm.client.inference import InferenceSession
from swarm.client.options import MAX_NEW_TOKENS, ClientOptions, Sampling
from swarm.client.reply import ReplyStream, ReplyText, Sampler
from swarm.client.router import Router
from swarm.client.routing import (
    PREFILL_MIN_TOKENS,
    decode_nodes,
    find_route,
    missing_blocks,
    pick_prefill,
    session_nodes,
    usable,
)
from swarm.client.runtime import TrioThread
from swarm.client.session import RemoteSession
from swarm.client.tuner import TunerPool
from swarm.client.verify import Reports
from swarm.dht import read_nodes, start_dht
from swarm.errors import (
    NoChatTemplate,
    SpeculationRefused,
)
from swarm.model.blocks import KVCache
from swarm.model.deltanet import State
from swarm.model.head import Head
from swarm.model.source import open_model
from swarm.protocol import Hop
from swarm.records import JOINING, NodeRecord, format_blocks

log = logging.getLogger("swarm.client")
# reading the records takes 50 ms to over a second as the swarm grows: routes drawn within this
# long of a read share it (a node that left since costs a retry; one joined since, a wait)
RECORDS_FRESH_S = 1.0
JOIN_WAIT_S = 60.0  # how long a route waits for joining nodes to serve blocks nobody serves
JOIN_POLL_S = 1.0


class Client:
    """Connects to a swarm serving one model. Reuse one per process: it holds the DHT and head."""

    def __init__(
        self, initial_peers: Sequence[str], options: ClientOptions | None = None, **keywords
    ):
        """`options`, or ClientOptions' fields as `keywords` (model, wire_dtype, plaintext, ...:
        see swarm.client.options), or both: the keywords win."""
        if not initial_peers:
            raise ValueError("initial_peers is empty: pass the multiaddr a node printed")
        self.options = replace(options or ClientOptions(), **keywords)
        self.source = open_model(self.options.model)
        self.config = self.source.config
        self.fingerprint = self.source.fingerprint()
        self._heads: dict[str, Head] = {}
        self._drafts: dict[str, DraftModel] = {}  # draft models by path, loaded once
        self.tuners = TunerPool()  # what speculation learnt of each route, for the next reply
        self._weights: dict[str, str] = {}  # peer -> the weight format its record announces
        self._tokenizer = None
        self._loading = threading.Lock()  # tokenizer and heads load once, whatever the threads
        self.dht = start_dht(initial_peers, client_mode=True)
        self.loop = TrioThread()
        self.logits = LogitsBatcher()  # sessions stepping together share the head's matmul
        self.router = Router(self.loop.run)  # round trips, step times, our sessions by node
        self._records: tuple[float, list[NodeRecord]] | None = None  # (when read, records)
        self._records_lock = threading.Lock()  # one read at a time; routes wait for it
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
        """The model's node records in the DHT now (a read: 50 ms to seconds)."""
        records, _exp, _bad = read_nodes(self.dht, self.config.name, self.config.num_layers)
        return records

    def recent_nodes(self, max_age: float = RECORDS_FRESH_S) -> list[NodeRecord]:
        """The records as read at most `max_age` ago: routes drawn at once share one read."""
        with self._records_lock:
            now = time.monotonic()
            if self._records is None or now - self._records[0] >= max_age:
                self._records = (now, self.nodes())
            return self._records[1]

    def route(self, exclude: set[str] = frozenset(), max_length: int = 0) -> list[Hop]:
        """A route for a new session (of `max_length` tokens: nodes announcing room for it
        first, then those that could borrow it, swarm.client.routing.session_nodes), through
        none of `exclude`."""
        return self._route(exclude, max_length, hold=False)[0]

    def hold_route(self, exclude: set[str], max_length: int) -> tuple[list[Hop], float]:
        """route(), and a session of ours counted on it from now (the routes drawn next see
        it): the token `release_route` takes when the session ends."""
        return self._route(exclude, max_length, hold=True)

    def release_route(self, route: list[Hop], token: float) -> None:
        self.router.closed(route, token)

    def _leaving_out(self, exclude: set[str]) -> set[str]:
        """`exclude`, the nodes found computing wrongly and those shunned for now."""
        now = time.monotonic()
        shunned = {peer for peer, until in self.shunned.items() if until > now}
        return {*exclude, *self.suspects, *shunned}

    def _route(self, exclude: set[str], max_length: int, hold: bool) -> tuple[list[Hop], float]:
        exclude = self._leaving_out(exclude)
        every = self.recent_nodes()
        records = usable(every, self.fingerprint, exclude, self.options.plaintext)
        if missing_blocks(records, self.config.num_layers):
            # a node may have joined since, or a read under load missed a key: read again
            every, records = self._await_cover(exclude)
        if missing_blocks(records, self.config.num_layers):
            without_tls = len(usable(every, self.fingerprint, exclude, True)) - len(records)
            model = self.config.name
            if without_tls:
                model += f" ({without_tls} nodes run without TLS: Client(plaintext=True) uses them)"
            find_route(records, self.config.num_layers, self.fingerprint, model=model)
        records = session_nodes(records, self.config.num_layers, max_length)
        self._weights.update({r.peer: r.weights for r in records})
        records = decode_nodes(records, self.config.num_layers)
        name = self.config.name
        plaintext = self.options.plaintext
        return self.router.route(
            *(records, self.config.num_layers, self.fingerprint, exclude, name, plaintext, hold),
            span_ok=self.config.span_ok,
        )

    def prefill_hop(
        self, hop: Hop, tokens: int, max_length: int, exclude: set[str] = frozenset()
    ) -> Hop | None:
        """Where to compute a prompt of `tokens` for a session that decodes on `hop`, the last
        of its route: a prefill node for the same blocks and weights if the swarm has one
        worth the cache's transfer (swarm.client.routing.pick_prefill); None: on `hop`."""
        if not self.options.disaggregate or tokens < PREFILL_MIN_TOKENS:
            return None
        weights = self._weights.get(hop.peer)
        exclude = self._leaving_out(exclude)
        records = [
            r
            for r in usable(self.recent_nodes(), self.fingerprint, exclude, self.options.plaintext)
            if r.weights == weights  # the same cache format, or the handoff is refused
        ]
        dtype = torch.float32 if weights == "float32" else torch.bfloat16
        cache = tokens * KVCache.bytes_per_token(self.config, hop.end - hop.start, dtype, hop.start)
        # a Gated DeltaNet layer's state goes with it, the same size at any length
        delta = sum(self.config.is_delta(i) for i in range(hop.start, hop.end))
        cache += delta * State.nbytes(self.config.delta) if delta else 0
        r = pick_prefill(records, hop, cache, max_length, self.router.estimates(records))
        return None if r is None else r.hop(hop.start, hop.end)

    def _await_cover(self, exclude: set[str]) -> tuple[list[NodeRecord], list[NodeRecord]]:
        """The records read anew, and the usable ones; while nodes announcing themselves
        joining would serve the blocks missing, read again each JOIN_POLL_S until they do, up
        to JOIN_WAIT_S (a replacement loads its span in seconds to a minute)."""
        deadline, said = time.monotonic() + JOIN_WAIT_S, False
        while True:
            every = self.recent_nodes(max_age=JOIN_POLL_S / 2)
            records = usable(every, self.fingerprint, exclude, self.options.plaintext)
            gaps = missing_blocks(records, self.config.num_layers)
            joining = [
                r for r in every
                if r.state == JOINING and r.fingerprint == self.fingerprint
                and r.peer not in exclude
            ]  # fmt: skip
            if not gaps or missing_blocks(records + joining, self.config.num_layers):
                return every, records
            if time.monotonic() >= deadline:
                return every, records
            if not said:
                log.warning(
                    "no online node serves blocks %s; waiting up to %.0f s for %d joining",
                    format_blocks(gaps), JOIN_WAIT_S, len(joining),
                )  # fmt: skip
                said = True
            time.sleep(JOIN_POLL_S)

    def observe_step(self, route: list[Hop], seconds: float) -> None:
        """A one-token step through `route` took `seconds` (see Router.observe_step)."""
        self.router.observe_step(route, seconds)

    # ---- sessions ----------------------------------------------------------------------------

    def remote_session(
        self, route: list[Hop], max_length: int, handoff: Hop | None = None, picking=None
    ) -> RemoteSession:
        """A session on the nodes of `route`, not opened yet; `handoff`: the node its last hop
        hands it to once the prompt is in (see prefill_hop); `picking`: how the last hop
        picks the tokens (swarm.protocol.Picking), where it does."""
        return RemoteSession(
            route,
            self.fingerprint,
            self.config.hidden,
            max_length,
            self.options.wire_dtype,
            self.options.step_timeout,
            prefill_chunk=self.options.prefill_chunk,
            own_dtype=self.config.wire_dtype,
            handoff=handoff,
            with_ids=bool(self.config.per_layer),
            picking=picking,
        )

    def head(self, route: list[Hop]) -> Head:
        """The head for `route`: float32 where every hop computes in float32 (the exact path,
        token-identical to transformers), else the file's own formats, as the nodes keep theirs."""
        if unknown := [h.peer for h in route if h.peer not in self._weights]:
            # a hop the route was not drawn with (a session handed over to a replica): its
            # record says its weights; once, whether it has one or not
            self._weights.update({r.peer: r.weights for r in self.nodes()})
            self._weights.update({p: "" for p in unknown if p not in self._weights})
        exact = route and all(self._weights.get(h.peer) == "float32" for h in route)
        weights = "float32" if exact else "auto"
        with self._loading:
            if weights not in self._heads:
                self._heads[weights] = Head.load(self.source, weights)
        return self._heads[weights]

    def session(self, max_length: int, speculative: str | None = None) -> InferenceSession:
        """A session of up to `max_length` tokens; `speculative` (default: the client's
        option) as ClientOptions.speculative says, for the Decoding it runs."""
        return InferenceSession(self, max_length, self.drafter(speculative))

    def drafter(self, speculative: str | None = None) -> Drafter | None:
        """None for "off"; prompt lookup for "lookup"; else the draft model at that path,
        loaded once (DraftRefused if its vocabulary is not the served model's). A model with
        Gated DeltaNet layers decodes a token a step: SpeculationRefused if asked by name."""
        if self.config.delta is not None:  # its states keep no earlier position to rewind to
            if speculative not in (None, "off"):
                raise SpeculationRefused(
                    f"{self.config.name} ({self.config.family}): speculative decoding needs"
                    " caches that rewind; its Gated DeltaNet states do not"
                )
            return None
        speculative = speculative or self.options.speculative
        if speculative == "off":
            return None
        if speculative == "lookup":
            return PromptLookup()
        with self._loading:
            if speculative not in self._drafts:
                self._drafts[speculative] = DraftModel(
                    speculative, self.source.tokenizer(), self.config.name
                )
        return self._drafts[speculative]

    def reply_text(self, stop: Sequence[str] = ()) -> ReplyText:
        """A reply's text as its tokens come, ending at this model's end of text or a stop."""
        return ReplyText(self.tokenizer, self.config.eos_token_ids, stop)

    def stream(
        self,
        prompt: str | list[dict[str, str]],
        max_new_tokens: int = MAX_NEW_TOKENS,
        stop: Sequence[str] = (),
        speculative: str | None = None,
        **sampling,
    ) -> ReplyStream:
        """The reply's text piece by piece as tokens arrive: iterate the ReplyStream, whose
        `tokens` are this reply's own, however many threads share the client, and whose
        `speculation` says what speculative decoding did. `sampling`: the fields of
        swarm.client.options.Sampling (greedy by default); `speculative`: see session()."""
        text = self.reply_text(stop)
        sampler = Sampler(Sampling(**sampling))
        pieces = self._pieces(prompt, max_new_tokens, sampler, text, speculative)
        return ReplyStream(pieces, text)

    def _pieces(
        self,
        prompt: str | list[dict[str, str]],
        max_new_tokens: int,
        sampler: Sampler,
        text: ReplyText,
        speculative: str | None,
    ) -> Generator[str, None, SpeculationStats]:
        ids = self.encode(prompt)
        with self.session(len(ids) + max_new_tokens, speculative) as session:
            decoding = Decoding(
                session, ids, max_new_tokens, sampler, session.drafter, pool=self.tuners
            )
            for token in decoding:
                piece, done = text.add(token)
                if piece:
                    yield piece
                if done:
                    return decoding.stats
            if tail := text.flush():
                yield tail
            return decoding.stats

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
