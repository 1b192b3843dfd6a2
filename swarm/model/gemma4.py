"""Gemma 4's text model (transformers `gemma4_text`): what its config.json says beyond Gemma 3's
fields, and the two pieces a block of it adds.

- Per-layer inputs: one table [vocab, layers x width] looked up by token id, plus a projection
  of the (scaled) main embeddings, RMS-normed, the two summed and scaled by 1/sqrt(2); each
  layer gates its slice into the residual stream after its MLP. A node computes its span's
  slices itself from the token ids each step carries (docs/design.md says why).
- KV sharing: the last `num_kv_shared_layers` layers have no k/v projections and attend over
  the keys and values of the last earlier layer of their kind (ModelConfig.kv_source); a span
  holding such a layer must hold its source (ModelConfig.check_span).

Full layers have their own head width and kv heads, and with `attention_k_eq_v` no v_proj;
their RoPE is "proportional" (a quarter of the frequencies turn). Scores are not scaled (q and
k are RMS-normed), values RMS-normed without a weight, norms are x * w (not Gemma 3's 1 + w).
"""

from __future__ import annotations

import torch

from swarm.errors import ProtocolError
from swarm.model.config import ModelConfig
from swarm.model.linear import Linear
from swarm.model.norm import rms_norm
from swarm.model.weights import RawTensor, make_linear

# tensors of a block beyond Gemma 3's: blocks.py's name -> (config.json's name, llama.cpp's)
BLOCK_NAMES = {
    "pl_gate": ("per_layer_input_gate", "inp_gate"),
    "pl_proj": ("per_layer_projection", "proj"),
    "pl_norm": ("post_per_layer_input_norm", "post_norm"),
    "layer_scalar": ("layer_scalar", "layer_output_scale"),
    # a mixture layer's (swarm.model.gemma4_experts)
    "dense_out_norm": ("post_feedforward_layernorm_1", "post_ffw_norm_1"),
    "experts_in_norm": ("pre_feedforward_layernorm_2", "pre_ffw_norm_2"),
    "experts_out_norm": ("post_feedforward_layernorm_2", "post_ffw_norm_2"),
    "router": ("router.proj", "ffn_gate_inp"),
    "router_scale": ("router.scale", "ffn_gate_inp.scale"),
    "expert_scales": ("router.per_expert_scale", "ffn_down_exps.scale"),
    "experts.gate_up": ("experts.gate_up_proj", "ffn_gate_up_exps"),
    "experts.down": ("experts.down_proj", "ffn_down_exps"),
}
EXPERT_TENSORS = tuple(BLOCK_NAMES)[4:]
# stored without ".weight": a buffer, the router's parameters, stacked experts (config.json);
# llama.cpp's two scales
OWN_ENDINGS = ("layer_scalar", "router.scale", "router.per_expert_scale", "experts.down_proj")
OWN_ENDINGS += ("experts.gate_up_proj", "ffn_gate_inp.scale", "ffn_down_exps.scale")
# the model's own, beside the blocks': the per-layer table, the projection, its norm, and the
# main embeddings the projection reads: config.json's names (after the text model's prefix,
# "model." or a multimodal folder's "model.language_model."), llama.cpp's
MODEL_TENSORS = {
    "table": ("embed_tokens_per_layer.weight", "per_layer_token_embd.weight"),
    "projection": ("per_layer_model_projection.weight", "per_layer_model_proj.weight"),
    "norm": ("per_layer_projection_norm.weight", "per_layer_proj_norm.weight"),
    "embed": ("embed_tokens.weight", "token_embd.weight"),
}


def model_tensor(prefix: str | None, key: str) -> str:
    """MODEL_TENSORS[key]'s name in a file whose text model is under `prefix` (None: GGUF)."""
    hf, gguf = MODEL_TENSORS[key]
    return gguf if prefix is None else prefix + hf


