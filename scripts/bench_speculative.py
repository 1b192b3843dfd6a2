"""Speculative decoding through 3 nodes behind shaped links (issue 48): plain and speculative
tok/s, acceptance, tokens per round and rounds in flight, in one table.

For each round trip per hop (--rtts, ms; every node behind a relay of --rate-mbps, both ways,
devtools/link_proxy.py), three nodes split the model (--threads 1 each) and the client decodes
greedily up to --new-tokens tokens:
  workloads  rewrite: rewrite and summarise prompts (the reply repeats the prompt: lookup pays),
               the reply up to its end of text (the default model's are 33 and 45 tokens)
             chat: free chat (lookup finds little: speculation should switch itself off), its
               end of text ignored, so that every row decodes as many
  drafts     off: plain decoding, a token a step (the ratios' baseline, same prompt, same swarm)
             lookup: prompt lookup (swarm.client.decoding.PromptLookup)
             layers-N: a draft model made of the model's first N (--draft-layers) blocks with its
               norm, head and tokenizer (self-speculative "layer skip" drafting), written in a
               temp dir; untrained early exit from a 30-block 135M model agrees little
             self: the served model's own file as the draft model, whole, on the client: a
               draft of near-perfect acceptance whose cost a token is the model's compute, small
               beside a round trip of the route (as a 1B draft's beside a 70B model's route)
             oracle-A: the target's own greedy continuation (the plain row's tokens), each token
               replaced with probability 1 - A, fixed per position: the gain as a function of
               acceptance (its measured acceptance is below A: a round stops at its first miss)
  models     the default model (spans 0:10/10:20/20:30) and, with --synthetic-layers L > 0, an
             8B-shaped random-weight model (scripts/synthetic_gguf.py, Q4_K; L blocks a node, few
             so that three nodes fit 2 cores), oracle drafts on the chat prompts only
Columns: tok/s of decoding (after the first token); x plain; accept (drafts accepted/proposed);
tok/rnd (tokens a verification round yields); in-flt (rounds outstanding as each is sent, mean);
k (drafts a round, mean); rounds and steps (plain steps where no round paid); lat/tok ms (the
tuner's last estimate of a round's fixed and per-token time); same (tokens equal plain's; NO@i:
the first reply token that differs, in each repeat that differs).
Rows alternate within each repeat; repeat i takes the workloads' prompt i.

    .venv/bin/python scripts/bench_speculative.py [--rtts 0,20,40,80] [--new-tokens 64]
        [--repeats 2] [--draft-layers 8] [--synthetic-layers 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

import gguf
import numpy as np
from bench.local import LocalSwarm, Shape
from bench.proc import cpu_name
from bench.table import print_table
from bench.timing import TokenTimes

from swarm.client.client import Client
from swarm.client.decoding import Decoding, Drafter, SpeculationStats
from swarm.client.options import Sampling
from swarm.client.reply import Sampler
from swarm.client.tuner import Tuner
from swarm.model.source import default_model_path

REWRITE = [
    "Rewrite this paragraph in plain words, keeping every fact: The committee convened on"
    " Tuesday to review the annual budget. After a lengthy discussion, the members agreed to"
    " increase funding for the public library by ten percent, to postpone the renovation of the"
    " town hall until next spring, and to hire two additional park rangers for the summer.",
    "Summarise this text in three sentences: The river flooded the lower town after three days"
    " of heavy rain. The bakery, the post office and the old school were under water by"
    " Thursday morning. Volunteers filled sandbags through the night, and the mayor opened the"
    " sports hall as a shelter for families who had to leave their homes.",
]
CHAT = [
    "What should I pack for a week of hiking in the mountains?",
    "Tell me a short story about a cat who wants to learn to fly.",
]
WORKLOADS = {"rewrite": REWRITE, "chat": CHAT}
GOALS = {  # (model, rtt, workload, draft) -> the least ratio to plain; None: any
    ("default", 40, "chat", "oracle-0.7"): 3.0,
    ("default", 40, "rewrite", "lookup"): 2.0,
    ("default", 0, "chat", "oracle-0.7"): 1.5,
    ("8b", 40, "chat", "oracle-0.7"): 3.0,
    ("8b", 0, "chat", "oracle-0.7"): 1.5,
    # poor acceptance: the switch-off keeps plain decoding's speed
    (None, None, "chat", "lookup"): 0.95,
    (None, None, None, "layers-"): 0.95,  # any layer-skip draft ("-": a prefix)
}


class Oracle:
    """Drafts the target's own continuation `reference` (prompt and reply), each reply token
    replaced by another with probability 1 - `acceptance`, drawn once per position."""

    def __init__(self, reference: Sequence[int], prompt: int, acceptance: float, vocab: int):
        rng = np.random.default_rng(int(acceptance * 1000))
        self.tokens = np.asarray(reference, dtype=np.int64)
        miss = rng.random(len(self.tokens)) >= acceptance
        miss[:prompt] = False
        other = (self.tokens + 1 + rng.integers(0, vocab - 1, len(self.tokens))) % vocab
        self.tokens = np.where(miss, other, self.tokens)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        return self.tokens[len(tokens) : len(tokens) + k].tolist()


class Counting:
    """A drafter that notes, for each round it drafts (sent right after), how many rounds are
    in flight with it and how many drafts it carries."""

    def __init__(self, drafter: Drafter, label: str):
        self.drafter = drafter
        self.label = label  # the client's Tuner for it on this route is the last reply's
        self.decoding: Decoding | None = None
        self.in_flight: list[int] = []
        self.drafts: list[int] = []

    def kind(self, tokens: Sequence[int]) -> int:
        kind_of = getattr(self.drafter, "kind", None)
        return kind_of(tokens) if kind_of is not None else 0

    def warm(self, tokens: Sequence[int]) -> None:
        if (warm := getattr(self.drafter, "warm", None)) is not None:
            warm(tokens)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        out = self.drafter.propose(tokens, k)
        if out:
            self.in_flight.append(len(self.decoding.rounds) + 1)
            self.drafts.append(len(out))
        return out


@dataclass
class Run:
    times: TokenTimes
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    in_flight: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    tuner: Tuner | None = None
    differs: int | None = None  # the first reply token unlike the plain run's; None: none


def decode(
    client: Client,
    ids: list[int],
    new: int,
    drafter: Drafter | None,
    ends: Sequence[int] = (),
    label: str = "",
) -> Run:
    """`new` greedy tokens after `ids`, timed, drafted by `drafter` (None: plain decoding);
    fewer if one of `ends` comes first (it is the last). The round sizes start from the last
    reply's with the same `label`, as a client's do."""
    counting = Counting(drafter, label) if drafter is not None else None
    with client.session(len(ids) + new, "off") as session:
        sampler = Sampler(Sampling())
        decoding = Decoding(session, list(ids), new, sampler, counting, pool=client.tuners)
        if counting is not None:
            counting.decoding = decoding
        t = TokenTimes(time.perf_counter())
        for token in decoding:
            t.tokens.append(token)
            t.times.append(time.perf_counter())
            if token in ends:
                break
        t.decode_start = t.times[0]
    run = Run(t, decoding.stats, tuner=decoding.tuner)
    if counting is not None:
        run.in_flight, run.drafts = counting.in_flight, counting.drafts
    return run


def write_layer_skip_draft(source: Path, out: Path, layers: int) -> Path:
    """`source`'s first `layers` blocks, its final norm, head and tokenizer, as a GGUF file."""
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(out), arch)
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = layers if key == f"{arch}.block_count" else f.contents()
        if key == "general.name":
            value = f"{value} first {layers} blocks"
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, f.types[0], sub)
    kept = [
        t
        for t in reader.tensors
        if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers
    ]
    for t in kept:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in kept:
        w.write_tensor_data(t.data)
    w.close()
    return out


