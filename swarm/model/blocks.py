"""Llama decoder blocks for one span, with a per-session KV cache, on CPU.

Mirrors Hugging Face's Llama math (RMSNorm in float32, rotate-half RoPE, SDPA attention) so a
swarm's greedy tokens match the unsplit transformers model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarm.model.config import ModelConfig
from swarm.model.linear import (
    WEIGHT_FORMATS,
    Dense,
    Linear,
    RawTensor,
    make_linear,
    native_format,
    release_freed_memory,
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


class Rotary:
    def __init__(self, head_dim: int, theta: float):
        self.inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )

    def cos_sin(self, pos: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(pos, pos + n, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]  # [n, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [n, head_dim]
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass
class KVCache:
    """Keys and values for every layer of a span, preallocated to the session's max length."""

    keys: list[torch.Tensor]  # per layer [1, kv_heads, max_length, head_dim]
    values: list[torch.Tensor]
    length: int = 0

    @classmethod
    def allocate(
        cls, config: ModelConfig, layers: int, max_length: int, dtype: torch.dtype = torch.float32
    ) -> KVCache:
        shape = (1, config.kv_heads, max_length, config.head_dim)
        return cls(
            keys=[torch.zeros(shape, dtype=dtype) for _ in range(layers)],
            values=[torch.zeros(shape, dtype=dtype) for _ in range(layers)],
        )

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @staticmethod
    def bytes_per_token(
        config: ModelConfig, layers: int, dtype: torch.dtype = torch.float32
    ) -> int:
        return 2 * layers * config.kv_heads * config.head_dim * dtype.itemsize


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Block:
    """One decoder layer. The residual stream, norms and rotary run in float32; the matmuls in
    each Linear's own format (bfloat16 out of the quantized ones); attention in the cache's dtype.
    With float32 weights every cast is a no-op, so that path is transformers' float32 math."""

    def __init__(
        self,
        config: ModelConfig,
        norms: tuple[torch.Tensor, torch.Tensor],
        linears: dict[str, Linear],
    ):
        self.c = config
        self.attn_norm, self.mlp_norm = norms
        self.q, self.k, self.v, self.o, self.gate, self.up, self.down = (
            linears[name] for name in LINEARS
        )

    @classmethod
    def load(cls, config: ModelConfig, raw: dict[str, RawTensor], weights: str, usable) -> Block:
        def linear(name: str) -> Linear:
            bias = raw.get(name + ".bias")
            out = make_linear(raw[name], weights, None if bias is None else bias.float32(), usable)
            release_freed_memory()  # the conversion's temporaries, before the next matrix's
            return out

        norms = (raw["input_layernorm"].float32(), raw["post_attention_layernorm"].float32())
        return cls(config, norms, {name: linear(name) for name in LINEARS})

    @property
    def linears(self) -> tuple[Linear, ...]:
        return (self.q, self.k, self.v, self.o, self.gate, self.up, self.down)

    def forward(
        self,
        h: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pos: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        c = self.c
        _, n, _ = h.shape  # [1, tokens, hidden], float32
        x = rms_norm(h, self.attn_norm, c.rms_eps)
        q = self.q(x).float().view(1, n, c.heads, c.head_dim).transpose(1, 2)
        k = self.k(x).float().view(1, n, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.v(x).view(1, n, c.kv_heads, c.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin  # [1, heads, tokens, head_dim]
        k = k * cos + _rotate_half(k) * sin
        k_cache[:, :, pos : pos + n] = k
        v_cache[:, :, pos : pos + n] = v
        keys = k_cache[:, :, : pos + n]  # [1, kv_heads, pos + tokens, head_dim]
        values = v_cache[:, :, : pos + n]
        groups = c.heads // c.kv_heads
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
        if n == 1:
            mask = None
        else:
            # token i of this step sees every cached token and tokens <= i of its own
            mask = torch.ones(n, pos + n, dtype=torch.bool).tril(diagonal=pos)
        attn = F.scaled_dot_product_attention(
            q.to(k_cache.dtype), keys, values, attn_mask=mask, scale=c.head_dim**-0.5
        )
        attn = attn.transpose(1, 2).reshape(1, n, c.heads * c.head_dim)
        h = h + self.o(attn).float()
        x = rms_norm(h, self.mlp_norm, c.rms_eps)
        mlp = F.silu(self.gate(x)) * self.up(x)
        return h + self.down(mlp).float()


class Span:
    """Blocks [start, end) of a model. `forward` runs a contiguous sub-range of them."""

    def __init__(
        self, config: ModelConfig, start: int, end: int, blocks: list[Block], weights: str
    ):
        self.config, self.start, self.end, self.blocks = config, start, end, blocks
        self.weights = weights  # as asked for: "auto" keeps each tensor's own format
        self.rotary = Rotary(config.head_dim, config.rope_theta)
        # float32 weights are the exact mode: its cache stays float32 too
        self.cache_dtype = torch.float32 if weights == "float32" else torch.bfloat16

    @classmethod
    def load(
        cls, source, start: int, end: int, progress=None, weights: str = "auto", usable=None
    ) -> Span:
        """Blocks [start, end) of `source`, tensor by tensor, in format `weights` (one of
        WEIGHT_FORMATS; formats outside `usable`, those this CPU runs slowly, step down)."""
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights {weights!r} is not one of {WEIGHT_FORMATS}")
        source.config.check_span(start, end)
        blocks = []
        for i in range(start, end):
            blocks.append(Block.load(source.config, source.block_raw(i), weights, usable))
            if progress is not None:
                progress(i - start + 1, end - start)
        return cls(source.config, start, end, blocks, weights)

    @property
    def nbytes(self) -> int:
        """Bytes of the span's matrices and norms."""
        norms = sum(b.attn_norm.nbytes + b.mlp_norm.nbytes for b in self.blocks)
        return norms + sum(lin.nbytes for b in self.blocks for lin in b.linears)

    @property
    def formats(self) -> dict[str, int]:
        """How many matrices are held in each format."""
        counts: dict[str, int] = {}
        for b in self.blocks:
            for lin in b.linears:
                counts[lin.format] = counts.get(lin.format, 0) + 1
        return counts

    @property
    def format(self) -> str:
        """The span's weight format in one word: the format most of its matrices are in."""
        counts = self.formats
        return max(counts, key=counts.get)

    def allocate_cache(self, layers: int, max_length: int) -> KVCache:
        return KVCache.allocate(self.config, layers, max_length, self.cache_dtype)

    @torch.inference_mode()
    def forward(
        self, h: torch.Tensor, cache: KVCache, pos: int, start: int, end: int
    ) -> torch.Tensor:
        """h [1, tokens, hidden] at positions [pos, pos + tokens) through blocks [start, end)."""
        n = h.shape[1]
        h = h.float()
        cos, sin = self.rotary.cos_sin(pos, n)
        for i in range(start, end):
            layer = i - start  # the session's cache holds only the layers it uses
            h = self.blocks[i - self.start].forward(
                h, cache.keys[layer], cache.values[layer], pos, cos, sin
            )
        cache.length = pos + n
        return h


class Head:
    """The client's share of the model: embeddings, final norm and LM head.

    Embedding rows are dequantized from the file's own bytes when looked up; the LM head is a
    Linear in the format asked for (float32 keeps the exact path)."""

    def __init__(self, config: ModelConfig, embed: RawTensor, norm: torch.Tensor, lm_head: Linear):
        self.config, self.embed, self.norm, self.lm_head = config, embed, norm, lm_head
        self.weights = lm_head.format

    @classmethod
    def load(cls, source, weights: str = "auto", usable=None) -> Head:
        raw = source.head_raw()
        embed = raw["embed"]
        if weights == "float32" or isinstance(embed.data, torch.Tensor):
            # look-ups from a float32 table give the reference's exact rows; safetensors
            # tables are in memory anyway, kept in their own dtype (bfloat16 for real models)
            table = embed.float32() if weights == "float32" else embed.data
            embed = RawTensor(embed.name, "torch", table)
        lm_head = raw["lm_head"]
        if weights == "auto" and native_format(lm_head.kind) == "int8":
            # the head's error lands on the logits undiluted: requantizing the default model's
            # Q8_0 table to int8 rows cut top-1 agreement from 0.988 to 0.965, bfloat16 to 0.980
            weights = "bfloat16"
        if lm_head is raw["embed"] and weights == "float32":
            linear = Dense(embed.data)  # tied: one float32 table serves both
        else:
            linear = make_linear(lm_head, weights, usable=usable)
        head = cls(source.config, embed, raw["norm"].float32(), linear)
        release_freed_memory()
        return head

    @torch.inference_mode()
    def embed_tokens(self, ids: list[int]) -> torch.Tensor:
        return self.embed.rows(ids).unsqueeze(0)  # [1, tokens, hidden]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [1, hidden] of the last token -> logits [vocab], float32."""
        x = rms_norm(hidden.float(), self.norm, self.config.rms_eps)
        return self.lm_head(x).float().reshape(-1)
