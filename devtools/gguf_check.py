"""Checks of hf_to_gguf's files that do not go through our own GGUF reader.

transformers loads GGUF files of these families on its own (its loader undoes llama.cpp's q/k
interleave and Gemma's +1, and splits stacked experts), so a file it reads back into the
checkpoint's exact weights and logits was written right. Its loader reads only some of the
metadata, though: for the rest, NOT_READ_BY_TRANSFORMERS names the config fields the comparison
takes from the Hugging Face config instead; tests read those keys from the file itself.
It has no Mixtral (a "llama" file with experts): load_gguf_model reads one with its own
Llama and Qwen-MoE steps, see _load_mixtral.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    GGUFTensor,
    LlamaTensorProcessor,
    Qwen2MoeTensorProcessor,
    load_gguf_checkpoint,
)

# transformers 5's GGUF loader: the config fields it does not read from the file (and then
# takes from its config class's defaults, which are a big checkpoint's values)
NOT_READ_BY_TRANSFORMERS = {
    "llama": ("rope_parameters",),  # it skips rope_freqs.weight: no Llama 3 scaling
    "mistral": ("sliding_window",),  # and it loads the file as a Llama, see load_gguf_model
    "qwen2": (),
    "qwen3": ("head_dim",),  # it defaults to 128, and then fails on the tensors' shapes
    "gemma2": ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"),
    "gemma3": ("query_pre_attn_scalar",),
    "phi3": ("sliding_window",),
    # mixtral: none; its model is built from the folder's config, see _load_mixtral
    "qwen3_moe": ("moe_intermediate_size",),
    "qwen2_moe": ("moe_intermediate_size", "shared_expert_intermediate_size"),
}
# read from the file (or, for Qwen's renormalisation, fixed per architecture as in llama.cpp)
READ_FOR_EXPERTS = ("num_experts", "num_experts_per_tok", "norm_topk_prob")

# the fields transformers does read, compared between its config from the file and the folder's
READ_BY_TRANSFORMERS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
)


def gguf_config(path: str | os.PathLike):
    """transformers' config for the GGUF file, read from its metadata alone."""
    from transformers import AutoConfig

    path = Path(path)
    return AutoConfig.from_pretrained(path.parent, gguf_file=path.name)


def config_mismatches(hf_config, path: str | os.PathLike) -> dict[str, tuple]:
    """{field: (folder's value, file's value)} for the fields transformers reads from the file
    that differ from the folder's config (the norm epsilon up to float32 rounding)."""
    from_file = gguf_config(path)
    names = READ_BY_TRANSFORMERS + (("head_dim",) if _reads_head_dim(hf_config) else ())
    names += ("sliding_window", "layer_types") if hf_config.model_type.startswith("gemma") else ()
    names += READ_FOR_EXPERTS if hf_config.model_type in ("qwen3_moe", "qwen2_moe") else ()
    out = {n: (getattr(hf_config, n), getattr(from_file, n, None)) for n in names}
    out["rms_norm_eps"] = (hf_config.rms_norm_eps, from_file.rms_norm_eps)
    out["rope_theta"] = (_theta(hf_config), _theta(from_file))
    close = lambda a, b: a == b or math.isclose(a, b, rel_tol=1e-6)  # noqa: E731
    return {n: pair for n, pair in out.items() if not close(*pair)}


def _reads_head_dim(config) -> bool:
    return config.model_type in ("llama", "gemma2", "gemma3_text", "qwen3_moe")


def _theta(config) -> float:
    rope = config.rope_parameters
    return rope.get("full_attention", rope)["rope_theta"]


def load_gguf_model(hf_model, path: str | os.PathLike):
    """The GGUF file loaded by transformers, with the fields of NOT_READ_BY_TRANSFORMERS taken
    from `hf_model`'s config (and all the others from the file). Float32, eval mode."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    family = _family(hf_model.config)
    if family == "mixtral":
        return _load_mixtral(hf_model, path)
    config = gguf_config(path)
    for name in NOT_READ_BY_TRANSFORMERS[family]:
        setattr(config, name, getattr(hf_model.config, name))
    with _shared_gate_as_written():
        loaded = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, config=config, dtype=torch.float32
        )
    if family == "mistral":
        # transformers' Mistral path looks up a "mistral" arch gguf-py does not have: it loads
        # the file as the Llama llama.cpp wrote, and a Mistral takes the same state dict
        mistral = type(hf_model)(hf_model.config).float()
        mistral.load_state_dict(loaded.state_dict())
        loaded = mistral
    return loaded.eval()


class _SharedGateAsWritten(Qwen2MoeTensorProcessor):
    """transformers expects Qwen2-MoE's shared-expert gate 1-D, as llama.cpp's converter once
    squeezed it; today's writes it as the checkpoint's [1, hidden]. Either is one row."""

    def process(self, weights, name, **kwargs):
        if "ffn_gate_inp_shexp" in name and weights.ndim == 2:
            return GGUFTensor(weights, name, {})
        return super().process(weights, name, **kwargs)


@contextlib.contextmanager
def _shared_gate_as_written():
    saved = TENSOR_PROCESSORS["qwen2moe"]
    TENSOR_PROCESSORS["qwen2moe"] = _SharedGateAsWritten
    try:
        yield
    finally:
        TENSOR_PROCESSORS["qwen2moe"] = saved


class _MixtralSteps(Qwen2MoeTensorProcessor):
    """transformers' own inverses of what llama.cpp did to a Mixtral: its Llama's q/k
    interleave, and its Qwen-MoE's stacked experts (the same 3-D layout)."""

    def process(self, weights, name, **kwargs):
        if ".attn_q." in name or ".attn_k." in name:
            return LlamaTensorProcessor(self.config).process(weights, name)
        return super().process(weights, name, **kwargs)


def _load_mixtral(hf_model, path: Path):
    """The file's tensors read by transformers' GGUF loader with the steps above, into a
    Mixtral of `hf_model`'s config (its state dict must take every one, and only those)."""
    model = type(hf_model)(copy.deepcopy(hf_model.config)).float()
    model.config.model_type = "llama"  # gguf-py's tensor names for the arch in the file
    saved = TENSOR_PROCESSORS["llama"]
    TENSOR_PROCESSORS["llama"] = _MixtralSteps
    try:
        parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    finally:
        TENSOR_PROCESSORS["llama"] = saved
        model.config.model_type = "mixtral"
    model.load_state_dict(parsed["tensors"], strict=True)
    return model.eval()


def _family(config) -> str:
    return {"gemma3_text": "gemma3"}.get(config.model_type, config.model_type)


def weight_gaps(hf_model, loaded) -> dict[str, float]:
    """Largest absolute difference per tensor between the two models' state dicts."""
    theirs = loaded.state_dict()
    return {k: float((v - theirs[k]).abs().max()) for k, v in hf_model.state_dict().items()}


def logit_gap(hf_model, loaded, ids: list[int]) -> float:
    """Largest absolute difference of the two models' logits over every position of `ids`."""
    with torch.inference_mode():
        batch = torch.tensor([ids])
        return float((hf_model(batch).logits - loaded(batch).logits).abs().max())


def dequantized(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of the file as float32, in Hugging Face's [rows, columns] order."""
    reader = gguf.GGUFReader(str(path))
    return {t.name: gguf.dequantize(t.data, t.tensor_type) for t in reader.tensors}
