"""What a node or client needs to know about a model, independent of file format: its shape and
every variant of the decoder's math it uses (swarm.model.families fills it from a file)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Llama3Rope:
    """Llama 3.1's RoPE scaling: low frequencies (wavelengths past `original_max / low`) slowed
    by `factor`, high ones (under `original_max / high`) kept, those between blended."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max: int


@dataclass(frozen=True)
class YarnRope:
    """YaRN: each frequency blended between itself and itself / `factor` by a ramp over the
    dims that turn between `beta_fast` and `beta_slow` times in `original_max` positions (fast
    ones kept, slow ones interpolated); cos and sin then multiplied by `attention` (mscale)."""

    factor: float
    original_max: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention: float = 1.0
    truncate: bool = True  # the ramp's ends rounded outwards to whole dims (llama.cpp always)


@dataclass(frozen=True)
class Rope:
    """One RoPE: base, and the scaling applied to its frequencies (at most one kind)."""

    theta: float
    linear: float = 1.0  # positions divided by this (HF "linear" scaling)
    llama3: Llama3Rope | None = None
    freq_factors: tuple[float, ...] = ()  # divisors of each frequency (GGUF rope_freqs)
    yarn: YarnRope | None = None
    # Gemma 4's "proportional" RoPE: only this share of a head's frequencies turn (the others
    # are 0), each as it would over the whole head
    proportion: float = 1.0


@dataclass(frozen=True)
class Latent:
    """Multi-head latent attention's shape (DeepSeek-V2/V3, Kimi K2): q through a rank-`q_rank`
    bottleneck (0: one q_proj), k and v of every head expanded from one `kv_rank` latent a
    token, beside one `rope` wide key shared by all heads. A head's q and k are `nope` + `rope`
    wide, its v `v` wide; the cache holds the latent and the shared key (kv_rank + rope a token
    a layer)."""

    q_rank: int
    kv_rank: int
    nope: int
    rope: int
    v: int
    interleaved: bool = True  # the rotated dims in adjacent pairs (DeepSeek's layout)


@dataclass(frozen=True)
class Delta:
    """Gated DeltaNet's shape (Qwen3.5, Qwen3-Next): `layers` are linear attention, each with
    `k_heads` q/k heads of `k_dim` and `v_heads` value heads of `v_dim` (a q/k head serves
    v_heads / k_heads value heads), after a causal conv1d of `kernel` taps. A session keeps a
    fixed-size state a layer (swarm.model.deltanet), not a cache growing with positions."""

    layers: tuple[int, ...]
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    kernel: int
    llama_cpp: bool = False  # a GGUF file's: value heads tiled, A_log held as -exp(A_log)