def text_model(cfg: dict) -> tuple[dict, str]:
    """A config.json's text model and the prefix of its tensors: a multimodal Gemma 4's
    text_config (its towers are not the text model's; tie_word_embeddings is the top level's)
    under "model.language_model."; any other config as it is, under "model."."""
    if cfg.get("model_type") != "gemma4" or not isinstance(cfg.get("text_config"), dict):
        return cfg, "model."
    text = {**cfg["text_config"], "model_type": "gemma4_text"}
    if "tie_word_embeddings" in cfg:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    for key in ("bos_token_id", "eos_token_id"):
        if text.get(key) is None and cfg.get(key) is not None:
            text[key] = cfg[key]
    return text, "model.language_model."


def _full_layer_shape(cfg: dict) -> tuple[int, int]:
    """(head_dim, kv_heads) of the full layers: config.json's per_layer_config (as transformers
    5.24 saves it) or global_head_dim / num_global_key_value_heads (its defaults: 512, and the
    kv heads only where attention_k_eq_v)."""
    per_layer = cfg.get("per_layer_config") or {}
    types = _layer_types(cfg)
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    own = [per_layer.get(str(i), per_layer.get(i)) for i in full]
    width, heads = cfg.get("head_dim"), cfg.get("num_key_value_heads")
    shapes = {(d.get("head_dim", width), d.get("num_key_value_heads", heads)) for d in own if d}
    if len(shapes) > 1:
        raise ValueError(f"full layers of differing shapes {sorted(shapes)} are not supported")
    if shapes:
        return shapes.pop()
    kv = cfg.get("num_global_key_value_heads") if cfg.get("attention_k_eq_v") else None
    return int(cfg.get("global_head_dim", 512)), int(kv or cfg["num_key_value_heads"])


def _layer_types(cfg: dict) -> list[str]:
    """Each layer's kind as transformers' Gemma4TextConfig makes it: config.json's list, or 5
    sliding then a full one over and over; the last layer full whatever the list says."""
    layers = cfg["num_hidden_layers"]
    default = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    types = list(cfg.get("layer_types") or default)
    types[-1] = "full_attention"
    return types


def refuse_hf(cfg: dict, where: str) -> None:
    """What this node does not compute of a Gemma 4 config.json, by name."""
    types = _layer_types(cfg)
    shared = cfg.get("num_kv_shared_layers", 0)
    first = len(types) - shared
    if shared and set(types[first:]) - set(types[:first]):
        raise ValueError(f"{where}: a KV-sharing layer has no earlier layer of its kind")


def hf_fields(cfg: dict, where: str) -> dict:
    """ModelConfig's Gemma 4 fields from a config.json."""
    refuse_hf(cfg, where)
    head_dim, kv_heads = _full_layer_shape(cfg)
    window = int(cfg.get("sliding_window", 512))
    return dict(
        windows=tuple(window if t == "sliding_attention" else None for t in _layer_types(cfg)),
        attention_scale=1.0,
        global_head_dim=head_dim,
        global_kv_heads=kv_heads,
        k_eq_v=bool(cfg.get("attention_k_eq_v", False)),
        v_norm=True,
        kv_shared=int(cfg.get("num_kv_shared_layers", 0)),
        wide_shared_mlp=bool(cfg.get("use_double_wide_mlp", False)),
        per_layer=int(cfg.get("hidden_size_per_layer_input") or 0),
        layer_scalars=True,
        **_experts(cfg),
    )


def _experts(cfg: dict) -> dict:
    if not cfg.get("enable_moe_block"):
        return {}
    return dict(
        experts=int(cfg["num_experts"]),
        experts_used=int(cfg["top_k_experts"]),
        expert_intermediate=int(cfg["moe_intermediate_size"]),
    )


def block_tensors(c: ModelConfig, layer: int) -> tuple[str, ...]:
    """The tensors (blocks.py's names) of Gemma 4's block `layer`: Gemma 3's, less a KV-sharing
    layer's k, v and k_norm and a full layer's v under attention_k_eq_v, plus its own."""
    if c.kv_source(layer) is not None:
        attention = ["q", "q_norm"]
    else:
        attention = ["q", "k", "q_norm", "k_norm"] + ([] if c.at(layer).k_eq_v else ["v"])
    names = ["attn_norm", *attention, "o", "mlp_norm", "gate", "up", "down"]
    names += ["attn_post_norm", "mlp_post_norm", "layer_scalar"]
    names += list(EXPERT_TENSORS) if c.moe(layer) else []
    return tuple(names + (["pl_gate", "pl_proj", "pl_norm"] if c.per_layer else []))


