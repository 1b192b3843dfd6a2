"""Decoder blocks for one span, with a per-session KV cache, on CPU.

One block, every family: the variants (norm form, q/k norms, post-norms, activation, fused
projections, attention scale and softcap, sliding windows, RoPE per layer) are data in the
ModelConfig (swarm.model.families fills it). The math mirrors transformers' (RMSNorm in
float32, rotate-half RoPE, SDPA attention), so a swarm's greedy tokens match the unsplit
transformers model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from swarm.model import kernels, qwen35
from swarm.model.config import ModelConfig
from swarm.model.deltanet import GatedDeltaNet
from swarm.model.eager import eager_attention
from swarm.model.embedding import Embedding
from swarm.model.experts import MLP, Experts
from swarm.model.families import block_tensors
from swarm.model.fast_layers import FastLayers
from swarm.model.gemma4 import PerLayerInputs, Tail
from swarm.model.gemma4_experts import DenseAndExperts
from swarm.model.head import LazyHead
from swarm.model.kvcache import KVCache as KVCache
from swarm.model.kvcache import ring_slots as ring_slots
from swarm.model.latent import LatentAttention
from swarm.model.linear import WEIGHT_FORMATS, Linear
from swarm.model.norm import rms_norm
from swarm.model.rope import Rotary, rotate
from swarm.model.weights import Fused, make_linear, release_freed_memory

ACTIVATE = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class Block:
    """One decoder layer. The residual stream, norms and rotary run in float32; the matmuls in
    each Linear's own format (bfloat16 out of the quantized ones); attention in float32 over the
    cache (a bfloat16 cache is widened for the pass: CPU attention in bfloat16 measured 7x
    slower for one query; a decode step's, by swarm's kernels where they load, row by row as
    it reads the cache). With float32 weights every cast is a no-op, so that path is
    transformers' float32 math."""

    def __init__(
        self,
        config: ModelConfig,
        norms: dict[str, torch.Tensor],
        qkv: Fused | LatentAttention | GatedDeltaNet,
        o: Linear,
        mlp: MLP | Experts,
        sinks: torch.Tensor | None = None,
        tail: Tail | None = None,
        layer: int = 0,
        source: int | None = None,
    ):
        self.c = config  # as this layer computes (ModelConfig.at)
        self.sinks = sinks  # gpt-oss: [heads], a softmax column each (swarm.model.eager)
        self.norms = norms  # attn_norm, mlp_norm [, q_norm, k_norm, attn_post_norm, ...]
        self.qkv, self.o, self.mlp = qkv, o, mlp
        self.tail = tail  # Gemma 4: per-layer input and layer scalar (swarm.model.gemma4)
        # Gemma 4's KV sharing: the layer whose keys and values this one attends over (None:
        # its own); a layer other layers read stores what it attended over in a pass's `shared`
        self.layer, self.source = layer, source
        self.kv_heads = 0 if source is not None else config.kv_heads  # k, v computed here
        if "q_norm" in norms:  # one weight row per head of q and of k, normed in one go
            rows = [norms["q_norm"].expand(config.heads, -1)]
            rows += [norms["k_norm"].expand(self.kv_heads, -1)] if self.kv_heads else []
            self.qk_norm = torch.cat(rows)

    @classmethod
    def load(
        cls, config: ModelConfig, layer: int, raw, weights: str, usable, terms: int | None = None
    ) -> Block:
        """Block `layer` from its tensors (blocks.py's names), each held as make_linear holds
        it (`weights`, `usable`, `terms`); a tensor left unused is an error."""
        c = config.at(layer)
        activate = ACTIVATE[c.activation]

        def bias(name: str) -> torch.Tensor | None:
            return raw[name + ".bias"].float32() if name + ".bias" in raw else None

        def fused(names: tuple[str, ...], sizes: list[int]) -> Fused:
            if len(names) == 1:  # the file holds them fused (Phi-3)
                one = make_linear(raw[names[0]], weights, bias(names[0]), usable, terms)
                out = Fused([one], sizes)
            else:
                biases = [bias(n) for n in names]
                out = Fused.load([raw[n] for n in names], weights, biases, usable, terms)
            release_freed_memory()  # the conversion's temporaries, before the next matrix's
            return out

        def linear(name: str) -> Linear:
            out = make_linear(raw[name], weights, bias(name), usable, terms)
            release_freed_memory()
            return out

        norms = {
            n: raw[n].float32() + c.norm_offset
            for n in block_tensors(config, layer)
            if n.endswith("norm")
        }
        q, kv, ff = c.heads * c.head_dim, c.kv_heads * c.head_dim, c.intermediate
        if c.is_delta(layer):
            qkv = GatedDeltaNet.load(c, raw, weights, usable, terms)
        elif c.latent is not None:
            qkv = LatentAttention.load(c, raw, norms, weights, usable, terms)
        elif c.attn_gate:  # q_proj's rows: each head's query, then its gate: gates go last
            qkv = Fused.load([*qwen35.split_gate(raw, c.heads)], weights, [None] * 4, usable, terms)
        else:
            names = ("qkv",) if c.fused else tuple(n for n in ("q", "k", "v") if n in raw)
            qkv = fused(names, [q, kv, kv] if c.fused else [q, kv, kv][: len(names)])
        o = linear("o")
        if c.moe(layer) and c.layer_scalars:  # Gemma 4's: a dense MLP beside the experts
            mlp = DenseAndExperts.load(c, raw, norms, weights, usable, activate, terms)
        elif c.moe(layer):
            mlp = Experts.load(c, raw, weights, usable, activate, terms)
        else:
            gate_up = fused(("gate_up",) if c.fused else ("gate", "up"), [ff, ff])
            mlp = MLP(gate_up, linear("down"), activate)
        tail = None
        if c.layer_scalars:
            pl = [linear(n) for n in ("pl_gate", "pl_proj")] if c.per_layer else [None, None]
            scalar = raw["layer_scalar"].float32()
            tail = Tail(*pl, norms.get("pl_norm"), scalar, activate, c.rms_eps)
        sinks = raw["sinks"].float32() if c.sinks else None
        block = cls(c, norms, qkv, o, mlp, sinks, tail, layer, config.kv_source(layer))
        if unread := raw.unread():
            raise ValueError(f"{c.name}: tensors {sorted(unread)} were not used; refused")
        return block

    @property
    def linears(self) -> tuple[Linear, ...]:
        """The matrices as held (fused ones count once; `Linear.matrices` says how many)."""
        tail = () if self.tail is None else self.tail.linears
        return (*self.qkv.linears, self.o, *self.mlp.linears, *tail)

    @property
    def nbytes(self) -> int:
        norms = sum(t.nbytes for t in self.norms.values())
        return norms + sum(lin.nbytes for lin in self.linears)

    def _attention_inputs(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [rows, hidden] -> q [rows, heads, head_dim], k, v [rows, kv_heads, head_dim],
        q and k rotated to each row's position (cos, sin [rows, rotary dims]) in one go."""
        c = self.c
        rows = h.shape[0]
        qkv = self.qkv(rms_norm(h, self.norms["attn_norm"], c.rms_eps))
        qk_heads = c.heads + self.kv_heads
        qk = qkv[:, : qk_heads * c.head_dim].float().reshape(rows, qk_heads, c.head_dim)
        if c.qk_norm:
            qk = rms_norm(qk, self.qk_norm, c.rms_eps)
        qk = rotate(qk, cos, sin)
        # Gemma 4's attention_k_eq_v: the values are the keys as projected
        v_start = (c.heads if c.k_eq_v else qk_heads) * c.head_dim
        v_end = v_start + self.kv_heads * c.head_dim
        v = qkv[:, v_start:v_end].reshape(rows, self.kv_heads, c.head_dim)
        if c.v_norm:
            v = rms_norm(v.float(), 1.0, c.rms_eps)
        gate = qkv[:, v_end:] if c.attn_gate else None  # Qwen3.5's output gate
        return qk[:, : c.heads], qk[:, c.heads :], v, gate

    def _finish(self, h: torch.Tensor, attn: torch.Tensor, gate=None, per_layer=None):
        """The attention output [rows, heads * head_dim] (times sigmoid(gate) where the family
        gates it) through o, then the MLP (then Gemma 4's tail, with `per_layer` [rows, width]
        its per-layer input)."""
        c, norms = self.c, self.norms
        out = self.o(attn if gate is None else attn * torch.sigmoid(gate)).float()
        if c.post_norms:
            out = rms_norm(out, norms["attn_post_norm"], c.rms_eps)
        h = h + out
        residual = getattr(self.mlp, "reads_residual", False)  # Gemma 4's experts norm their own
        out = self.mlp(h if residual else rms_norm(h, norms["mlp_norm"], c.rms_eps))
        if c.post_norms:
            out = rms_norm(out, norms["mlp_post_norm"], c.rms_eps)
        return h + out if self.tail is None else self.tail(h + out, per_layer)

    def _attend(self, q, keys, values, mask=None, causal=False) -> torch.Tensor:
        """q [1, heads, n, head_dim] over keys, values [1, kv_heads, m, head_dim]; `mask`
        [n, m] True where a query sees a key."""
        c = self.c
        if c.attn_softcap is None and self.sinks is None:
            return F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=causal, scale=c.scale, enable_gqa=True
            )
        return eager_attention(q, keys, values, c.scale, mask, causal, c.attn_softcap, self.sinks)

    def forward(self, h, k_cache, v_cache, pos: int, cos, sin, window, per_layer=None, shared=None):
        """One session's tokens h [tokens, hidden] at positions [pos, pos + tokens); `window`:
        the layer's sliding window (its cache then a ring of that many slots), or None;
        `per_layer` [tokens, width] Gemma 4's per-layer inputs; `shared` the pass's layer ->
        (keys, values, mask, causal) a layer attended over, for the layers reading its KV."""
        c = self.c
        n = h.shape[0]
        if not isinstance(self.qkv, Fused):  # latent attention, Gated DeltaNet: their own caches
            x = rms_norm(h, self.norms["attn_norm"], c.rms_eps)
            return self._finish(h, self.qkv.forward(x, k_cache, v_cache, pos, cos, sin))
        q, k, v, gate = self._attention_inputs(h, cos, sin)
        if n == 1 and self._kernels_for(k_cache) is not None:
            # a lone session's decode step: attended as Block.decode's are, ring or not (only
            # a ring wraps: a position past a full cache stays an error)
            slots = k_cache.shape[2]
            slot = pos % slots if window is not None else pos
            attn = self._step_attention(q[0], k[0], v[0], k_cache, v_cache, slot, pos)
            return self._finish(h, attn.view(1, c.heads * c.head_dim), gate, per_layer)
        q = q.transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, head_dim]
        if self.source is not None:  # the source layer ran earlier in this pass
            attn = self._attend(q, *shared[self.source])
        elif window is not None and pos + n > window:
            attn = self._windowed(q, k, v, k_cache, v_cache, pos, window, shared)
        else:  # every position so far fits the window: slot = position, nothing masked off
            k_cache[0, :, pos : pos + n] = k.transpose(0, 1)
            v_cache[0, :, pos : pos + n] = v.transpose(0, 1)
            keys = k_cache[:, :, : pos + n].float()  # [1, kv_heads, pos + tokens, head_dim]
            values = v_cache[:, :, : pos + n].float()
            mask = None
            if n > 1 and pos > 0:
                # token i of this step sees every cached token and tokens <= i of its own
                mask = torch.ones(n, pos + n, dtype=torch.bool).tril(diagonal=pos)
            seen = (keys, values, mask, n > 1 and pos == 0)
            if shared is not None:
                shared[self.layer] = seen
            attn = self._attend(q, *seen)
        attn = attn[0].transpose(0, 1).reshape(n, c.heads * c.head_dim)
        return self._finish(h, attn, gate, per_layer)

    def _windowed(self, q, k, v, k_cache, v_cache, pos: int, window: int, shared=None):
        """Attention of tokens [pos, pos + n) past the window: each sees the `window` positions
        ending at its own, from the ring's older keys (read before this step's overwrite them)
        and this step's; then the last `window` of this step's keys go into the ring."""
        n = k.shape[0]
        older = min(pos, window - 1)
        slots = torch.arange(pos - older, pos) % window
        keys = torch.cat((k_cache[0][:, slots], k.transpose(0, 1).to(k_cache.dtype)), dim=1)
        values = torch.cat((v_cache[0][:, slots], v.transpose(0, 1).to(v_cache.dtype)), dim=1)
        key_pos = torch.arange(pos - older, pos + n)
        query_pos = torch.arange(pos, pos + n)[:, None]
        mask = (key_pos <= query_pos) & (key_pos > query_pos - window)
        seen = (keys[None].float(), values[None].float(), mask, False)
        if shared is not None:
            shared[self.layer] = seen
        attn = self._attend(q, *seen)
        kept = min(n, window)
        slots = torch.arange(pos + n - kept, pos + n) % window
        k_cache[0][:, slots] = k[n - kept :].transpose(0, 1).to(k_cache.dtype)
        v_cache[0][:, slots] = v[n - kept :].transpose(0, 1).to(v_cache.dtype)
        return attn

    def _kernels_for(self, k_cache: torch.Tensor) -> kernels.Kernels | None:
        """swarm's kernels where they take one query row's attention over this cache: a
        bfloat16 one (a third of torch's time at 500 positions of 8B shape, a sixth at 2,000),
        no softcap, no sinks. The float32 cache of the exact mode keeps torch's float32 math."""
        no_kernel = self.c.attn_softcap is not None or self.sinks is not None
        if k_cache.dtype != torch.bfloat16 or no_kernel:
            return None
        return kernels.load()

    def _step_attention(self, q, k, v, k_cache, v_cache, slot: int, pos: int) -> torch.Tensor:
        """One token at `pos`: its k, v [kv_heads, head_dim] into cache slot `slot`, then its
        q [heads, head_dim] over the positions the cache holds for it -> [heads, head_dim].
        A layer reading another's KV writes nothing: that layer wrote the slot."""
        if self.source is None:
            k_cache[0, :, slot] = k
            v_cache[0, :, slot] = v
        seen = min(pos + 1, k_cache.shape[2])
        if (lib := self._kernels_for(k_cache)) is not None:
            return lib.attend(q, k_cache, v_cache, seen, self.c.scale)
        attn = self._attend(
            q[:, None].unsqueeze(0),  # [1, heads, 1, head_dim]
            k_cache[:, :, :seen].float(),
            v_cache[:, :, :seen].float(),
        )
        return attn[0, :, 0]

    def decode(
        self, h, caches, positions: list[int], cos, sin, per_layer=None, shared=None
    ) -> torch.Tensor:
        """One token for each of several sessions, h [rows, hidden], row i at positions[i] in
        its own cache: the matmuls run on the stacked rows, attention per session. A ring
        cache (sliding window) holds exactly the positions the token sees, in slot order.
        `per_layer`, `shared`: as `forward`'s (`shared` keeps, per row, a full ring that a
        later row of the pass rewrites: a verification round's rows share one cache)."""
        c = self.c
        if not isinstance(self.qkv, Fused):
            x = rms_norm(h, self.norms["attn_norm"], c.rms_eps)
            return self._finish(h, self.qkv.decode(x, caches, positions, cos, sin))
        q, k, v, gate = self._attention_inputs(h, cos, sin)
        kept = shared.get(self.source) if shared is not None and self.source is not None else None
        repeats = len({id(kc) for kc, _ in caches}) < len(caches)
        out, rings = [], []
        for i, ((k_cache, v_cache), pos) in enumerate(zip(caches, positions)):
            if kept is not None and kept[i] is not None:
                out.append(self._attend(q[i][:, None].unsqueeze(0), *kept[i])[0, :, 0])
                continue
            slot = pos % k_cache.shape[2]
            out.append(self._step_attention(q[i], k[i], v[i], k_cache, v_cache, slot, pos))
            full = repeats and pos + 1 >= k_cache.shape[2]
            rings.append((k_cache.float().clone(), v_cache.float().clone()) if full else None)
        if shared is not None and self.source is None:
            shared[self.layer] = rings
        attn = torch.stack(out).view(len(positions), c.heads * c.head_dim)
        return self._finish(h, attn, gate, per_layer)


