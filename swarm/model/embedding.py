"""Token ids to the first block's input: rows of the embedding table, dequantized from the file's
own bytes only for the ids looked up, times the family's scale (Gemma's sqrt(hidden)).

The client's head and the node serving block 0 hold the same table and give the same float32
rows, so a route's first hop can take token ids off the wire (4 bytes a token) instead of their
activations (2 bytes a value: 1.1 KB a token for the default model, 8 KB at Llama-3-8B's width).
"""

from __future__ import annotations

import logging

import torch

from swarm.model.config import ModelConfig
from swarm.model.weights import RawTensor


def embed_rows(table: RawTensor, config: ModelConfig, ids: list[int]) -> torch.Tensor:
    """Rows of `table` for `ids`, scaled as the family scales them: [1, tokens, hidden]."""
    rows = table.rows(ids)
    if config.embed_scale is not None:  # Gemma: the scale rounded to float32 first
        rows = rows * torch.tensor(config.embed_scale, dtype=rows.dtype)
    return rows.unsqueeze(0)


class Embedding:
    """A node's embedding table (its span starts at block 0): looked up a row at a time, the
    file's pages mapped, not read whole."""

    def __init__(self, config: ModelConfig, table: RawTensor):
        self.config, self.table = config, table
        self.vocab = table.shape[0]

    @classmethod
    def load(cls, source) -> Embedding | None:
        """`source`'s table, or None where this node cannot read it (a split file's shard
        holding it is missing here): then the client sends activations, as before."""
        try:
            table = source.embed_raw()
        except (OSError, KeyError, ValueError) as exc:
            logging.getLogger("swarm.model").info("no embedding table here (%s)", exc)
            return None
        return cls(source.config, table)

    def __call__(self, ids: list[int]) -> torch.Tensor:
        # no inference_mode here: a first hop looks rows up on its event loop at every step,
        # where entering that mode costs more than the look-up (it records no graph anyway:
        # the table's tensors ask for no gradients)
        return embed_rows(self.table, self.config, ids)
