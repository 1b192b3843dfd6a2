"""Llama decoder blocks for one span, with a per-session KV cache. Float32 on CPU.

Mirrors Hugging Face's Llama math (RMSNorm in float32, rotate-half RoPE, SDPA attention) so a
swarm's greedy tokens match the unsplit transformers model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarm.model.config import ModelConfig


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
    def allocate(cls, config: ModelConfig, layers: int, max_length: int) -> KVCache:
        shape = (1, config.kv_heads, max_length, config.head_dim)
        return cls(
            keys=[torch.zeros(shape) for _ in range(layers)],
            values=[torch.zeros(shape) for _ in range(layers)],
        )

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @staticmethod
    def bytes_per_token(config: ModelConfig, layers: int) -> int:
        return 2 * layers * config.kv_heads * config.head_dim * 4


class Block:
    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor]):
        self.c = config
        self.w = w

    def _proj(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name], self.w.get(name + ".bias"))

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
        _, n, _ = h.shape  # [1, tokens, hidden]
        x = rms_norm(h, self.w["input_layernorm"], c.rms_eps)
        q = self._proj(x, "q_proj").view(1, n, c.heads, c.head_dim).transpose(1, 2)
        k = self._proj(x, "k_proj").view(1, n, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self._proj(x, "v_proj").view(1, n, c.kv_heads, c.head_dim).transpose(1, 2)
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
            q, keys, values, attn_mask=mask, scale=c.head_dim**-0.5
        )
        attn = attn.transpose(1, 2).reshape(1, n, c.heads * c.head_dim)
        h = h + self._proj(attn, "o_proj")
        x = rms_norm(h, self.w["post_attention_layernorm"], c.rms_eps)
        mlp = F.silu(self._proj(x, "gate_proj")) * self._proj(x, "up_proj")
        return h + self._proj(mlp, "down_proj")


class Span:
    """Blocks [start, end) of a model. `forward` runs a contiguous sub-range of them."""

    def __init__(self, config: ModelConfig, start: int, end: int, blocks: list[Block]):
        self.config, self.start, self.end, self.blocks = config, start, end, blocks
        self.rotary = Rotary(config.head_dim, config.rope_theta)

    @classmethod
    def load(cls, source, start: int, end: int, progress=None) -> Span:
        source.config.check_span(start, end)
        blocks = []
        for i in range(start, end):
            blocks.append(Block(source.config, source.block_tensors(i)))
            if progress is not None:
                progress(i - start + 1, end - start)
        return cls(source.config, start, end, blocks)

    @torch.inference_mode()
    def forward(
        self, h: torch.Tensor, cache: KVCache, pos: int, start: int, end: int
    ) -> torch.Tensor:
        """h [1, tokens, hidden] at positions [pos, pos + tokens) through blocks [start, end)."""
        n = h.shape[1]
        cos, sin = self.rotary.cos_sin(pos, n)
        for i in range(start, end):
            layer = i - start  # the session's cache holds only the layers it uses
            h = self.blocks[i - self.start].forward(
                h, cache.keys[layer], cache.values[layer], pos, cos, sin
            )
        cache.length = pos + n
        return h


class Head:
    """The client's share of the model: embeddings, final norm and LM head."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor]):
        self.config = config
        self.embed = tensors["embed"]
        self.norm = tensors["norm"]
        self.lm_head = tensors["lm_head"]

    @torch.inference_mode()
    def embed_tokens(self, ids: list[int]) -> torch.Tensor:
        return self.embed[torch.tensor(ids)].unsqueeze(0)  # [1, tokens, hidden]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [1, hidden] of the last token -> logits [vocab]."""
        return F.linear(rms_norm(hidden, self.norm, self.config.rms_eps), self.lm_head).reshape(-1)
