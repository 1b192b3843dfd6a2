"""The LM head shared by a client's sessions, its matmul batched across threads.

A client process serving many sessions (an HTTP API, a thread per user) computes a row of
logits per session per token. The LM head is the largest matrix a client holds and decode is
memory-bound, so rows that are ready together go through it as one matmul: the first caller
computes every row waiting when it starts, later callers queue meanwhile and the first of them
computes the next batch. Nobody waits for a batch to fill.

Only quantized heads batch: a float32 head (the exact path, token-identical to transformers)
computes each row alone, since a GEMM over several rows may round differently from one row's.
A quantized head's choices rest on rescored logits, which are computed row by row anyway.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from swarm.model.head import Head

MAX_ROWS = 32


@dataclass(eq=False)
class _Row:
    head: Head
    hidden: torch.Tensor  # [1, hidden]
    wake: threading.Event = field(default_factory=threading.Event)
    done: bool = False
    logits: torch.Tensor | None = None
    error: BaseException | None = None


class LogitsBatcher:
    def __init__(self, max_rows: int = MAX_ROWS):
        self.max_rows = max_rows
        self._lock = threading.Lock()
        self._waiting: list[_Row] = []
        self._busy = False
        self.batches = 0  # matmuls run, and rows through them: their ratio is the mean batch
        self.rows = 0

    def logits(self, head: Head, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [1, hidden] of a sequence's last token -> logits [vocab], float32."""
        if head.weights == "float32":
            return head.logits(hidden)
        row = _Row(head, hidden.reshape(1, -1))
        with self._lock:
            self._waiting.append(row)
            leading, self._busy = not self._busy, True
        if not leading:
            row.wake.wait()  # computed by another caller, or handed the next batch
        if not row.done:
            self._compute()
        if row.error is not None:
            raise row.error
        return row.logits

    def _compute(self) -> None:
        with self._lock:
            batch = self._waiting[: self.max_rows]
            del self._waiting[: self.max_rows]
        try:
            groups: dict[int, list[_Row]] = {}
            for row in batch:
                groups.setdefault(id(row.head), []).append(row)
            for rows in groups.values():
                try:
                    out = rows[0].head.logits_rows(torch.cat([r.hidden for r in rows]))
                    for r, logits in zip(rows, out):
                        r.logits = logits
                except Exception as exc:  # each caller gets it, raised in its own thread
                    for r in rows:
                        r.error = exc
        finally:
            with self._lock:
                self.batches += 1
                self.rows += len(batch)
                for r in batch:
                    r.done = True
                    r.wake.set()
                if self._waiting:
                    self._waiting[0].wake.set()  # it computes the next batch
                else:
                    self._busy = False
