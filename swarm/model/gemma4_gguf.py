"""Gemma 4 from GGUF as llama.cpp's converter writes it (Gemma4Model in its conversion package's
gemma.py): what its metadata says beyond Gemma 3's keys, read into ModelConfig's Gemma 4 fields.

llama.cpp keeps per-layer values where layers differ: `head_count_kv` and, with the
double-wide MLP of the KV-sharing layers, `feed_forward_length` as arrays; the full layers'
head width as `key_length` and the sliding ones' as `key_length_swa`; the layer kinds as
`sliding_window_pattern` (true: sliding). The full layers' proportional RoPE is a `rope_freqs`
table (1 for each frequency that turns, 1e30 for the others: a frequency divided by it is 0 to
float32); keys as values is not a key but a full layer without `attn_v`. Scores are not scaled,
norms are x * w: llama.cpp's file holds the checkpoint's norms as they are.
"""

from __future__ import annotations

from collections.abc import Callable

from swarm.model.config import Rope

ARCH = "gemma4"
# the sliding layers' keys, where the generic reader asks for the one key all layers share
_SLIDING = ("attention.key_length", "attention.value_length", "rope.dimension_count")
_TURNED, _STILL = 1.0, 1e29  # rope_freqs: a frequency that turns, one held at 0 (1e30)


def scalars(field: Callable) -> Callable:
    """`field` as families.config_from_gguf reads every architecture's keys: the sliding
    layers' head width and RoPE dims, the first layer's value of a per-layer array, no period
    for the layer kinds (gguf_fields sets every Gemma 4 value from the arrays themselves)."""

    def read(key: str, default=...):
        local = key.removeprefix(f"{ARCH}.")
        if local == "attention.sliding_window_pattern":
            return 0
        if local in _SLIDING:
            value = field(f"{key}_swa", None)
            if value is not None:
                return value
        value = field(key) if default is ... else field(key, default)
        return value[0] if isinstance(value, (list, tuple)) else value

    return read


def _per_layer(field: Callable, key: str, layers: int, name: str) -> list:
    value = field(f"{ARCH}.{key}")
    value = list(value) if isinstance(value, (list, tuple)) else [value] * layers
    if len(value) != layers:
        raise ValueError(f"{name}: {ARCH}.{key} has {len(value)} values for {layers} layers")
    return value


def _one(values: list, key: str, kind: str, name: str) -> int:
    if len(set(values)) > 1:
        raise ValueError(f"{name}: {kind} layers of differing {key} {sorted(set(values))}")
    return int(values[0])


def gguf_fields(field: Callable, tensors, name: str, freq_factors: Callable) -> dict:
    """ModelConfig's Gemma 4 fields from a GGUF file's metadata (`field(key, default)`) and
    tensor names; ValueError naming what llama.cpp wrote that is not computed here."""
    layers = int(field(f"{ARCH}.block_count"))
    sliding = [bool(s) for s in _per_layer(field, "attention.sliding_window_pattern", layers, name)]
    window = int(field(f"{ARCH}.attention.sliding_window"))
    full = [i for i in range(layers) if not sliding[i]]
    kinds = {"sliding": [i for i in range(layers) if sliding[i]], "full": full}
    kv = _per_layer(field, "attention.head_count_kv", layers, name)
    kv_heads = {k: _one([kv[i] for i in ls], "kv heads", k, name) for k, ls in kinds.items() if ls}
    width = {"full": int(field(f"{ARCH}.attention.key_length"))}
    width["sliding"] = int(field(f"{ARCH}.attention.key_length_swa", width["full"]))
    for kind, w in width.items():
        said = "_swa" if kind == "sliding" else ""
        if int(field(f"{ARCH}.attention.value_length{said}", w)) != w:
            raise ValueError(f"{name}: {kind} layers' values not as wide as their keys")
        if int(field(f"{ARCH}.rope.dimension_count{said}", w)) != w:
            raise ValueError(f"{name}: {kind} layers' RoPE over part of a head is not supported")
    shared = int(field(f"{ARCH}.attention.shared_kv_layers", 0))
    ffn = _per_layer(field, "feed_forward_length", layers, name)
    wide = ffn != [ffn[0]] * layers
    if wide and ffn != [ffn[0]] * (layers - shared) + [2 * ffn[0]] * shared:
        raise ValueError(f"{name}: feed_forward_length {ffn}: only the KV-sharing layers' wider")
    # a full layer with keys of its own here (with shards absent, maybe none: then none of
    # this node's layers is one, and the switch changes nothing it computes)
    own = [i for i in full if i < layers - shared and f"blk.{i}.attn_k.weight" in tensors]
    rope = Rope(
        float(field(f"{ARCH}.rope.freq_base")),
        proportion=_share(tensors, freq_factors, width["full"], name),
    )
    experts = int(field(f"{ARCH}.expert_count", 0))
    return dict(
        windows=tuple(window if s else None for s in sliding),
        head_dim=width["sliding"],
        kv_heads=kv_heads.get("sliding", kv_heads.get("full")),
        global_head_dim=width["full"],
        global_kv_heads=kv_heads.get("full", 0),
        intermediate=int(ffn[0]),
        rope=rope,
        local_rope=Rope(float(field(f"{ARCH}.rope.freq_base_swa", 10_000.0))),
        rotary_dim=0,
        attention_scale=1.0,
        k_eq_v=bool(own) and f"blk.{own[0]}.attn_v.weight" not in tensors,
        v_norm=True,
        kv_shared=shared,
        wide_shared_mlp=wide,
        per_layer=int(field(f"{ARCH}.embedding_length_per_layer_input", 0)),
        layer_scalars=True,
        experts=experts,
        experts_used=int(field(f"{ARCH}.expert_used_count")) if experts else 0,
        expert_intermediate=int(field(f"{ARCH}.expert_feed_forward_length")) if experts else 0,
    )


def _share(tensors, freq_factors: Callable, head_dim: int, name: str) -> float:
    """The share of a full layer's frequencies that turn (Rope.proportion) from rope_freqs:
    ones, then 1e30s; any other table is a scaling this does not compute."""
    if "rope_freqs.weight" not in tensors:
        return 1.0
    factors = freq_factors()
    turned = next((i for i, f in enumerate(factors) if f != _TURNED), len(factors))
    if len(factors) != head_dim // 2 or any(f < _STILL for f in factors[turned:]):
        raise ValueError(f"{name}: rope_freqs other than Gemma 4's proportional RoPE")
    # transformers turns the first int(share * head_dim // 2): where 2 * turned / head_dim
    # rounds one short, half a frequency over
    share = 2 * turned / head_dim
    return share if int(share * head_dim // 2) == turned else (2 * turned + 1) / head_dim
