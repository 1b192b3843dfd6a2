"""A draft model on the client: a small model of the served one's vocabulary, run by swarm's own
model code, proposing the greedy continuation of a session's tokens (speculative decoding)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from swarm.errors import ProtocolError
from swarm.model.blocks import KVCache, Span, ring_slots
from swarm.model.head import Head
from swarm.model.source import open_model
from swarm.protocol import MAX_REWIND


class DraftRefused(ValueError):
    """The draft model cannot draft for the served one: its vocabulary differs."""


class DraftModel:
    """Drafts with a whole model held here. Its cache follows the last sequence it was asked
    about, so proposing after a round costs only the tokens that came since."""

    def __init__(self, path: str, served_tokenizer, served_name: str, max_length: int = 8192):
        self.label = path  # which draft model: a tuner per draft model and route
        self.source = open_model(path)
        name = self.source.config.name
        if self.source.tokenizer().get_vocab() != served_tokenizer.get_vocab():
            raise DraftRefused(
                f"draft model {name} has another vocabulary than {served_name}: its drafts"
                " would be other tokens"
            )
        config = self.source.config
        self.span = Span.load(self.source, 0, config.num_layers)
        self.head = Head.load(self.source)
        self.max_length = max_length
        self._cache: KVCache | None = None
        self._fed: list[int] = []  # the tokens whose keys and values the cache holds
        self._lock = threading.Lock()  # one client, many sessions' threads

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        with self._lock, torch.inference_mode():
            if len(tokens) + k > self.max_length:
                return []
            h = self._follow(list(tokens))
            out: list[int] = []
            while True:
                out.append(int(self.head.logits(h[:, -1]).argmax()))
                if len(out) == k:
                    return out
                h = self._forward(out[-1:])

    def warm(self, tokens: Sequence[int]) -> None:
        """Feed the cache `tokens` ahead of a proposal: run beside the prompt's pass through
        the route, the first proposal then costs its drafts alone (a 97-token prompt's catch-up
        took 3-8 times a 4-token proposal on 8 of the default model's blocks)."""
        with self._lock, torch.inference_mode():
            if len(tokens) < self.max_length:
                self._follow(list(tokens))

    def _follow(self, tokens: list[int]) -> torch.Tensor:
        """Feed the cache what it lacks of `tokens`; the last token's hidden state."""
        same = 0
        for a, b in zip(self._fed, tokens[:-1]):
            if a != b:
                break
            same += 1
        if self._cache is None:
            self._cache = self.span.allocate_cache(0, self.span.end, self.max_length)
        try:
            self._cache.rewind(same)
        except ProtocolError:  # a sliding window lost what a rewind needs: start over
            self._cache, same = self.span.allocate_cache(0, self.span.end, self.max_length), 0
        self._fed = self._fed[:same]
        return self._forward(tokens[same:])

    def _forward(self, ids: list[int]) -> torch.Tensor:
        """Feed `ids` in passes a rewind can undo (no longer than a sliding window's ring)."""
        config = self.source.config
        most = ring_slots(config, 0, config.num_layers, self.max_length)
        for lo in range(0, len(ids), most):
            pos, piece = len(self._fed), ids[lo : lo + most]
            self._cache.keep_for_rewind(pos, len(piece), MAX_REWIND)
            embedded = self.head.embed_tokens(piece)
            h = self.span.forward(embedded, self._cache, pos, 0, self.span.end, ids=piece)
            self._fed += piece
        return h
