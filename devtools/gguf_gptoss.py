"""gpt-oss's part of hf_to_gguf.py, as llama.cpp's converter writes it (its conversion package's
gpt_oss.py: GptOssModel, arch `gpt-oss`), for a checkpoint whose experts are not MXFP4 (and
`mxfp4_checkpoint`, which makes one whose experts are, as the released folders keep them).

Keys beside the common ones: attention.key_length / value_length (head_dim), sliding_window,
expert_feed_forward_length (intermediate_size), YaRN's. Tensors: the sinks as
`attn_sinks.weight`, the router with its bias, each layer's stacked gate_up_proj
([experts, hidden, 2 x width], gate and up interleaved by column) split into ffn_gate_exps and
ffn_up_exps ([experts, width, hidden]: gate the even columns, up the odd, transposed) with their
biases, down_proj transposed into ffn_down_exps. llama.cpp stores no layer kinds (every second
layer full), no swiglu_limit or alpha (7.0 and 1.702 in its code) and no YaRN `truncate`: swarm
reads a gpt-oss file's YaRN unrounded, as gpt-oss's own (llama.cpp's ggml rounds every
model's). A checkpoint that differs from these would be another model, and is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np

_K = gguf.Keys
LIMIT, ALPHA = 7.0, 1.702  # llama.cpp's llm_graph_context::build_moe_ffn, SWIGLU_OAI_MOE


class GptOssUnconvertible(ValueError):
    """A gpt-oss checkpoint llama.cpp's file would describe as another model."""


def check(config: dict) -> None:
    """GptOssUnconvertible naming what llama.cpp fixes that `config` sets otherwise."""
    types = config.get("layer_types") or []
    if types != ["sliding_attention", "full_attention"] * (len(types) // 2) or len(types) % 2:
        raise GptOssUnconvertible(f"layer types {types}: llama.cpp makes every second one full")
    limit, alpha = config.get("swiglu_limit", LIMIT), config.get("swiglu_alpha", ALPHA)
    if (float(limit), float(alpha)) != (LIMIT, ALPHA):
        raise GptOssUnconvertible(f"swiglu limit {limit}, alpha {alpha}: llama.cpp fixes 7, 1.702")
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "yarn" and rope.get("truncate", True) is not False:
        raise GptOssUnconvertible(
            "YaRN's ramp rounded (truncate): a gpt-oss file is read unrounded"
        )
    if config.get("quantization_config"):
        raise GptOssUnconvertible("experts quantized in config.json's format: not read here")


def fields(config: dict) -> dict[str, int]:
    """The key llama.cpp writes beside the common ones and the family's (`{arch}` left in)."""
    return {_K.LLM.EXPERT_FEED_FORWARD_LENGTH: config["intermediate_size"]}


def tensors(hf_name: str, array: np.ndarray):
    """(GGUF name, array) for a gpt-oss checkpoint tensor: the experts split and transposed,
    the sinks named; None for a tensor named as any other family's (attention, norms)."""
    if not hf_name.startswith("model.layers."):
        return None
    block, _, local = hf_name.removeprefix("model.layers.").partition(".")
    blk = f"blk.{block}"
    if local == "self_attn.sinks":
        return [(f"{blk}.attn_sinks.weight", array)]
    if local in ("mlp.router.weight", "mlp.router.bias"):
        return [(f"{blk}.ffn_gate_inp.{local.rpartition('.')[2]}", array)]
    if local == "mlp.experts.gate_up_proj":
        rows = np.swapaxes(array, -1, -2)  # [experts, 2 x width, hidden]
        return [
            (f"{blk}.ffn_gate_exps.weight", rows[:, ::2]),
            (f"{blk}.ffn_up_exps.weight", rows[:, 1::2]),
        ]
    if local == "mlp.experts.gate_up_proj_bias":
        return [
            (f"{blk}.ffn_gate_exps.bias", array[..., ::2]),
            (f"{blk}.ffn_up_exps.bias", array[..., 1::2]),
        ]
    if local == "mlp.experts.down_proj":
        return [(f"{blk}.ffn_down_exps.weight", np.swapaxes(array, -1, -2))]
    if local == "mlp.experts.down_proj_bias":
        return [(f"{blk}.ffn_down_exps.bias", array)]
    return None


def mxfp4_checkpoint(hf_dir: Path, out: Path) -> Path:
    """A copy of the gpt-oss folder `hf_dir` with its experts in config.json's MXFP4 layout, as
    the released checkpoints keep them: `*_blocks` [experts, rows, n, 16] (two codes a byte, the
    even element's in the low nibble), `*_scales` [experts, rows, n] (E8M0 bytes), rows being
    the outputs; the codes are gguf-py's quantizer's (as `write_gguf(..., "MXFP4")`'s)."""
    import torch
    from safetensors.torch import load_file, save_file

    hf_dir, out = Path(hf_dir), Path(out)
    shutil.copytree(hf_dir, out)
    state = {}
    for name, w in load_file(hf_dir / "model.safetensors").items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            state[name] = w
            continue
        rows = w.transpose(1, 2).contiguous()  # [experts, out, in]
        q = gguf.quants.quantize(
            rows.reshape(-1, rows.shape[-1]).numpy(), gguf.GGMLQuantizationType.MXFP4
        )
        q = q.reshape(*rows.shape[:2], -1, 17)
        codes = np.concatenate([q[..., 1:] & 15, q[..., 1:] >> 4], axis=-1)  # elements 0..31
        pairs = codes[..., 0::2] | (codes[..., 1::2] << 4)
        state[f"{name}_blocks"] = torch.from_numpy(np.ascontiguousarray(pairs))
        state[f"{name}_scales"] = torch.from_numpy(np.ascontiguousarray(q[..., 0]))
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(config))
    return out
