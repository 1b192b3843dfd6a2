"""Rows of a quantized table in float32, dequantized once each and kept: a quantized LM head
rescores its top candidates exactly every step (swarm.model.head), and the same common tokens
lead step after step. Dequantizing them again each time (gguf's numpy, 64 rows) cost 2.6 ms a
step at 8B width on a Q4_K table and 0.3 ms on the default model's Q8_0 one, on the path of
every token and of every row of a verification round."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np
import torch

from swarm.model.weights import RawTensor

KEPT_BYTES = 32 << 20  # float32 rows kept a table: 14,563 of the default model's, 2,048 at 8B


class KeptRows:
    """`table`'s rows as `RawTensor.rows` gives them, the least recently used dropped past
    `budget` bytes. Safe to share between threads (sessions of one client)."""

    def __init__(self, table: RawTensor, budget: int = KEPT_BYTES):
        self.table = table
        rows, width = table.shape
        self.most = max(1, min(rows, budget // (4 * width)))
        self._width = width
        # [most, width], allocated at first use; numpy's, whose copies stay on this thread
        # (torch spreads a 64-row gather over its threads, and on a client sharing its cores
        # with busy nodes each such call waited milliseconds for a thread to get a core)
        self._buffer: np.ndarray | None = None
        self._slots: OrderedDict[int, int] = OrderedDict()  # row id -> slot, oldest use first
        self._lock = threading.Lock()
        self.dequantized = 0  # rows dequantized so far (each kept row once)

    def rows(self, ids: list[int]) -> torch.Tensor:
        """float32 [len(ids), width], row i being table row ids[i]."""
        wanted = list(dict.fromkeys(ids))
        if len(wanted) > self.most:  # more than the budget holds at once: not kept
            self.dequantized += len(wanted)
            return self.table.rows(ids)
        with self._lock:
            if self._buffer is None:
                self._buffer = np.empty((self.most, self._width), dtype=np.float32)
            missing = []
            for i in wanted:
                if i in self._slots:
                    self._slots.move_to_end(i)  # this call's rows are the last to be dropped
                else:
                    missing.append(i)
            if missing:
                fresh = self.table.rows(missing).numpy()
                self.dequantized += len(missing)
                for i, row in zip(missing, fresh):
                    free = len(self._slots)
                    slot = free if free < self.most else self._slots.popitem(last=False)[1]
                    self._buffer[slot] = row
                    self._slots[i] = slot
            index = np.fromiter((self._slots[i] for i in ids), dtype=np.int64, count=len(ids))
            return torch.from_numpy(self._buffer.take(index, axis=0))
