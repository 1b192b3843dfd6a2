"""A reply as it is generated: tokens turned into text piece by piece, stop strings, and the
sampler that picks each token."""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any

from swarm.model.sampling import Sampler

__all__ = ["ReplyStream", "ReplyText", "Sampler"]


class ReplyText:
    """A reply's tokens turned into text as they come: pieces to emit, and whether the reply
    ended (end-of-text token or a stop string; text from a stop string on is never emitted).
    A tail that could be the start of a stop string is held back until the next token settles
    it, or `flush()` at the end lets it out. `eos_token_ids`: the model's end-of-text tokens
    (the tokenizer's own counts too)."""

    def __init__(self, tokenizer, eos_token_ids: Iterable[int], stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.eos = set(eos_token_ids)
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
    its token ids so far (an end-of-text token is not among them); once it has ended,
    `speculation` says what speculative decoding did (swarm.client.decoding.SpeculationStats)."""

    def __init__(self, pieces: Generator[str, None, Any], text: ReplyText):
        self._pieces, self._text = pieces, text
        self.speculation = None

    def __next__(self) -> str:
        try:
            return next(self._pieces)
        except StopIteration as end:
            self.speculation = end.value
            raise

    def close(self) -> None:
        """Stop early: the reply's session on the nodes closes now."""
        self._pieces.close()

    @property
    def tokens(self) -> list[int]:
        return list(self._text.tokens)