ROUTERS = ("softmax", "sigmoid", "topk_softmax")
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    family: str  # a key of swarm.model.families.FAMILIES
    num_layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rope: Rope
    rms_eps: float
    vocab: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    max_position: int
    rotary_dim: int = 0  # leading dims of a head that RoPE turns (0: all); Phi-4-mini's 3/4
    local_rope: Rope | None = None  # sliding layers' own RoPE (Gemma 3's base 10,000)
    windows: tuple[int | None, ...] = ()  # per layer: tokens a query sees, None for all
    norm_offset: float = 0.0  # Gemma computes x * (1 + w): its HF files hold w
    qk_norm: bool = False  # an RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    post_norms: bool = False  # Gemma 2/3: a norm on attention's and the MLP's outputs too
    fused: bool = False  # q, k, v in one matrix and gate, up in another (Phi-3)
    activation: str = "silu"  # of the gate; one of ACTIVATIONS
    attention_scale: float = 0.0  # multiplies q.k (0: head_dim ** -0.5)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the logits
    embed_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden))
    wire_dtype: str = "float16"  # activations between nodes; Gemma's overflow float16
    experts: int = 0  # a mixture of experts' MLPs per layer (0: one dense MLP)
    experts_used: int = 0  # chosen per token
    expert_intermediate: int = 0
    shared_intermediate: int = 0  # Qwen2-MoE's shared expert (0: none)
    topk_norm: bool = True  # the chosen experts' weights renormalised to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers of a mixture model with a dense MLP
    router: str = "softmax"  # of the router's logits; one of ROUTERS
    # DeepSeek-V3: experts in `groups`, the tokens' choice among the best `groups_used` of them
    groups: int = 1
    groups_used: int = 1
    routed_scale: float = 1.0  # the chosen experts' weights multiplied by it
    shared_gated: bool = True  # the shared expert behind a sigmoid gate (Qwen2-MoE; not DeepSeek)
    latent: Latent | None = None  # multi-head latent attention (q, k, v as Latent says)
    mtp_layers: int = 0  # multi-token-prediction layers after the last: skipped, not computed
    sinks: bool = False  # gpt-oss: one learned logit a head, an extra softmax column (no value)
    swiglu_limit: float = 0.0  # gpt-oss's experts: gate, up clamped to it, (up + 1) * glu
    swiglu_alpha: float = 1.702  # glu = gate * sigmoid(alpha * gate) where swiglu_limit is set
    mxfp4_experts: bool = False  # gpt-oss's config.json: experts as MXFP4 _blocks and _scales
    delta: Delta | None = None  # Gated DeltaNet layers beside the full-attention ones
    attn_gate: bool = False  # attention's output times sigmoid(a gate q_proj also makes)
    # Gemma 4 (swarm.model.gemma4): full layers' own head width and kv heads (0: as the others)
    global_head_dim: int = 0
    global_kv_heads: int = 0
    k_eq_v: bool = False  # full layers have no v_proj: the values are the keys before k_norm
    v_norm: bool = False  # values RMS-normed, without a weight
    kv_shared: int = 0  # the last n layers read the KV of the last earlier layer of their kind
    wide_shared_mlp: bool = False  # those layers' MLP twice intermediate wide
    per_layer: int = 0  # width of each layer's input from the token ids (0: none)
    layer_scalars: bool = False  # each layer's output times its own stored scalar

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not one of {ACTIVATIONS}")
        if self.router not in ROUTERS:
            raise ValueError(f"router {self.router!r} is not one of {ROUTERS}")
        if self.windows and len(self.windows) != self.num_layers:
            raise ValueError(f"{len(self.windows)} windows for {self.num_layers} layers")

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def at(self, layer: int) -> ModelConfig:
        """The config as block `layer` computes: Gemma 4's full layers with their own head
        width, kv heads and keys as values, its KV-sharing layers' MLP maybe wider."""
        changes: dict = {}
        if self.window(layer) is None and (self.global_head_dim or self.global_kv_heads):
            changes["head_dim"] = self.global_head_dim or self.head_dim
            changes["kv_heads"] = self.global_kv_heads or self.kv_heads
        if self.k_eq_v and self.window(layer) is not None:
            changes["k_eq_v"] = False  # sliding layers keep their v_proj
        if self.wide_shared_mlp and self.kv_source(layer) is not None:
            changes["intermediate"] = 2 * self.intermediate
        return replace(self, **changes) if changes else self

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values layer `layer` attends over, where not its own:
        the last layer before the shared ones with the same window (None: its own)."""
        first = self.num_layers - self.kv_shared
        if layer < first:
            return None
        kind = self.window(layer)
        return max(i for i in range(first) if self.window(i) == kind)

    def rotary_of(self, layer: int) -> tuple[Rope, int]:
        """Layer `layer`'s RoPE and how many leading dims of a head it turns."""
        c = self.at(layer)
        return self.rope_of(layer), c.rotary_dim or c.head_dim

    @property
    def arch(self) -> str:
        """The family, with "experts/used" for a mixture: what a node's record says it serves."""
        return f"{self.family} {self.experts}/{self.experts_used}" if self.experts else self.family

    def moe(self, layer: int) -> bool:
        return self.experts > 0 and layer not in self.dense_layers

    def is_delta(self, layer: int) -> bool:
        return self.delta is not None and layer in self.delta.layers

    def rope_of(self, layer: int) -> Rope:
        if self.local_rope is not None and self.window(layer) is not None:
            return self.local_rope
        return self.rope

    @property
    def cache_widths(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(heads, width) of a layer's cached keys and of its values: under latent attention
        the latent and the shared rotated key, one "head" each."""
        if self.latent is not None:
            return (1, self.latent.kv_rank), (1, self.latent.rope)
        return (self.kv_heads, self.head_dim), (self.kv_heads, self.head_dim)

    @property
    def scale(self) -> float:
        return self.attention_scale or self.head_dim**-0.5

    def check_span(self, start: int, end: int) -> None:
        """Raises SpanError where layers [start, end) are not a span a node can compute: out
        of range, or holding a layer that reads the KV of a layer before `start`."""
        from swarm.errors import SpanError

        if not 0 <= start < end <= self.num_layers:
            raise SpanError(
                f"layers {start}:{end} are not a non-empty range inside 0:{self.num_layers}"
                f" of {self.name}"
            )
        if cut := self._kv_cut(start, end):
            raise SpanError(
                f"layers {start}:{end} of {self.name}: layer {cut[0]} reads the keys and"
                f" values of layer {cut[1]}, so a span holding layer {cut[0]} must hold"
                f" layer {cut[1]} too"
            )

    def span_ok(self, start: int, end: int) -> bool:
        """Whether one node may compute layers [start, end) of a session alone (check_span's
        rule, for placement and routing to choose among)."""
        return 0 <= start < end <= self.num_layers and self._kv_cut(start, end) is None

    def _kv_cut(self, start: int, end: int) -> tuple[int, int] | None:
        """(a layer of [start, end) that reads the KV of a layer before `start`, that layer)."""
        for layer in range(max(start, self.num_layers - self.kv_shared), end):
            if (source := self.kv_source(layer)) is not None and source < start:
                return layer, source
        return None
