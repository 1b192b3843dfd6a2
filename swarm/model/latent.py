"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), with the latent as the cache.

A token's keys and values are not cached per head: each layer keeps the token's normed latent
(kv_rank values) and its one rotated key shared by every head (rope values), 576 a token for
DeepSeek-V3 where its 128 heads' expanded keys and values would be 40,960. Attention expands the
cached latents through kv_b into each head's k (nope dims, then the shared rotated ones) and v,
as transformers does over its own latent cache, so the float32 path is transformers' steps.

Shapes: q [rows, heads, nope + rope]; a cache's keys [1, 1, capacity, kv_rank] (the latents),
its values [1, 1, capacity, rope] (the rotated shared keys).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from swarm.model.config import ModelConfig
from swarm.model.linear import Linear, native_format
from swarm.model.norm import rms_norm
from swarm.model.rope import rotate
from swarm.model.weights import RawTensor, make_linear, release_freed_memory

# transformers' DeepseekV3RMSNorm of q_a_layernorm and kv_a_layernorm: its default, not the
# config's rms_norm_eps (devtools.hf_to_gguf refuses a checkpoint where the two differ)
LATENT_EPS = 1e-6


def kv_b_of_split(k_b: RawTensor, v_b: RawTensor, heads: int) -> RawTensor:
    """kv_b [heads * (nope + v), kv_rank] from llama.cpp's split attn_k_b (each head's
    [kv_rank, nope], transposed) and attn_v_b (each head's [v, kv_rank])."""
    k = k_b.float32().reshape(heads, -1, k_b.shape[-1]).transpose(1, 2)  # [heads, nope, rank]
    v = v_b.float32().reshape(heads, -1, v_b.shape[-1])  # [heads, v, rank]
    return RawTensor("attn_kv_b", "torch", torch.cat((k, v), dim=1).flatten(0, 1).contiguous())


class LatentAttention:
    """One layer's latent attention: its projections, and attention over a latent cache."""

    def __init__(self, config: ModelConfig, norms, q: list[Linear], kv_a: Linear, kv_b: Linear):
        self.c, self.norms = config, norms  # q_a_norm (with a q bottleneck), kv_a_norm
        self.q, self.kv_a, self.kv_b = q, kv_a, kv_b  # q: [q_proj] or [q_a_proj, q_b_proj]
        rope = config.latent.rope
        # DeepSeek's rotated dims come in adjacent pairs: gathered into rotate-half order,
        # which turns them by the same products transformers' interleaved rotation computes
        pairs = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
        self.pairs = pairs if config.latent.interleaved else None

    @classmethod
    def load(cls, config: ModelConfig, raw, norms, weights: str, usable, terms) -> LatentAttention:
        """From a block's tensors (blocks.py's names): kv_b whole (safetensors) or as llama.cpp
        splits it (k_b, v_b)."""

        def linear(name_or_raw) -> Linear:
            one = raw[name_or_raw] if isinstance(name_or_raw, str) else name_or_raw
            bias = None
            if isinstance(name_or_raw, str) and name_or_raw + ".bias" in raw:
                bias = raw[name_or_raw + ".bias"].float32()
            out = make_linear(one, weights, bias, usable, terms)
            release_freed_memory()
            return out

        q = [linear("q_a"), linear("q_b")] if config.latent.q_rank else [linear("q")]
        if "kv_b" in raw:
            kv_b = linear("kv_b")
        else:
            k_b = raw["k_b"]
            # "auto" holds it as it would the file's own tensor, not in float32
            held = native_format(k_b.kind) if weights == "auto" else weights
            kv_b = make_linear(kv_b_of_split(k_b, raw["v_b"], config.heads), held, None, usable)
        return cls(config, norms, q, linear("kv_a"), kv_b)

    @property
    def linears(self) -> tuple[Linear, ...]:
        return (*self.q, self.kv_a, self.kv_b)

    def project(self, x: torch.Tensor, cos, sin):
        """x [rows, hidden] (normed) -> q [rows, heads, nope + rope] rotated, the normed
        latents [rows, kv_rank] and the rotated shared keys [rows, rope]."""
        c, lat = self.c, self.c.latent
        rows = x.shape[0]
        if lat.q_rank:
            q_a, q_b = self.q
            q = q_b(rms_norm(q_a(x).float(), self.norms["q_a_norm"], LATENT_EPS))
        else:
            q = self.q[0](x)
        q = q.float().reshape(rows, c.heads, lat.nope + lat.rope)
        kv = self.kv_a(x).float()
        latent = rms_norm(kv[:, : lat.kv_rank], self.norms["kv_a_norm"], LATENT_EPS)
        q_rot, k_rot = q[..., lat.nope :], kv[:, None, lat.kv_rank :]
        if self.pairs is not None:
            q_rot, k_rot = q_rot[..., self.pairs], k_rot[..., self.pairs]
        q = torch.cat((q[..., : lat.nope], rotate(q_rot, cos, sin)), dim=-1)
        return q, latent, rotate(k_rot, cos, sin)[:, 0]

    def attend(self, q, latent, k_rot, keys, values, pos: int) -> torch.Tensor:
        """One session's tokens at positions [pos, pos + n): their latents and shared keys into
        its cache (keys, values), then q [n, heads, nope + rope] over every position so far
        -> [n, heads * v]."""
        c, lat = self.c, self.c.latent
        n = q.shape[0]
        keys[0, 0, pos : pos + n] = latent
        values[0, 0, pos : pos + n] = k_rot
        seen = pos + n
        kv = self.kv_b(keys[0, 0, :seen].float()).float().view(seen, c.heads, lat.nope + lat.v)
        k = torch.empty(c.heads, seen, lat.nope + lat.rope)
        k[..., : lat.nope] = kv[..., : lat.nope].transpose(0, 1)
        k[..., lat.nope :] = values[0, :, :seen].float()  # one shared key, every head
        v = kv[..., lat.nope :].transpose(0, 1)
        mask = None
        if n > 1 and pos > 0:
            # token i of this step sees every cached token and tokens <= i of its own
            mask = torch.ones(n, seen, dtype=torch.bool).tril(diagonal=pos)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
            is_causal=n > 1 and pos == 0, scale=c.scale,
        )  # fmt: skip
        return out[0].transpose(0, 1).reshape(n, c.heads * lat.v)

    def forward(self, x, keys, values, pos: int, cos, sin) -> torch.Tensor:
        """One session's tokens x [n, hidden] (normed) -> attention [n, heads * v]."""
        return self.attend(*self.project(x, cos, sin), keys, values, pos)

    def decode(self, x, caches, positions: list[int], cos, sin) -> torch.Tensor:
        """One token of each of several sessions, x [rows, hidden] (normed): projected
        together, attended each over its own cache -> [rows, heads * v]."""
        q, latent, k_rot = self.project(x, cos, sin)
        return torch.cat(
            [
                self.attend(q[i : i + 1], latent[i : i + 1], k_rot[i : i + 1], k, v, pos)
                for i, ((k, v), pos) in enumerate(zip(caches, positions))
            ]
        )