def spans(layers: int, nodes: int = 3) -> list[tuple[int, int]]:
    cuts = [round(layers * i / nodes) for i in range(nodes + 1)]
    return list(zip(cuts, cuts[1:]))


@dataclass
class Model:
    name: str  # "default" or "8b"
    path: Path
    layers: int
    drafts: dict[str, str]  # label -> Client.drafter's argument ("lookup", a draft model's path)


def drafters(client: Client, model: Model, workload: str, plain: Run, prompt: list[int], a):
    """(label, drafter) of each speculative row of `workload` after its `plain` run."""
    out = [(label, client.drafter(how)) for label, how in model.drafts.items()]
    if workload == "chat" and "oracle" in a.drafts:
        reference = prompt + plain.times.tokens
        vocab = client.config.vocab
        out += [(f"oracle-{x:g}", Oracle(reference, len(prompt), x, vocab)) for x in a.oracle]
    return out


def measure(swarm: LocalSwarm, model: Model, rtt: float, a, runs: dict) -> None:
    """Every row of `model` at `rtt`, --repeats times, into runs[(model, rtt, workload, draft)]."""
    shape = Shape(a.rate_mbps, rtt)
    for span in spans(model.layers):
        swarm.node(span, ["--threads", "1"], shape=shape, model=str(model.path))
    client = Client(swarm.peers, model=str(model.path), last_hop_picks=not a.client_picks)
    try:
        workloads = WORKLOADS if model.drafts else {"chat": CHAT}
        decode(client, [1, 2, 3], 4, None)  # routes found and connections warm before timing
        for rep in range(a.repeats):
            for workload, prompts in workloads.items():
                prompt = prompt_ids(client, prompts[rep % len(prompts)])
                # a rewrite is as long as its reply; chat goes on past its end of text
                ends = client.config.eos_token_ids if workload == "rewrite" else ()
                plain = decode(client, prompt, a.new_tokens, None, ends)
                runs[(model.name, rtt, workload, "off")].append(plain)
                for label, drafter in drafters(client, model, workload, plain, prompt, a):
                    run = decode(client, prompt, a.new_tokens, drafter, ends, label)
                    run.differs = first_difference(run.times.tokens, plain.times.tokens)
                    runs[(model.name, rtt, workload, label)].append(run)
                print(f"  {model.name} {rtt:g} ms {workload} repeat {rep + 1} done", flush=True)
    finally:
        client.close()
        swarm.stop_nodes()


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def prompt_ids(client: Client, text: str) -> list[int]:
    if client.config.vocab < 10000:  # the synthetic model: no real tokenizer
        return [(7 * i + len(text)) % 4000 + 50 for i in range(len(text) // 4)]
    return client.encode([{"role": "user", "content": text}])


def rate(runs: list[Run]) -> float:
    return sum(r.times.steps for r in runs) / sum(r.times.decode_s for r in runs)


def goal_for(key: tuple) -> float | None:
    def fits(want, have) -> bool:
        if isinstance(want, str) and want.endswith("-"):
            return have.startswith(want)
        return want is None or want == have

    return next((least for k, least in GOALS.items() if all(map(fits, k, key))), None)


def row(key: tuple, runs: list[Run], plain: float) -> list[object]:
    model, rtt, workload, draft = key
    tok_s = rate(runs)
    ratio = tok_s / plain
    s = [r.stats for r in runs]
    proposed, accepted = sum(x.proposed for x in s), sum(x.accepted for x in s)
    rounds, steps = sum(x.rounds for x in s), sum(x.steps for x in s)
    flights = [n for r in runs for n in r.in_flight]
    ks = [n for r in runs for n in r.drafts]
    tuner = runs[-1].tuner
    least = goal_for(key)
    goal = "" if least is None else f">={least:g}x {'met' if ratio >= least else 'MISSED'}"
    spec = draft != "off"
    return [
        f"{model} {rtt:g}ms {workload} {draft}",
        f"{tok_s:.1f}",
        f"{ratio:.2f}x",
        f"{accepted / proposed:.2f}" if proposed else "-",
        f"{(accepted + rounds) / rounds:.2f}" if rounds else "-",
        f"{statistics.fmean(flights):.2f}" if flights else "-",
        f"{statistics.fmean(ks):.1f}" if ks else "-",
        rounds if spec else "-",
        steps if spec else sum(r.times.steps for r in runs),
        f"{tuner.latency * 1e3:.0f}/{tuner.per_token * 1e3:.1f}" if spec else "-",
        same(runs) if spec else "",
        goal,
    ]


def same(runs: list[Run]) -> str:
    """ "yes", or "NO@i,..": the first reply token unlike plain decoding's, of each that differs."""
    at = [str(r.differs) for r in runs if r.differs is not None]
    return "NO@" + ",".join(at) if at else "yes"


def report(runs: dict, a) -> None:
    header = ["model rtt workload draft", "tok/s", "x plain", "accept", "tok/rnd", "in-flt"]
    header += ["k", "rounds", "steps", "lat/tok ms", "same", "goal"]
    rows = []
    for key, group in runs.items():
        plain = rate(runs[(*key[:3], "off")])
        rows.append(row(key, group, plain))
    print(f"\n{date.today()}, {cpu_name()}, {a.rate_mbps:g} Mbit/s a hop, {a.new_tokens} tokens")
    print_table(header, rows)


def default_model(tmp: Path, a) -> Model:
    base = default_model_path()
    drafts = {"lookup": "lookup"} if "lookup" in a.drafts else {}
    if "layers" in a.drafts:
        path = write_layer_skip_draft(base, tmp / "draft.gguf", a.draft_layers)
        drafts[f"layers-{a.draft_layers}"] = str(path)
    if "self" in a.drafts:
        drafts["self"] = str(base)
    return Model("default", base, 30, drafts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rtts", default="0,20,40,80", help="round trips per hop, ms, comma-separated")
    p.add_argument("--rate-mbps", type=float, default=20.0)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--client-picks", action="store_true", help="the client picks from logits, not the last hop"
    )
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--draft-layers", type=int, default=8, help="blocks of the layer-skip draft")
    p.add_argument("--drafts", default="lookup,layers,self,oracle", help="which draft rows")
    p.add_argument("--oracle", default="0.5,0.7,0.9", help="oracle acceptances, comma-separated")
    p.add_argument(
        "--synthetic-layers", type=int, default=1, help="8B-shaped blocks a node; 0: none"
    )
    p.add_argument("--files", type=Path, help="keep the 8B-shaped file here (default: a temp dir)")
    p.add_argument("--models", default="default,8b", help="which models' rows (8b: if layers > 0)")
    a = p.parse_args()
    a.oracle = [float(x) for x in a.oracle.split(",")]
    a.drafts = a.drafts.split(",")
    rtts = [float(x) for x in a.rtts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        models = [default_model(Path(tmp), a)] if "default" in a.models else []
        if a.synthetic_layers and "8b" in a.models:
            from synthetic_gguf import l8b_file

            n = 3 * a.synthetic_layers
            models.append(Model("8b", l8b_file(a.files or Path(tmp), n), n, {}))
        runs: dict[tuple, list[Run]] = defaultdict(list)
        with LocalSwarm() as swarm:
            for model in models:
                for rtt in rtts:
                    measure(swarm, model, rtt, a, runs)
        report(runs, a)


if __name__ == "__main__":
    main()
