"""Gated DeltaNet, the linear attention of most of Qwen3.5's layers (transformers `qwen3_5`,
`qwen3_5_moe`; Qwen3-Next's is the same rule), in plain torch.

A layer projects each token to q, k, v (one matrix, through a short causal conv1d and SiLU), a
gate z, and per value head a write strength beta = sigmoid(b) and a decay g = -exp(A_log) *
softplus(a + dt_bias). Its memory is one [k_dim, v_dim] matrix S per value head, the same size
at every position: per token S <- S * exp(g); S <- S + k (beta (v - S^T k))^T; out = S^T q
(q, k L2-normed, q scaled by k_dim ** -0.5). The output is RMS-normed per head, times silu(z),
then out_proj. A session's state for the layer is the conv's last `kernel` inputs and S
(`State`): fixed size, so it cannot be rewound to an earlier position, only rebuilt from tokens.

The float32 path takes transformers' steps: a prompt through the chunked form (chunks of 64,
solved by a triangular solve), a decode step through the recurrent one, conv state as its
cache keeps it; so the greedy tokens are transformers' own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swarm.errors import ProtocolError
from swarm.model.config import Delta, ModelConfig
from swarm.model.linear import Linear
from swarm.model.norm import rms_norm
from swarm.model.weights import Fused, release_freed_memory

CHUNK = 64  # transformers' chunk_size for prompts
L2_EPS = 1e-6  # transformers' l2norm of q and k (the FLA library's)

NO_REWIND = "a Gated DeltaNet layer's state holds no earlier position"


class DeltaNetNoRewind(ProtocolError):
    """A rewind (a speculative round's rejected drafts) asked of a session with a Gated DeltaNet
    layer: its fixed-size state keeps no per-position snapshots, so it cannot go back."""


@dataclass
class State:
    """One session's state for one linear-attention layer."""

    conv: torch.Tensor  # [conv_dim, kernel]: the conv's last inputs (zeros before the first)
    s: torch.Tensor  # [v_heads, k_dim, v_dim] float32
    started: bool = False  # a pass has run: the next one reads conv and s

    @classmethod
    def allocate(cls, d: Delta) -> State:
        conv_dim = 2 * d.k_heads * d.k_dim + d.v_heads * d.v_dim
        return cls(torch.zeros(conv_dim, d.kernel), torch.zeros(d.v_heads, d.k_dim, d.v_dim))

    @staticmethod
    def nbytes(d: Delta) -> int:
        conv_dim = 2 * d.k_heads * d.k_dim + d.v_heads * d.v_dim
        return 4 * (conv_dim * d.kernel + d.v_heads * d.k_dim * d.v_dim)


class GatedDeltaNet:
    """One layer's linear attention: x [rows, hidden] (normed) -> [rows, v_heads * v_dim],
    before out_proj (the block's `o`)."""

    def __init__(self, config: ModelConfig, proj: Fused, conv, decay, dt_bias, gated_rms):
        self.d: Delta = config.delta
        self.eps = config.rms_eps
        self.proj = proj  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a: one pass over x
        self.conv = conv  # [conv_dim, kernel]
        self.decay = decay  # -exp(A_log) a value head: g = decay * softplus(a + dt_bias)
        self.dt_bias, self.gated_rms = dt_bias, gated_rms

    @classmethod
    def load(cls, config: ModelConfig, raw, weights: str, usable, terms) -> GatedDeltaNet:
        d = config.delta
        key, value = d.k_heads * d.k_dim, d.v_heads * d.v_dim
        parts = [raw[n] for n in ("in_qkv", "in_z", "in_b", "in_a")]
        proj = Fused.load(parts, weights, [None] * 4, usable, terms)
        release_freed_memory()
        conv = raw["conv"].float32().reshape(2 * key + value, d.kernel)
        vec = {n: raw[n].float32().reshape(-1) for n in ("A_log", "dt_bias", "gated_rms")}
        decay = vec["A_log"] if d.llama_cpp else -vec["A_log"].exp()
        return cls(config, proj, conv, decay, vec["dt_bias"], vec["gated_rms"])

    @property
    def linears(self) -> tuple[Linear, ...]:
        return tuple(self.proj.linears)

    def _project(self, x: torch.Tensor):
        d = self.d
        key, value = d.k_heads * d.k_dim, d.v_heads * d.v_dim
        out = self.proj(x).float()
        mixed, z = out[:, : 2 * key + value], out[:, 2 * key + value : 2 * key + 2 * value]
        b, a = out[:, 2 * key + 2 * value :].chunk(2, dim=-1)
        g = self.decay * F.softplus(a + self.dt_bias)  # [rows, v_heads]
        return mixed, z, b.sigmoid(), g

    def _conv(self, mixed: torch.Tensor, state: State) -> torch.Tensor:
        """mixed [n, conv_dim] through the causal depthwise conv and SiLU, the layer's conv
        state read and moved on, as transformers' cache does it."""
        n, k = mixed.shape[0], self.d.kernel
        x = mixed.T[None]  # [1, conv_dim, n]
        weight = self.conv[:, None]  # [conv_dim, 1, kernel]
        if state.started and n == 1:  # transformers' causal_conv1d_update
            full = torch.cat((state.conv[None], x), dim=-1)
            out = F.conv1d(full, weight, groups=full.shape[1])[..., -1:]
        else:  # causal_conv1d_fn over the cached inputs and these
            full = torch.cat((state.conv[None], x), dim=-1) if state.started else x
            if full.shape[-1] < k:
                full = F.pad(full, (k - full.shape[-1], 0))
            out = F.conv1d(full, weight, padding=k - 1, groups=full.shape[1])
            out = out[..., : full.shape[-1]][..., -n:]
        state.conv.copy_(full[0, :, -k:])
        return F.silu(out)[0].T  # [n, conv_dim]

    def _heads(self, mixed: torch.Tensor):
        """q, k [n, v_heads, k_dim] (each q/k head repeated for its value heads), v."""
        d = self.d
        n, key = mixed.shape[0], d.k_heads * d.k_dim
        q = mixed[:, :key].reshape(n, d.k_heads, d.k_dim)
        k = mixed[:, key : 2 * key].reshape(n, d.k_heads, d.k_dim)
        v = mixed[:, 2 * key :].reshape(n, d.v_heads, d.v_dim)
        if d.v_heads != d.k_heads and d.llama_cpp:  # value heads tiled: v0 of every k, v1 ...
            q, k = (t.repeat(1, d.v_heads // d.k_heads, 1) for t in (q, k))
        elif d.v_heads != d.k_heads:  # grouped: every v of k0, then of k1 ...
            q = q.repeat_interleave(d.v_heads // d.k_heads, dim=1)
            k = k.repeat_interleave(d.v_heads // d.k_heads, dim=1)
        return _l2norm(q), _l2norm(k), v

    def _out(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """core [n, v_heads, v_dim] RMS-normed per head, times silu(z) -> [n, v_heads * v_dim]."""
        d = self.d
        rows = core.reshape(-1, d.v_dim)
        out = rms_norm(rows, self.gated_rms, self.eps) * F.silu(z.reshape(-1, d.v_dim))
        return out.reshape(core.shape[0], d.v_heads * d.v_dim)

    def forward(self, x: torch.Tensor, state: State, *_) -> torch.Tensor:
        """One session's tokens x [n, hidden] (normed), after every earlier one of the session
        went through `state` (positions need no rotation here)."""
        mixed, z, beta, g = self._project(x)
        q, k, v = self._heads(self._conv(mixed, state))
        if state.started and x.shape[0] == 1:
            core = _recurrent(q, k, v, g, beta, state.s)
        else:
            core = _chunked(q, k, v, g, beta, state.s if state.started else None, state.s)
        state.started = True
        return self._out(core, z)

    def decode(self, x: torch.Tensor, caches: list[tuple[State, None]], *_) -> torch.Tensor:
        """One token of each of several sessions, x [rows, hidden] (normed): projected together,
        each row then through its own session's state (caches[i][0]), in row order."""
        mixed, z, beta, g = self._project(x)
        out = []
        for i, (state, _) in enumerate(caches):
            q, k, v = self._heads(self._conv(mixed[i : i + 1], state))
            if state.started:
                core = _recurrent(q, k, v, g[i : i + 1], beta[i : i + 1], state.s)
            else:
                core = _chunked(q, k, v, g[i : i + 1], beta[i : i + 1], None, state.s)
            state.started = True
            out.append(core)
        return self._out(torch.cat(out), z)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def _recurrent(q, k, v, g, beta, s: torch.Tensor) -> torch.Tensor:
    """The delta rule a token at a time (transformers' torch_recurrent_gated_delta_rule): q, k
    [n, heads, k_dim], v [n, heads, v_dim], g, beta [n, heads]; s [heads, k_dim, v_dim] updated
    in place -> [n, heads, v_dim]."""
    q = q / q.shape[-1] ** 0.5
    state = s.clone()
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        remembered = (state * k[t][..., None]).sum(dim=-2)  # [heads, v_dim]
        delta = (v[t] - remembered) * beta[t][:, None]
        state = state + k[t][..., None] * delta[:, None]
        out[t] = (state * q[t][..., None]).sum(dim=-2)
    s.copy_(state)
    return out


def _chunked(q, k, v, g, beta, initial: torch.Tensor | None, s: torch.Tensor) -> torch.Tensor:
    """The same rule in chunks of CHUNK tokens (transformers' torch_chunk_gated_delta_rule, its
    steps in order): within a chunk the updates condensed by a unit-triangular solve, the state
    carried from chunk to chunk; `initial` the state before (None: zeros); the final one goes
    into s."""
    n = q.shape[0]
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, n, dim]
    beta, g = beta.T[None], g.T[None]  # [1, heads, n]
    q = q * q.shape[-1] ** -0.5
    pad = (CHUNK - n % CHUNK) % CHUNK
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = F.pad(beta, (0, pad)), F.pad(g, (0, pad))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (
        t.reshape(1, t.shape[1], -1, CHUNK, t.shape[-1]) for t in (q, k, k_beta, v_beta)
    )
    g = g.reshape(1, g.shape[1], -1, CHUNK).cumsum(dim=3)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool).triu(1)
    pairwise = (g[..., :, None] - g[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    decayed = k_beta * g.exp()[..., None]
    k_decay = torch.linalg.solve_triangular(system, decayed, upper=False, unitriangular=True)
    state = torch.zeros_like(s)[None] if initial is None else initial[None].clone()
    out = torch.zeros_like(new_v)
    q = q * g.exp()[..., None]
    k = k * (g[..., -1:] - g).exp()[..., None]
    chunk_decay = g[..., -1].exp()[..., None, None]
    for i in range(g.shape[2]):
        v_new = new_v[:, :, i] - k_decay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    s.copy_(state[0])
    return out.reshape(1, out.shape[1], -1, out.shape[-1])[0, :, :n].transpose(0, 1)