class Span:
    """Blocks [start, end) of a model. `forward` runs a contiguous sub-range of them."""

    head: LazyHead | None = None  # the last block's span: the head, for a last hop that picks

    def __init__(
        self,
        config: ModelConfig,
        start: int,
        end: int,
        blocks: list[Block],
        weights: str,
        per_layer: PerLayerInputs | None = None,
        embedding: Embedding | None = None,
    ):
        self.config, self.start, self.end, self.blocks = config, start, end, blocks
        self.embedding = embedding  # block 0's span: token ids in (a route's first hop)
        self.weights = weights  # as asked for: "auto" keeps each tensor's own format
        ropes = {config.rotary_of(i) for i in range(start, end)}  # (rope, dims turned)
        self.rotaries = {rope: Rotary(*rope) for rope in ropes}
        self.per_layer = per_layer  # Gemma 4's per-layer inputs of these layers
        # float32 weights are the exact mode: its cache stays float32 too
        self.cache_dtype = torch.float32 if weights == "float32" else torch.bfloat16
        self.fast = FastLayers.build(config, start, blocks)  # plain layers in one C call

    @classmethod
    def load(
        cls,
        source,
        start: int,
        end: int,
        progress=None,
        weights: str = "auto",
        usable=None,
        terms: int | None = None,
    ) -> Span:
        """Blocks [start, end) of `source`, tensor by tensor, in format `weights` (one of
        WEIGHT_FORMATS; formats outside `usable`, those this CPU runs slowly, step down), swarm's
        kernels taking inputs in `terms` int8 terms (a node's --input-terms; None: auto)."""
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights {weights!r} is not one of {WEIGHT_FORMATS}")
        source.config.check_span(start, end)
        source.block_files(start, end)  # names any shard missing
        blocks = []
        for i in range(start, end):
            raw = source.block_raw(i)
            blocks.append(Block.load(source.config, i, raw, weights, usable, terms))
            if progress is not None:
                progress(i - start + 1, end - start)
        per_layer = None
        if source.config.per_layer:
            per_layer = PerLayerInputs.load(source, start, end, weights, usable)
        embedding = Embedding.load(source) if start == 0 else None
        span = cls(source.config, start, end, blocks, weights, per_layer, embedding)
        span.head = LazyHead(source, weights) if end == source.config.num_layers else None
        return span

    @property
    def nbytes(self) -> int:
        """Bytes of the span's matrices and norms (and Gemma 4's per-layer tables)."""
        return sum(b.nbytes for b in self.blocks) + getattr(self.per_layer, "nbytes", 0)

    @property
    def formats(self) -> dict[str, int]:
        """How many of the model's matrices are held in each format."""
        counts: dict[str, int] = {}
        for lin in (lin for b in self.blocks for lin in b.linears):
            counts[lin.format] = counts.get(lin.format, 0) + lin.matrices
        return counts

    @property
    def format(self) -> str:
        """The span's weight format in one word: the format most of its matrices are in."""
        counts = self.formats
        return max(counts, key=counts.get)

    def _per_layer_inputs(self, ids, n: int, start: int, end: int) -> torch.Tensor | None:
        """Layers [start, end)'s inputs from the token ids, or None where the model has none."""
        return None if self.per_layer is None else self.per_layer(ids, n, start, end)

    def allocate_cache(self, start: int, end: int, max_length: int) -> KVCache:
        """A session's cache for blocks [start, end) of this span."""
        return KVCache.allocate(self.config, start, end, max_length, self.cache_dtype)

    @torch.inference_mode()
    def forward(
        self, h: torch.Tensor, cache: KVCache, pos: int, start: int, end: int, ids=None
    ) -> torch.Tensor:
        """h [1, tokens, hidden] at positions [pos, pos + tokens) through blocks [start, end);
        `ids`: the tokens' ids, where the model has per-layer inputs (Gemma 4)."""
        n = h.shape[1]
        x = h.reshape(n, -1).float()
        turns = {rope: r.cos_sin(pos, n) for rope, r in self.rotaries.items()}
        if n == 1 and (y := self.fast.run(x, [cache], [pos], start, end, turns, True)) is not None:
            cache.length = pos + 1
            return y.view(1, 1, -1)
        inputs = self._per_layer_inputs(ids, n, start, end)
        shared: dict | None = {} if self.config.kv_shared else None
        for i in range(start, end):
            layer = i - start  # the session's cache holds only the layers it uses
            cos, sin = turns[self.config.rotary_of(i)]
            x = self.blocks[i - self.start].forward(
                *(x, *cache.layer(layer), pos, cos, sin),
                self.config.window(i),
                None if inputs is None else inputs[:, layer],
                shared,
            )
        cache.length = pos + n
        return x.view(1, n, -1)

    @torch.inference_mode()
    def decode(
        self,
        h: torch.Tensor,
        caches: list[KVCache],
        positions: list[int],
        start: int,
        end: int,
        ids=None,
    ) -> torch.Tensor:
        """One token for each of several sessions, h [sessions, hidden], session i's at
        positions[i] in caches[i], through blocks [start, end): one pass for all of them;
        `ids`: each row's token id, where the model has per-layer inputs (Gemma 4)."""
        x = h.float()
        turns = {rope: r.at(positions) for rope, r in self.rotaries.items()}
        if (y := self.fast.run(x, caches, positions, start, end, turns, False)) is not None:
            x, end = y, start  # every layer done
        inputs = self._per_layer_inputs(ids, len(positions), start, end)
        shared: dict | None = {} if self.config.kv_shared else None
        for i in range(start, end):
            layer = i - start
            kv = [cache.layer(layer) for cache in caches]
            cos, sin = turns[self.config.rotary_of(i)]
            pl = None if inputs is None else inputs[:, layer]
            x = self.blocks[i - self.start].decode(x, kv, positions, cos, sin, pl, shared)
        for cache, pos in zip(caches, positions):
            cache.length = pos + 1
        return x
