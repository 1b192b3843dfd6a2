"""Llama decoder blocks for one span, with a per-session KV cache, on CPU.

Mirrors Hugging Face's Llama math (RMSNorm in float32, rotate-half RoPE, SDPA attention) so a
swarm's greedy tokens match the unsplit transformers model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarm.model.config import Llama3Rope, ModelConfig
from swarm.model.linear import (
    WEIGHT_FORMATS,
    Dense,
    Fused,
    Linear,
    RawTensor,
    make_linear,
    release_freed_memory,
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(variance + eps))


def llama3_frequencies(inv_freq: torch.Tensor, rope: Llama3Rope) -> torch.Tensor:
    """`inv_freq` [head_dim/2] as Llama 3.1 scales it (the same float32 steps as transformers,
    so the exact path stays exact)."""
    low_wavelen = rope.original_max / rope.low_freq_factor
    high_wavelen = rope.original_max / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    between = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(between, blended, scaled)


class Rotary:
    """cos and sin of every position up to the longest seen, computed once (transformers'
    formula, so the float32 path stays bit-exact) and indexed per step."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        llama3: Llama3Rope | None = None,
        freq_factors: tuple[float, ...] = (),
    ):
        self.inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )  # [head_dim/2]
        if llama3 is not None:
            self.inv_freq = llama3_frequencies(self.inv_freq, llama3)
        if freq_factors:
            if len(freq_factors) != len(self.inv_freq):
                raise ValueError(
                    f"{len(freq_factors)} RoPE frequency factors for {len(self.inv_freq)}"
                    " frequencies"
                )
            self.inv_freq = self.inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
        self.cos = self.sin = torch.empty(0, head_dim)

    def _grow(self, length: int) -> None:
        length = max(length, 2 * len(self.cos), 256)
        positions = torch.arange(length, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]  # [length, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [length, head_dim]
        self.cos, self.sin = emb.cos(), emb.sin()

    def cos_sin(self, pos: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [pos, pos + n): cos, sin [n, head_dim]."""
        if pos + n > len(self.cos):
            self._grow(pos + n)
        return self.cos[pos : pos + n], self.sin[pos : pos + n]

    def at(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One position per row: cos, sin [rows, head_dim]."""
        if max(positions) + 1 > len(self.cos):
            self._grow(max(positions) + 1)
        index = torch.tensor(positions)
        return self.cos[index], self.sin[index]


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


class Block:
    """One decoder layer. The residual stream, norms and rotary run in float32; the matmuls in
    each Linear's own format (bfloat16 out of the quantized ones); attention in float32 over the
    cache (a bfloat16 cache is widened for the pass: CPU attention in bfloat16 measured 7x
    slower for one query). With float32 weights every cast is a no-op, so that path is
    transformers' float32 math."""

    def __init__(
        self,
        config: ModelConfig,
        norms: tuple[torch.Tensor, torch.Tensor],
        qkv: Fused,
        o: Linear,
        gate_up: Fused,
        down: Linear,
    ):
        self.c = config
        self.attn_norm, self.mlp_norm = norms
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down

    @classmethod
    def load(cls, config: ModelConfig, raw: dict[str, RawTensor], weights: str, usable) -> Block:
        def bias(name: str) -> torch.Tensor | None:
            b = raw.get(name + ".bias")
            return None if b is None else b.float32()

        def fused(*names: str) -> Fused:
            out = Fused.load([raw[n] for n in names], weights, [bias(n) for n in names], usable)
            release_freed_memory()  # the conversion's temporaries, before the next matrix's
            return out

        def linear(name: str) -> Linear:
            out = make_linear(raw[name], weights, bias(name), usable)
            release_freed_memory()
            return out

        norms = (raw["input_layernorm"].float32(), raw["post_attention_layernorm"].float32())
        return cls(
            config,
            norms,
            fused("q_proj", "k_proj", "v_proj"),
            linear("o_proj"),
            fused("gate_proj", "up_proj"),
            linear("down_proj"),
        )

    @property
    def linears(self) -> tuple[Linear, ...]:
        """The matrices as held (fused ones count once; `Linear.matrices` says how many)."""
        return (*self.qkv.linears, self.o, *self.gate_up.linears, self.down)

    def _attention_inputs(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [rows, hidden] -> q [rows, heads, head_dim], k, v [rows, kv_heads, head_dim],
        q and k rotated to each row's position (cos, sin [rows, head_dim]) in one go."""
        c = self.c
        rows = h.shape[0]
        qkv = self.qkv(rms_norm(h, self.attn_norm, c.rms_eps))
        qk_heads = c.heads + c.kv_heads
        qk = qkv[:, : qk_heads * c.head_dim].float().reshape(rows, qk_heads, c.head_dim)
        cos, sin = cos[:, None], sin[:, None]
        qk = qk * cos + _rotate_half(qk) * sin
        v = qkv[:, qk_heads * c.head_dim :].reshape(rows, c.kv_heads, c.head_dim)
        return qk[:, : c.heads], qk[:, c.heads :], v

    def _finish(self, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The attention output [rows, heads * head_dim] through o, then the MLP."""
        h = h + self.o(attn).float()
        gate, up = self.gate_up(rms_norm(h, self.mlp_norm, self.c.rms_eps)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up).float()

    def forward(
        self,
        h: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pos: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """One session's tokens h [tokens, hidden] at positions [pos, pos + tokens)."""
        c = self.c
        n = h.shape[0]
        q, k, v = self._attention_inputs(h, cos, sin)
        k_cache[0, :, pos : pos + n] = k.transpose(0, 1)
        v_cache[0, :, pos : pos + n] = v.transpose(0, 1)
        keys = k_cache[:, :, : pos + n].float()  # [1, kv_heads, pos + tokens, head_dim]
        values = v_cache[:, :, : pos + n].float()
        q = q.transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, head_dim]
        if n == 1 or pos == 0:
            mask = None
        else:
            # token i of this step sees every cached token and tokens <= i of its own
            mask = torch.ones(n, pos + n, dtype=torch.bool).tril(diagonal=pos)
        attn = F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=mask,
            is_causal=n > 1 and pos == 0,
            scale=c.head_dim**-0.5,
            enable_gqa=True,
        )
        return self._finish(h, attn[0].transpose(0, 1).reshape(n, c.heads * c.head_dim))

    def decode(
        self,
        h: torch.Tensor,
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        positions: list[int],
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """One token for each of several sessions, h [rows, hidden], row i at positions[i] in
        its own cache: the matmuls run on the stacked rows, attention per session."""
        c = self.c
        q, k, v = self._attention_inputs(h, cos, sin)
        out = []
        for i, ((k_cache, v_cache), pos) in enumerate(zip(caches, positions)):
            k_cache[0, :, pos] = k[i]
            v_cache[0, :, pos] = v[i]
            out.append(
                F.scaled_dot_product_attention(
                    q[i, :, None].unsqueeze(0),  # [1, heads, 1, head_dim]
                    k_cache[:, :, : pos + 1].float(),
                    v_cache[:, :, : pos + 1].float(),
                    scale=c.head_dim**-0.5,
                    enable_gqa=True,
                )
            )
        attn = torch.cat(out).view(len(positions), c.heads * c.head_dim)
        return self._finish(h, attn)


class Span:
    """Blocks [start, end) of a model. `forward` runs a contiguous sub-range of them."""

    def __init__(
        self, config: ModelConfig, start: int, end: int, blocks: list[Block], weights: str
    ):
        self.config, self.start, self.end, self.blocks = config, start, end, blocks
        self.weights = weights  # as asked for: "auto" keeps each tensor's own format
        self.rotary = Rotary(
            config.head_dim, config.rope_theta, config.rope_llama3, config.rope_freq_factors
        )
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
        """How many of the model's matrices are held in each format."""
        counts: dict[str, int] = {}
        for b in self.blocks:
            for lin in b.linears:
                counts[lin.format] = counts.get(lin.format, 0) + lin.matrices
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
        x = h.reshape(n, -1).float()
        cos, sin = self.rotary.cos_sin(pos, n)
        for i in range(start, end):
            layer = i - start  # the session's cache holds only the layers it uses
            x = self.blocks[i - self.start].forward(
                x, cache.keys[layer], cache.values[layer], pos, cos, sin
            )
        cache.length = pos + n
        return x.view(1, n, -1)

    @torch.inference_mode()
    def decode(
        self, h: torch.Tensor, caches: list[KVCache], positions: list[int], start: int, end: int
    ) -> torch.Tensor:
        """One token for each of several sessions, h [sessions, hidden], session i's at
        positions[i] in caches[i], through blocks [start, end): one pass for all of them."""
        x = h.float()
        cos, sin = self.rotary.at(positions)
        for i in range(start, end):
            layer = i - start
            kv = [(cache.keys[layer], cache.values[layer]) for cache in caches]
            x = self.blocks[i - self.start].decode(x, kv, positions, cos, sin)
        for cache, pos in zip(caches, positions):
            cache.length = pos + 1
        return x


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
        self.exact = exact  # the LM head's rows as the file holds them, for rescoring
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
        tied = lm_head is raw["embed"]
        if tied and weights == "float32":
            linear = Dense(embed.data)  # tied: one float32 table serves both
        else:
            linear = make_linear(lm_head, weights, usable=usable)
        exact = None
        if linear.format in ("int8", "int4"):
            exact = embed if tied else lm_head
        head = cls(source.config, embed, raw["norm"].float32(), linear, exact)
        release_freed_memory()
        return head

    @torch.inference_mode()
    def embed_tokens(self, ids: list[int]) -> torch.Tensor:
        return self.embed.rows(ids).unsqueeze(0)  # [1, tokens, hidden]

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
        return logits
