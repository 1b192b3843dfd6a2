"""Compare hf_to_gguf's file of each tiny family with llama.cpp's own converter's.

Needs a llama.cpp checkout (convert_hf_to_gguf.py, conversion/, gguf-py/); not run by the tests,
since none is at hand there. llama.cpp's vocabulary step is stubbed out: it cannot convert the
tiny tokenizer (no sentencepiece model, and a BPE pre-tokenizer it does not know), and the
comparison leaves the tokenizer.* and general.* keys out. Prints, per family, the keys and
tensors that differ; the only expected differences are Mistral's and Mixtral's sliding windows,
which llama.cpp drops.

With --llama-cpp-python PYTHON (an interpreter that has llama-cpp-python), it also runs each
of our files in llama.cpp and prints the largest logit difference from transformers' over a
70-token prompt, within the first 8 positions and over all; llama.cpp computes Mistral, Mixtral
and Phi-3 without their windows, so those differ past them. Past F32, the mixtures of experts
differ by whole logits wherever rounding swaps an expert.

With --qtype MXFP4 (gpt_oss only), llama.cpp's converter is given what it writes MXFP4 from: a
config.json checkpoint with transformers' MXFP4 experts (`_blocks`: two codes a byte, the even
element's in the low nibble; `_scales`: E8M0 bytes), made from the same codes gguf-py's quantizer
gave ours, so identical files say both read the layout alike.

Usage: python -m devtools.compare_llama_cpp LLAMA_CPP_DIR [--qtype F32|F16|Q8_0|MXFP4]
                                            [--llama-cpp-python PYTHON] [--families F ...]
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
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "GptOssForCausalLM",
    "Gemma4ForCausalLM",
)
# the tiny gpt-oss with the clamp llama.cpp's code fixes (7), which its file cannot say
AS_LLAMA_CPP = {"gpt_oss": lambda config: dict(swiglu_limit=7.0)}


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


# Run by the interpreter that has llama-cpp-python: a float32 KV cache and no flash attention,
# so that at F32 only llama.cpp's kernels differ from transformers.
_LLAMA_CPP_LOGITS = """
import sys, numpy as np
from llama_cpp import Llama
ids = [int(i) for i in sys.argv[3].split(",")]
llm = Llama(model_path=sys.argv[1], n_ctx=256, logits_all=True, n_threads=2, verbose=False,
            type_k=0, type_v=0, flash_attn=False)
llm.eval(ids)
np.save(sys.argv[2], np.array(llm.scores[: len(ids)]))
"""


def llama_cpp_logit_gaps(
    python: str, gguf_path: Path, model, ids: list[int]
) -> tuple[float, float]:
    """The largest logit difference between llama.cpp running `gguf_path` and `model`, within
    the first 8 positions of `ids` and over all of them."""
    import torch

    out = gguf_path.with_suffix(".npy")
    cmd = [python, "-c", _LLAMA_CPP_LOGITS, str(gguf_path), str(out), ",".join(map(str, ids))]
    subprocess.run(cmd, check=True, capture_output=True)
    with torch.inference_mode():
        ours = model(torch.tensor([ids])).logits[0].numpy()
    gaps = np.abs(np.load(out) - ours).max(axis=1)
    return float(gaps[:8].max()), float(gaps.max())


def _same(x, y) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        return abs(x - y) <= 1e-6 * abs(y)
    return x == y


def main() -> None:
    if sys.argv[1:2] == ["--as-converter"]:
        return _as_converter(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("llama_cpp", type=Path)
    parser.add_argument("--qtype", default="F32", choices=["F32", "F16", "BF16", "Q8_0", "MXFP4"])
    parser.add_argument("--llama-cpp-python", help="an interpreter with llama-cpp-python")
    parser.add_argument("--families", nargs="*", help="these of swarm.model.tiny's (gpt_oss too)")
    args = parser.parse_args()

    from devtools.gguf_gptoss import mxfp4_checkpoint
    from devtools.hf_to_gguf import write_gguf
    from swarm.model.tiny import (
        FAMILIES,
        MOE_FAMILIES,
        PER_LAYER_FAMILIES,
        save_tiny,
        save_tiny_tokenizer,
        tiny_config,
    )

    for family in args.families or FAMILIES + MOE_FAMILIES + PER_LAYER_FAMILIES:
        with tempfile.TemporaryDirectory() as tmp:
            # llama.cpp looks Phi-3's special tokens up by the file's name, which is the folder's
            hf_dir = Path(tmp) / f"tiny-{family.replace('phi3', 'p3')}"
            change = AS_LLAMA_CPP.get(family, lambda _: {})(tiny_config(family))
            model = save_tiny(family, hf_dir, **change)
            save_tiny_tokenizer(hf_dir)  # Gemma 3's converter sizes the embedding by it
            mine = write_gguf(hf_dir, Path(tmp) / "mine.gguf", args.qtype)
            theirs_from, qtype = hf_dir, args.qtype
            if qtype == "MXFP4":  # their converter writes MXFP4 from MXFP4 only, the rest F32
                theirs_from, qtype = mxfp4_checkpoint(hf_dir, Path(tmp) / "mxfp4"), "F32"
            run_their_converter(args.llama_cpp, theirs_from, Path(tmp) / "theirs.gguf", qtype)
            print(family, differences(mine, Path(tmp) / "theirs.gguf"))
            if args.llama_cpp_python:
                ids = list(range(5, 5 + 70 * 7, 7))
                gaps = llama_cpp_logit_gaps(args.llama_cpp_python, mine, model, ids)
                print(f"  llama.cpp vs transformers: first 8 {gaps[0]:.1e}, all {gaps[1]:.1e}")


if __name__ == "__main__":
    main()