class Tail:
    """What a Gemma 4 layer does after its MLP: its per-layer input gated in (h + norm(proj(
    act(gate(h)) * input))), then the layer's scalar on the whole residual stream."""

    def __init__(self, gate: Linear | None, proj: Linear | None, norm, scalar, activate, eps):
        self.gate, self.proj, self.norm, self.scalar = gate, proj, norm, scalar
        self.activate, self.eps = activate, eps

    @property
    def linears(self) -> tuple[Linear, ...]:
        return () if self.gate is None else (self.gate, self.proj)

    def __call__(self, h: torch.Tensor, per_layer: torch.Tensor | None) -> torch.Tensor:
        """h [rows, hidden], per_layer [rows, width] (this layer's input of each row)."""
        if self.gate is not None:
            gated = self.activate(self.gate(h).float()) * per_layer
            h = h + rms_norm(self.proj(gated).float(), self.norm, self.eps)
        return h * self.scalar


class PerLayerInputs:
    """A span's per-layer inputs from token ids: its layers' columns of the table, its rows of
    the projection, the projection's norm, and the main embeddings the projection reads."""

    def __init__(self, config: ModelConfig, start: int, end: int, embed, table, projection, norm):
        self.c, self.start, self.end = config, start, end
        self.embed = embed  # RawTensor [vocab, hidden], rows looked up
        self.table = table  # RawTensor [vocab, (end - start) x width], rows looked up
        self.projection = projection  # Linear [(end - start) x width, hidden]
        self.norm = norm

    @classmethod
    def load(cls, source, start: int, end: int, weights: str, usable=None) -> PerLayerInputs:
        """Layers [start, end)'s share of `source`: the projection's rows a Linear in format
        `weights` (as the blocks' matrices are), float32 tables where that is float32."""
        c, width = source.config, source.config.per_layer
        name = lambda key: model_tensor(source.prefix, key)  # noqa: E731
        cols = slice(start * width, end * width)
        table = source.columns(name("table"), cols.start, cols.stop)
        if table.kind == "torch":  # safetensors: float32 where the blocks are
            data = table.data.float() if weights == "float32" else table.data
            table = RawTensor(table.name, "torch", data.contiguous())
        whole = source.raw(name("projection"))
        rows = RawTensor(whole.name, whole.kind, whole.data[cols])
        projection = make_linear(rows, weights, None, usable)
        embed = source.raw(name("embed"))
        norm = source.raw(name("norm")).float32()
        return cls(c, start, end, embed, table, projection, norm)

    @property
    def nbytes(self) -> int:
        """What grows with the layers held (the main embeddings, one table, do not)."""
        return self.table.data.nbytes + self.projection.nbytes

    @torch.inference_mode()
    def __call__(self, ids, n: int, start: int, end: int) -> torch.Tensor:
        """Layers [start, end)'s inputs for a step's `n` tokens `ids`: [n, end - start, width];
        ProtocolError where the step did not carry every id."""
        if ids is None or len(ids) != n:
            raise ProtocolError(
                f"{self.c.name} needs the token id of each of a step's {n} positions"
                f" (its layers have per-layer inputs); the step carried {len(ids or ())}"
            )
        ids, c, width = list(ids), self.c, self.c.per_layer
        cols = slice((start - self.start) * width, (end - self.start) * width)
        main = self.embed.rows(ids).float() * torch.tensor(c.hidden**0.5, dtype=torch.float32)
        projected = self.projection(main).float()[:, cols] * c.hidden**-0.5
        projected = rms_norm(projected.view(len(ids), end - start, width), self.norm, c.rms_eps)
        own = self.table.rows(ids)[:, cols] * torch.tensor(width**0.5, dtype=torch.float32)
        return (projected + own.view(len(ids), end - start, width)) * 2.0**-0.5
