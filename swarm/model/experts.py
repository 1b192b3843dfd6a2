"""The MLPs of a block: the gated MLP, and a mixture of experts. In a mixture a router picks
`experts_used` of `experts` gated MLPs per row and mixes their outputs by its softmax weights
(renormalised over the chosen where the family does it); Qwen2-MoE adds a shared expert behind
a sigmoid gate.

Compute follows the rows: the rows of a pass (one session's prompt, or one token of each of
several sessions) are grouped by the experts they chose, and each chosen expert multiplies its
rows once; an expert no row chose is never touched. Experts stay in the file's formats, one
Linear each, so a layer holds about the file's bytes.
"""

from __future__ import annotations

import torch

from swarm.model.config import ModelConfig
from swarm.model.gptoss import ggml_mxfp4
from swarm.model.linear import Linear
from swarm.model.weights import Fused, RawTensor, make_linear, release_freed_memory


def expert_rows(raw: RawTensor, expert: int, experts: int) -> RawTensor:
    """Expert `expert`'s matrix out of a GGUF 3-D tensor of `experts` stacked ones (quantized
    ones come as [experts * rows, bytes per row], float ones as [experts, rows, cols])."""
    data = raw.data
    if data.ndim == 3:
        return RawTensor(raw.name, raw.kind, data[expert])
    rows = data.shape[0] // experts
    return RawTensor(raw.name, raw.kind, data[expert * rows : (expert + 1) * rows])


class MLP:
    """The gated MLP: down(activation(gate(x)) * up(x)), gate and up one matrix."""

    def __init__(self, gate_up: Fused, down: Linear, activate):
        self.gate_up, self.down, self.activate = gate_up, down, activate

    @property
    def linears(self) -> tuple[Linear, ...]:
        return (*self.gate_up.linears, self.down)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, hidden] -> [rows, hidden] float32."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.activate(gate) * up).float()


class ClampedMLP(MLP):
    """gpt-oss's expert: gate clamped above and up both sides at `limit`, then
    down((up + 1) * gate * sigmoid(alpha * gate)); gate and up carry biases."""

    def __init__(self, gate_up: Fused, down: Linear, limit: float, alpha: float):
        super().__init__(gate_up, down, None)
        self.limit, self.alpha = limit, alpha

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).float().chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return self.down((up + 1) * (gate * torch.sigmoid(gate * self.alpha))).float()


def _interleaved_mxfp4(whole: dict, e: int) -> tuple[RawTensor, ...]:
    """As `_interleaved`, from config.json's MXFP4 experts: codes [experts, rows, n, 16] and
    exponents [experts, rows, n] of gate_up (gate and up in alternate rows) and down, each a
    row of the matrix as Linears hold it; the matrices as GGUF's MXFP4 blocks."""
    codes = {p: whole[f"{p}.blocks"].data[e].numpy() for p in ("gate_up", "down")}
    exps = {p: whole[f"{p}.scales"].data[e].numpy() for p in ("gate_up", "down")}
    mats = (
        ggml_mxfp4(codes["gate_up"][::2], exps["gate_up"][::2]),
        ggml_mxfp4(codes["gate_up"][1::2], exps["gate_up"][1::2]),
        ggml_mxfp4(codes["down"], exps["down"]),
    )
    bias = whole["gate_up.bias"].data[e]
    out = tuple(RawTensor(f"expert.{e}", "MXFP4", m) for m in mats)
    biases = (bias[::2], bias[1::2], whole["down.bias"].data[e])
    return out + tuple(RawTensor(f"expert.{e}", "torch", b.contiguous()) for b in biases)


def _interleaved(whole: dict, e: int) -> tuple[RawTensor, ...]:
    """Expert e's gate, up and down (as Linears hold them: [out, in]) and their biases from
    config.json's stacked gpt-oss tensors: gate_up [experts, hidden, 2 x width] with gate
    and up in alternate columns, down [experts, width, hidden]."""
    gate_up, down = whole["gate_up"].data[e], whole["down"].data[e]
    bias = whole["gate_up.bias"].data[e]
    parts = (gate_up[:, ::2].T, gate_up[:, 1::2].T, down.T, bias[::2], bias[1::2])
    parts += (whole["down.bias"].data[e],)
    return tuple(RawTensor(f"expert.{e}", "torch", t.contiguous()) for t in parts)


