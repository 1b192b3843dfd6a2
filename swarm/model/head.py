"""The client's share of a model: embeddings in, final norm and LM head out."""

from __future__ import annotations

import threading

import torch

from swarm.model.config import ModelConfig
from swarm.model.embedding import embed_rows
from swarm.model.gguf_file import unmap_pages
from swarm.model.kept_rows import KeptRows
from swarm.model.linear import Dense, Linear
from swarm.model.norm import rms_norm
from swarm.model.weights import RawTensor, make_linear, release_freed_memory

RESCORED = 64  # the quantized head's top candidates whose logits are recomputed exactly


class Head:
    """The client's share of the model: embeddings, final norm and LM head.

    Embedding rows are dequantized from the file's own bytes when looked up; the LM head is a
    Linear in the format asked for (float32 keeps the exact path). A quantized LM head scores
    the whole vocabulary, then its top RESCORED logits are recomputed in float32 from the
    file's rows: the head's error lands on the logits undiluted (int8 rows of the default
    model's Q8_0 table alone cut top-1 agreement from 0.988 to 0.965), but only the leaders
    decide greedy and top-p choices, and the int8 head reads half the bfloat16 head's bytes."""

    def __init__(
        self,
        config: ModelConfig,
        embed: RawTensor,
        norm: torch.Tensor,
        lm_head: Linear,
        exact: RawTensor | None = None,
    ):
        self.config, self.embed, self.norm, self.lm_head = config, embed, norm, lm_head
        # the LM head's rows as the file holds them, for rescoring (those rescored kept)
        self.exact = None if exact is None else KeptRows(exact)
        self.weights = lm_head.format

    @classmethod
    def load(cls, source, weights: str = "auto", usable=None, terms: int | None = None) -> Head:
        raw = source.head_raw()
        embed = raw["embed"]
        if weights == "float32" or isinstance(embed.data, torch.Tensor):
            # look-ups from a float32 table give the reference's exact rows; safetensors
            # tables are in memory anyway, kept in their own dtype (bfloat16 for real models)
            table = embed.float32() if weights == "float32" else embed.data
            embed = RawTensor(embed.name, "torch", table)
        lm_head = raw["lm_head"]
        tied = lm_head is raw["embed"]
        if tied and weights == "float32":
            linear = Dense(embed.data)  # tied: one float32 table serves both
        else:
            linear = make_linear(lm_head, weights, usable=usable, terms=terms)
        exact = None
        if linear.format in ("int8", "int4"):
            exact = embed if tied else lm_head
        norm = raw["norm"].float32() + source.config.norm_offset
        head = cls(source.config, embed, norm, linear, exact)
        for table in (raw["embed"], lm_head):  # read whole once to convert; now a row a time
            unmap_pages(table.data)
        release_freed_memory()
        return head

    @torch.inference_mode()
    def embed_tokens(self, ids: list[int]) -> torch.Tensor:
        return embed_rows(self.embed, self.config, ids)  # [1, tokens, hidden]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [1, hidden] of the last token -> logits [vocab], float32."""
        return self.logits_rows(hidden.reshape(1, -1))[0]

    @torch.inference_mode()
    def logits_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [rows, hidden], one row per sequence -> logits [rows, vocab], float32."""
        x = rms_norm(hidden.float(), self.norm, self.config.rms_eps)
        logits = self.lm_head(x).float()
        if self.exact is not None:
            top = logits.topk(RESCORED, dim=-1).indices  # [rows, RESCORED]
            rows = self.exact.rows(top.reshape(-1).tolist()).view(*top.shape, -1)
            logits.scatter_(-1, top, torch.einsum("rh,rkh->rk", x, rows))
        if (cap := self.config.final_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class LazyHead:
    """A span's head where the span ends the model: loaded at its first use, once, as a client
    would load it (the same format for the same weights), for a last hop that picks tokens."""

    def __init__(self, source, weights: str = "auto"):
        self._source, self._weights = source, head_format(weights)
        self._lock = threading.Lock()
        self._head: Head | None = None

    def get(self) -> Head:
        with self._lock:
            if self._head is None:
                self._head = Head.load(self._source, self._weights)
            return self._head


def head_format(weights: str) -> str:
    """The format a node's head takes for its span's `weights`: a client's, for the same tokens."""
    return "float32" if weights == "float32" else "auto"


def head_bytes(source, weights: str) -> int:
    """What a LazyHead for a span of `weights` holds once loaded (the source's `head_nbytes`,
    nothing read); 0 where the files here cannot tell."""
    try:
        return source.head_nbytes(head_format(weights))
    except (OSError, KeyError, ValueError):  # MissingShards is an OSError
        return 0
