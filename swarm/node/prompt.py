"""How a session cuts arriving prompt pieces into forward passes, sans IO.

The link may deliver a prompt in many small chunks, and a client may send it whole: pieces that
arrived while a pass waited are computed together, up to `pass_tokens` per forward pass, so one
pass costs little per token and a decode step waits behind at most one pass. A pass of a few
tokens waits a little for more (see `gather_wait`).
"""

from __future__ import annotations

import dataclasses

import torch

from swarm.protocol import Step

Piece = tuple[Step, torch.Tensor]  # a prefill step and its [1, tokens, hidden] activations


class PromptPieces:
    """Prefill pieces of one session not yet computed, oldest first."""

    def __init__(self) -> None:
        self.pending: list[Piece] = []
        self.since = 0.0  # when the oldest pending piece arrived
        self.prompt_end = -1  # the phase end of the latest pieces, to tell a new prompt
        self.prompt_since = 0.0  # when that prompt's first piece arrived

    def __bool__(self) -> bool:
        return bool(self.pending)

    def add(self, step: Step, hidden: torch.Tensor, now: float) -> None:
        if not self.pending:
            self.since = now
        if step.end != self.prompt_end:  # the first piece of a prompt
            self.prompt_end, self.prompt_since = step.end, now
        self.pending.append((step, hidden))

    def tokens_left(self) -> int:
        """Tokens the oldest pending prompt still needs, counted from its first pending piece."""
        if not self.pending:
            return 0
        first = self.pending[0][0]
        return first.end - first.pos

    def ready(self) -> int:
        """Tokens one pass could take now: the oldest prompt's, arrived in order."""
        tokens = 0
        for step, hidden in self.pending:
            if step.end != self.pending[0][0].end or step.pos != self.pending[0][0].pos + tokens:
                break
            tokens += hidden.shape[1]
        return tokens

    def wait(self, now: float, min_tokens: int, gather_s: float) -> float:
        return gather_wait(self.pending, self.since, now, min_tokens, gather_s)

    def take(self, limit: int, now: float) -> tuple[Step, torch.Tensor] | None:
        """One pass's worth: the step the pass starts at and the activations joined; None if
        nothing waits. What is left counts as arrived `now`."""
        batch = take_tokens(self.pending, limit)
        if self.pending:
            self.since = now
        if not batch:
            return None
        hidden = torch.cat([h for _, h in batch], dim=1) if len(batch) > 1 else batch[0][1]
        first = batch[0][0]
        if first.ids is not None and len(batch) > 1:
            first = dataclasses.replace(first, ids=tuple(i for m, _ in batch for i in m.ids))
        return first, hidden


def gather_wait(pending: list, since: float, now: float, min_tokens: int, gather_s: float) -> float:
    """How much longer a prefill pass should wait for more pieces: none once `pending` holds
    `min_tokens` or the end of its phase, else until `gather_s` after the oldest piece came.
    Each pass costs a fixed overhead whatever its size, so passes of a few tokens (a slow link
    delivers a prompt in small chunks) spend CPU the decode steps of other sessions need."""
    if not pending:
        return 0.0
    tokens = sum(h.shape[1] for _, h in pending)
    last, hidden = pending[-1]
    if tokens >= min_tokens or last.pos + hidden.shape[1] >= last.end:
        return 0.0
    return max(0.0, since + gather_s - now)


def take_tokens(pending: list, limit: int) -> list:
    """Pop up to `limit` tokens of consecutive prefill pieces of one phase from `pending`; a
    piece that does not fit is split, its rest left at the front."""
    batch: list = []
    taken = 0
    while pending and taken < limit:
        msg, hidden = pending[0]
        if batch and (msg.end != batch[0][0].end or msg.pos != batch[0][0].pos + taken):
            break  # another phase: its own pass
        n = hidden.shape[1]
        if taken + n <= limit:
            pending.pop(0)
            batch.append((msg, hidden))
            taken += n
            continue
        k = limit - taken
        head, rest = (None, None) if msg.ids is None else (msg.ids[:k], msg.ids[k:])
        batch.append((dataclasses.replace(msg, ids=head), hidden[:, :k]))
        pending[0] = (dataclasses.replace(msg, pos=msg.pos + k, ids=rest), hidden[:, k:])
        taken += k
    return batch