class Experts:
    def __init__(
        self,
        config: ModelConfig,
        router: Linear,
        experts: list[MLP],
        shared: tuple[MLP, Linear | None] | None,
        choice_bias: torch.Tensor | None = None,
    ):
        self.c = config
        self.router, self.experts, self.shared = router, experts, shared
        self.choice_bias = choice_bias  # DeepSeek-V3's, added to the scores for the choice only

    @classmethod
    def load(
        cls, config: ModelConfig, raw, weights: str, usable, activate, terms: int | None = None
    ) -> Experts:
        """From per-expert tensors ("expert.{e}.gate", ...: safetensors) or stacked ones
        ("experts.gate", ...: GGUF's 3-D *_exps)."""
        c, n = config, config.experts
        kinds = ("gate", "up", "down", "gate_up")
        kinds += tuple(f"{k}.{t}" for k in ("gate_up", "down") for t in ("blocks", "scales"))
        whole = {k: raw[f"experts.{k}"] for k in kinds if f"experts.{k}" in raw}
        whole |= {
            f"{k}.bias": raw[f"experts.{k}.bias"]
            for k in ("gate", "up", "down", "gate_up")
            if f"experts.{k}.bias" in raw
        }
        stacked = "gate" in whole

        def part(e: int, name: str) -> RawTensor:
            return expert_rows(whole[name], e, n) if stacked else raw[f"expert.{e}.{name}"]

        def mlp(gate, up, down, biases=(None, None, None)) -> MLP:
            gate_up = Fused.load([gate, up], weights, list(biases[:2]), usable, terms)
            down = make_linear(down, weights, biases[2], usable, terms)
            if c.swiglu_limit:
                return ClampedMLP(gate_up, down, c.swiglu_limit, c.swiglu_alpha)
            return MLP(gate_up, down, activate)

        biases = {k: t.float32() for k, t in whole.items() if k.endswith("bias") and stacked}

        def expert(e: int) -> MLP:
            if "gate_up" in whole or "gate_up.blocks" in whole:  # gpt-oss's config.json
                split = _interleaved if "gate_up" in whole else _interleaved_mxfp4
                *mats, gb, ub, db = split(whole, e)
                return mlp(*mats, (gb.data, ub.data, db.data))
            mats = [part(e, p) for p in ("gate", "up", "down")]
            if biases:  # gpt-oss's GGUF: [experts, rows] biases
                return mlp(*mats, [biases[f"{p}.bias"][e] for p in ("gate", "up", "down")])
            return mlp(*mats)

        experts = [expert(e) for e in range(n)]
        whole.clear(), biases.clear()  # the file's bytes, before release_freed_memory
        release_freed_memory()
        shared, gate = None, None
        if c.shared_intermediate:
            if c.shared_gated:
                gate = raw["shared_gate"]  # [1, hidden]; older llama.cpp files hold it 1-D
                gate = RawTensor(gate.name, gate.kind, gate.data.reshape(1, -1))
                gate = make_linear(gate, "float32", None, usable)
            shared = mlp(raw["shared.gate"], raw["shared.up"], raw["shared.down"]), gate
        router_bias = raw["router.bias"].float32() if "router.bias" in raw else None
        router = make_linear(raw["router"], "float32", router_bias, usable)  # routing decides all
        bias = raw["router_bias"].float32() if "router_bias" in raw else None
        return cls(c, router, experts, shared, bias)

    @property
    def linears(self) -> tuple[Linear, ...]:
        out = [self.router, *(lin for mlp in self.experts for lin in mlp.linears)]
        if self.shared is not None:
            mlp, gate = self.shared
            out += [*mlp.linears, *([] if gate is None else [gate])]
        return tuple(out)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, hidden] (normed, float32) -> [rows, hidden] float32: transformers' steps
        (softmax in float32, top-k, renormalised where the family does; experts added in
        ascending order, so the float32 path stays token-exact)."""
        c = self.c
        if c.router == "sigmoid":
            weights, chosen = self._grouped_choice(self.router(x).float())
        elif c.router == "topk_softmax":  # gpt-oss: the softmax over the chosen logits only
            logits, chosen = torch.topk(self.router(x).float(), c.experts_used, dim=-1)
            weights = torch.softmax(logits, dim=-1)
        else:
            probs = torch.softmax(self.router(x).float(), dim=-1)
            weights, chosen = torch.topk(probs, c.experts_used, dim=-1)  # [rows, used]
            if c.topk_norm:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():
            rank, rows = torch.where(chosen.T == e)  # rows choosing e, and at which rank
            y = self.experts[e](x[rows])
            out.index_add_(0, rows, y * weights[rows, rank, None])
        if self.shared is not None:
            mlp, gate = self.shared
            out = out + (mlp(x) if gate is None else torch.sigmoid(gate(x).float()) * mlp(x))
        return out

    def _grouped_choice(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek-V3's choice, transformers' steps: sigmoid scores, the bias added for the
        choice only; the experts in `groups` groups, each scored by its best two, the best
        `groups_used` groups kept; top-k among their experts, weighted by their own scores
        (renormalised where the model does), times `routed_scale`."""
        c = self.c
        scores = logits.sigmoid()  # [rows, experts]
        choice = scores if self.choice_bias is None else scores + self.choice_bias
        rows = choice.shape[0]
        grouped = choice.view(rows, c.groups, c.experts // c.groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [rows, groups]
        kept = torch.topk(group_scores, k=c.groups_used, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores).scatter_(1, kept, 1).bool()
        choice = choice.masked_fill(~mask.repeat_interleave(c.experts // c.groups, 1), -torch.inf)
        chosen = torch.topk(choice, k=c.experts_used, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if c.topk_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * c.routed_scale, chosen
