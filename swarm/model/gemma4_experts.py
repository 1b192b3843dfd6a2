"""Gemma 4's mixture-of-experts layer (`enable_moe_block`, the 26B-A4B): a dense MLP and routed
experts side by side, transformers' Gemma4TextDecoderLayer / Gemma4TextRouter / Gemma4TextExperts.

The dense MLP reads the residual stream through the layer's MLP norm, the experts through their
own (`pre_feedforward_layernorm_2`); each output has its own norm, and their sum the layer's
post-MLP norm. The router reads the residual stream too: RMS-normed without a weight, times its
`scale` and hidden^-0.5, softmax, top-k renormalised, each weight times its expert's
`per_expert_scale`. config.json stacks a layer's experts: gate_up [experts, 2 x width, hidden]
(gate rows first), down [experts, hidden, width], and llama.cpp's file the same (ffn_gate_up_exps,
ffn_down_exps); swarm.model.gemma4 names the tensors.
"""

from __future__ import annotations

import torch

from swarm.model.config import ModelConfig
from swarm.model.experts import MLP, expert_rows
from swarm.model.linear import Linear
from swarm.model.norm import rms_norm
from swarm.model.weights import Fused, RawTensor, make_linear, release_freed_memory


class DenseAndExperts:
    """One Gemma 4 MoE layer's MLP part; called with the residual stream, not a normed one."""

    reads_residual = True

    def __init__(self, c: ModelConfig, dense: MLP, router: Linear, experts, norms, scales):
        self.c, self.dense, self.router, self.experts = c, dense, router, experts
        self.norms = norms  # mlp_norm, dense_out_norm, experts_in_norm, experts_out_norm
        self.router_scale, self.expert_scales = scales

    @classmethod
    def load(cls, c: ModelConfig, raw, norms: dict, weights: str, usable, activate, terms=None):
        def mlp(gate, up, down) -> MLP:
            gate_up = Fused.load([gate, up], weights, [None, None], usable, terms)
            return MLP(gate_up, make_linear(down, weights, None, usable, terms), activate)

        dense = mlp(raw["gate"], raw["up"], raw["down"])
        whole = {k: raw[f"experts.{k}"] for k in ("gate_up", "down")}
        width = c.expert_intermediate

        def expert(e: int) -> MLP:
            gate_up = expert_rows(whole["gate_up"], e, c.experts)  # gate's rows first
            gate, up = (RawTensor(f"expert.{e}", gate_up.kind, gate_up.data[r]) for r in halves)
            return mlp(gate, up, expert_rows(whole["down"], e, c.experts))

        halves = (slice(0, width), slice(width, 2 * width))

        experts = [expert(e) for e in range(c.experts)]
        whole.clear()  # the file's bytes, before release_freed_memory
        release_freed_memory()
        router = make_linear(raw["router"], "float32", None, usable)  # routing decides all
        scales = raw["router_scale"].float32(), raw["expert_scales"].float32()
        return cls(c, dense, router, experts, norms, scales)

    @property
    def linears(self) -> tuple[Linear, ...]:
        return (*self.dense.linears, self.router, *(x for e in self.experts for x in e.linears))

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h [rows, hidden] the residual stream (float32) -> the MLP part's output, before the
        layer's post-MLP norm: transformers' steps, experts added in ascending order."""
        c, norms = self.c, self.norms
        dense = self.dense(rms_norm(h, norms["mlp_norm"], c.rms_eps))
        dense = rms_norm(dense, norms["dense_out_norm"], c.rms_eps)
        scores = self.router(rms_norm(h, 1.0, c.rms_eps) * self.router_scale * c.hidden**-0.5)
        probs = torch.softmax(scores.float(), dim=-1)
        weights, chosen = torch.topk(probs, c.experts_used, dim=-1)  # [rows, used]
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.expert_scales[chosen]
        x = rms_norm(h, norms["experts_in_norm"], c.rms_eps)
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():
            rank, rows = torch.where(chosen.T == e)  # rows choosing e, and at which rank
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, rank, None])
        return dense + rms_norm(out, norms["experts_out_norm"], c.rms_eps)
