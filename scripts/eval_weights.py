"""Faithfulness of each weight format on the default model (or --model): teacher-forced top-1
agreement with the float32 transformers model and perplexity on a fixed text, as a prompt pass
and as decode steps. Prints a table.

    .venv/bin/python scripts/eval_weights.py [--formats auto,int4,int8,bfloat16,float32]
"""

from __future__ import annotations

import argparse
import time
import warnings

import bench  # noqa: F401 (this checkout first on the path)
import torch

from swarm.model.blocks import Span
from swarm.model.fidelity import SAMPLE_TEXT, agreement, perplexity, reference_logits, span_logits
from swarm.model.head import Head
from swarm.model.source import open_model
from swarm.options import input_terms_arg

PROMPTS = [
    "Why is the sky blue?",
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle stays upright.",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--formats", default="auto,int4,int8,bfloat16,float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=100, help="reference answer length")
    p.add_argument(
        "--input-terms", type=input_terms_arg, default=None, help="as a node's: auto, 1 or 2"
    )
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM

    source = open_model(a.model)
    tok = source.tokenizer()
    path = source.path
    if path.is_dir():  # a Hugging Face folder
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    texts = [tok(SAMPLE_TEXT)["input_ids"]]
    for prompt in PROMPTS:  # the reference's own greedy answers, read back teacher-forced
        if tok.chat_template is None:  # a base model's file (Gemma 3 270M's GGUF): plain text
            ids = tok(prompt)["input_ids"]
        else:
            ids = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True
            )
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out = model.generate(torch.tensor([ids]), max_new_tokens=a.new_tokens, do_sample=False)
        texts.append(out[0].tolist())
    refs = [reference_logits(model, ids) for ids in texts]
    ref_ppl = perplexity(refs[0], texts[0])
    positions = sum(len(t) for t in texts)
    print(
        f"{positions} positions ({len(texts[0])} of the sample text); transformers float32"
        f" perplexity on the text {ref_ppl:.3f}"
    )
    print(
        "| weights | held as | MiB | top-1 agreement, prompt pass | decode steps |"
        " perplexity (vs float32) | load s |"
    )
    print("|---|---|---|---|---|---|---|")
    for fmt in a.formats.split(","):
        t = time.perf_counter()
        span = Span.load(source, 0, source.config.num_layers, weights=fmt, terms=a.input_terms)
        head = Head.load(
            source, "float32" if fmt == "float32" else "auto", terms=a.input_terms
        )  # as the client
        load = time.perf_counter() - t
        rows = {}
        for step in (None, 1):
            logits = [span_logits(span, head, ids, step) for ids in texts]
            hits = sum(agreement(lg, r) * len(ids) for lg, r, ids in zip(logits, refs, texts))
            rows[step] = (hits / positions, perplexity(logits[0], texts[0]))
        ppl = rows[None][1]
        print(
            f"| {fmt} | {span.format} + head {head.weights} | {span.nbytes / 2**20:.0f} |"
            f" {rows[None][0]:.4f} | {rows[1][0]:.4f} | {ppl:.3f} ({ppl / ref_ppl - 1:+.2%}) |"
            f" {load:.1f} |"
        )


if __name__ == "__main__":
    main()
