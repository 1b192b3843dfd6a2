"""Compare hf_to_gguf's file of each tiny family with llama.cpp's own converter's.

Needs a llama.cpp checkout (convert_hf_to_gguf.py, conversion/, gguf-py/); not run by the tests,
since none is at hand there. llama.cpp's vocabulary step is stubbed out: it cannot convert the
tiny tokenizer (no sentencepiece model, and a BPE pre-tokenizer it does not know), and the
comparison leaves the tokenizer.* and general.* keys out. Prints, per family, the keys and
tensors that differ; the only expected difference is Mistral's sliding window, which llama.cpp
drops.

Usage: python -m devtools.compare_llama_cpp LLAMA_CPP_DIR [--qtype F32|F16|Q8_0]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
)


def run_their_converter(llama_cpp: Path, hf_dir: Path, out: Path, qtype: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py on `hf_dir`, in a process of its own: it imports its
    own gguf-py, which must not replace the installed one here."""
    args = [str(llama_cpp), str(hf_dir), "--outfile", str(out), "--outtype", qtype.lower()]
    cmd = [sys.executable, "-m", "devtools.compare_llama_cpp", "--as-converter", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"llama.cpp's converter failed:\n{done.stderr[-2000:]}")


def _as_converter(llama_cpp: str, argv: list[str]) -> None:
    sys.path[:0] = [llama_cpp, f"{llama_cpp}/gguf-py"]
    import convert_hf_to_gguf
    from conversion import get_model_class

    def placeholder_vocab(self):
        n = self.hparams["vocab_size"]
        self.gguf_writer.add_tokenizer_model("llama")
        self.gguf_writer.add_token_list([f"[PAD{i}]" for i in range(n)])
        self.gguf_writer.add_token_scores([0.0] * n)
        self.gguf_writer.add_token_types([1] * n)

    for arch in ARCHITECTURES:
        for cls in get_model_class(arch, mmproj=False).__mro__:
            if "set_vocab" in cls.__dict__:
                cls.set_vocab = placeholder_vocab
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    convert_hf_to_gguf.main()


def differences(mine: Path, theirs: Path) -> dict[str, object]:
    """The model keys with different values (mine, theirs), the tensors only one file has, the
    tensors whose type differs, and the largest difference of any tensor's values."""
    import gguf

    a, b = gguf.GGUFReader(str(mine)), gguf.GGUFReader(str(theirs))
    skip = ("general.", "tokenizer.", "GGUF.")
    fa, fb = (
        {k: f.contents() for k, f in r.fields.items() if not k.startswith(skip)} for r in (a, b)
    )
    keys = {
        k: (fa.get(k), fb.get(k)) for k in fa.keys() | fb.keys() if not _same(fa.get(k), fb.get(k))
    }
    ta, tb = ({t.name: t for t in r.tensors} for r in (a, b))
    kinds = {n: (ta[n].tensor_type.name, tb[n].tensor_type.name) for n in ta.keys() & tb.keys()}
    largest = 0.0
    for n in ta.keys() & tb.keys():
        x = gguf.dequantize(ta[n].data, ta[n].tensor_type)
        y = gguf.dequantize(tb[n].data, tb[n].tensor_type)
        largest = max(largest, float(np.abs(x - y).max()) if x.shape == y.shape else np.inf)
    return {
        "keys": keys,
        "tensors only in one": sorted(ta.keys() ^ tb.keys()),
        "types": {n: k for n, k in kinds.items() if k[0] != k[1]},
        "largest value difference": largest,
    }


def _same(x, y) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        return abs(x - y) <= 1e-6 * abs(y)
    return x == y


def main() -> None:
    if sys.argv[1:2] == ["--as-converter"]:
        return _as_converter(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("llama_cpp", type=Path)
    parser.add_argument("--qtype", default="F32", choices=["F32", "F16", "BF16", "Q8_0"])
    args = parser.parse_args()

    from devtools.hf_to_gguf import write_gguf
    from swarm.model.tiny import FAMILIES, save_tiny, save_tiny_tokenizer

    for family in FAMILIES:
        with tempfile.TemporaryDirectory() as tmp:
            hf_dir = Path(tmp) / f"tiny-{family}"
            save_tiny(family, hf_dir)
            save_tiny_tokenizer(hf_dir)  # Gemma 3's converter sizes the embedding by it
            mine = write_gguf(hf_dir, Path(tmp) / "mine.gguf", args.qtype)
            run_their_converter(args.llama_cpp, hf_dir, Path(tmp) / "theirs.gguf", args.qtype)
            print(family, differences(mine, Path(tmp) / "theirs.gguf"))


if __name__ == "__main__":
    main()
