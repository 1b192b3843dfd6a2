"""Link scheduler benchmark: molink vs fifo on shaped links, real nodes, real model compute.

Three nodes split the default model (0:10, 10:20, 20:30), or --model's layers, or an 8B-shaped
Q4_K file of --synthetic-layers (4096 wide: 8 KiB a token on the wire, MoLink's case; the trace
is token ids, no tokenizer needed). Nodes 2 and 3 sit behind shaped relays
(`python -m devtools.link_proxy`, announced with --public-address), so both node-to-node hops
cross a link of --rates Mbps with --rtt-ms round trip and a bounded bottleneck buffer; the client
reaches node 1 directly. Per round the nodes start fresh with one variant's options and carry:

- --steady decoding sessions, each a short prompt then tokens until the round ends, and
- requests arriving as a Poisson process (--rate-per-s), lengths drawn like a chat trace
  (log-normal around the Azure conversation trace's medians, ~1020 in / ~130 out, clipped to
  2048 / 1024, then scaled by --input-scale / --output-scale for CPU time).

Variants (by default the two link policies) alternate round by round (molink, fifo, fifo,
molink, ...) and replay the same arrival times and lengths, so they see the same load. Prints, per
link rate and variant: TTFT, TPOT and end-to-end latency of the trace requests (mean, p50, p99);
the steady sessions' decode step latency while some prefill is in flight (between a request's
start and its first token) and while none is; the nodes' own figures from their DHT records, each
hop's bottleneck wait (the relay's 10 ms samples and its decode frames) and each node's decode
step time (its step log), with and without prefill in flight; each request's prompt on its way
(when it reached each node and was done there, from the step logs); the CPU each process used;
then the first variant's figures over each other's.

    .venv/bin/python scripts/bench_link.py                      # 5 and 20 Mbps, 2 rounds each
    .venv/bin/python scripts/bench_link.py --rates 5 --rounds 1 --duration 60
    .venv/bin/python scripts/bench_link.py --variants molink fifo "one-lane=--compute-lanes 1"
    .venv/bin/python scripts/bench_link.py --synthetic-layers 3 --rates 10 20 --input-scale 1
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shlex
import shutil
import statistics
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import bench  # noqa: F401  (first: OpenMP's wait policy, a node's, before torch loads)
import torch

warnings.filterwarnings("ignore")

from bench.local import LocalSwarm, Shape  # noqa: E402
from bench.proc import cpu_seconds  # noqa: E402
from bench.stats import percentile as pct  # noqa: E402
from bench.stats import summary  # noqa: E402
from bench.timing import TokenTimes, greedy  # noqa: E402

from devtools.launch import NodeProcess  # noqa: E402
from swarm.client.client import Client  # noqa: E402
from swarm.model.source import default_model_path, open_model  # noqa: E402

SPANS = [(0, 10), (10, 20), (20, 30)]  # the default model's; --model's split like it into 3
# Azure LLM inference trace 2023, conversation: medians ~1020 input and ~130 output tokens
TRACE_IN_MEDIAN, TRACE_IN_SIGMA, TRACE_IN_MAX = 1020, 0.6, 2048
TRACE_OUT_MEDIAN, TRACE_OUT_SIGMA, TRACE_OUT_MAX = 130, 0.8, 1024
STEADY_PROMPT = 32
# a frame of one token's activations (hidden x float16) with its header: a decode step, as
# prefill chunks are at least 2 tokens on links of 1 Mbps and more (hidden: 576, the default
# model's; set from --model)
DECODE_FRAME_BYTES = (1152, 2 * 1152)


@dataclass
class Request:
    at: float  # seconds after the round starts
    prompt: list[int]
    new_tokens: int


@dataclass
class Done:
    timed: TokenTimes
    error: str | None = None
    failed_at: float = math.nan
    sid: str = ""  # its session's id as the nodes' step logs give it

    @property
    def start(self) -> float:
        return self.timed.start

    @property
    def first(self) -> float | None:
        return self.timed.times[0] if self.timed.times else None

    @property
    def end(self) -> float:
        return self.timed.times[-1] if self.timed.times and not self.error else self.failed_at

    @property
    def ttft(self) -> float:
        return self.timed.ttft

    @property
    def tpot(self) -> float | None:
        return self.timed.tpot


@dataclass(frozen=True)
class Variant:
    """A named set of node options: "molink", "fifo", or "NAME=NODE OPTIONS" (policy molink
    unless the options name one)."""

    name: str
    args: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Variant:
        name, eq, rest = text.partition("=")
        if not eq:
            if name not in ("molink", "fifo"):
                raise argparse.ArgumentTypeError(f"variant {text!r}: molink, fifo or NAME=OPTIONS")
            return cls(name, ("--link-policy", name))
        args = tuple(shlex.split(rest))
        return cls(name, args if "--link-policy" in args else ("--link-policy", "molink", *args))


@dataclass
class Round:
    rate: float
    variant: str
    requests: list[Done] = field(default_factory=list)
    steps: list[tuple[float, float]] = field(default_factory=list)  # steady (prev, now)
    steady_errors: list[str] = field(default_factory=list)
    links: list[dict] = field(default_factory=list)  # per node, from its DHT record
    queues: list[list[tuple[float, float]]] = field(default_factory=list)  # per hop: (t, wait s)
    frames: list[list[tuple[float, int, float]]] = field(default_factory=list)  # (t, size, wait)
    node_steps: list[list[tuple[float, ...]]] = field(default_factory=list)  # per node
    prompts: list[dict[str, PromptAtNode]] = field(default_factory=list)  # per node, by sid
    # per node: tokens, seconds of compute, of which on a CPU, of which waiting for one
    passes: list[list[tuple[int, float, float, float]]] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds per process, measured part


@dataclass
class PromptAtNode:
    """When a session's prompt pieces came into a node, and when its last pass there was done."""

    first_in: float
    last_in: float
    done: float = math.nan


def draw_trace(rng: random.Random, a) -> list[Request]:
    out, t = [], 0.0
    while True:
        t += rng.expovariate(a.rate_per_s)
        if t > a.duration:
            return out
        n_in = min(TRACE_IN_MAX, rng.lognormvariate(math.log(TRACE_IN_MEDIAN), TRACE_IN_SIGMA))
        n_out = min(TRACE_OUT_MAX, rng.lognormvariate(math.log(TRACE_OUT_MEDIAN), TRACE_OUT_SIGMA))
        n_in = max(16, round(n_in * a.input_scale))
        n_out = max(4, round(n_out * a.output_scale))
        out.append(Request(t, [rng.randrange(100, a.vocab) for _ in range(n_in)], n_out))


# a node that writes its step log through the node's observer hook
STEP_LOG_NODE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "devtools", "step_log.py"
)


def start_nodes(swarm: LocalSwarm, variant: Variant, rate: float, a, logs, step_logs) -> None:
    """The nodes, each writing its decode steps to `step_logs`, and a relay in front of each but
    the first, logging its queue to `logs`."""
    common = ["--threads", "1", "--announce-ttl", "6", "--grace", "2"]
    common += ["--prefill-pass-tokens", str(a.prefill_pass_tokens)]
    common += ["--link-inflight-gain", str(a.inflight_gain), *shlex.split(a.node_args)]
    common += variant.args  # last, so a variant's options win
    for i, span in enumerate(SPANS):
        extra = [*common, "--step-log", step_logs[i]]
        # the hop into every node but the first crosses a shaped link
        shape = Shape(rate, a.rtt_ms, a.buffer_kb, logs[i - 1], nice=False) if i > 0 else None
        swarm.node(span, extra, shape, wait=False, program=(STEP_LOG_NODE,), model=a.model)
    for n in swarm.nodes:
        n.wait_serving()


def wait_route(client: Client, peers: set[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if {h.peer for h in client.route()} <= peers:
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise TimeoutError("the new nodes never formed a route")


def generate(client: Client, prompt: list[int], new_tokens: int, done: Done, stop=None) -> None:
    """Greedy decoding, timing each token; `stop` (an Event) ends an open-ended session."""
    try:
        with client.session(len(prompt) + new_tokens + 1) as s:

            def first(token: int) -> int:
                done.sid = s.remote.sid[:8] if s.remote is not None else ""
                return token

            until = stop.is_set if stop is not None else None
            greedy(s.feed, prompt, new_tokens - 1, time.monotonic, first, until, done.timed)
    except Exception as exc:  # recorded: a benchmark reports failures, it does not hide them
        done.error = f"{type(exc).__name__}: {exc}"
        done.failed_at = time.monotonic()


def steady(
    client: Client, stop: threading.Event, rnd: Round, lock: threading.Lock, seed: int, vocab: int
):
    rng = random.Random(seed)
    while not stop.is_set():
        d = Done(TokenTimes(time.monotonic()))
        prompt = [rng.randrange(100, vocab) for _ in range(STEADY_PROMPT)]
        generate(client, prompt, 1000, d, stop)
        with lock:
            if d.error:
                rnd.steady_errors.append(d.error)
            times = d.timed.times
            rnd.steps.extend(zip(times[:-1], times[1:]))
        if d.error:
            time.sleep(1)


def read_queue_log(path: str) -> tuple[list[tuple[float, float]], list[tuple[float, int, float]]]:
    """From a relay's log: (monotonic time, seconds a byte then waits in the hop's bottleneck)
    every 10 ms, and (time, size, wait) of each frame the previous node sent through it."""
    samples, frames = [], []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3:  # a relay killed mid-line leaves a short one
                samples.append((float(parts[0]), float(parts[1])))
            elif len(parts) == 4 and parts[0] == "f":
                frames.append((float(parts[1]), int(parts[2]), float(parts[3])))
    return samples, frames


def read_step_log(path: str):
    """From a node's step log: (arrival, seconds in the node, seconds of compute, of which on a
    CPU, of which waiting for one) of each decode step it ran; per session, its prompt's arrival
    and last pass there; (tokens, seconds of compute, on a CPU, waiting for one) of each prompt
    pass."""
    steps, prompts, passes = [], {}, []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if len(parts) == 5 and parts[0] not in ("a", "p"):
                steps.append(tuple(float(x) for x in parts))
            elif len(parts) == 6 and parts[0] == "a":
                t = float(parts[2])
                at = prompts.setdefault(parts[1], PromptAtNode(t, t))
                at.last_in = t
            elif len(parts) == 9 and parts[0] == "p":
                passes.append((int(parts[4]), *(float(x) for x in parts[6:9])))
                if parts[1] in prompts and int(parts[3]) + int(parts[4]) == int(parts[5]):
                    prompts[parts[1]].done = float(parts[2])  # the prompt's last pass
    return steps, prompts, passes


def cpu_now(nodes: list[NodeProcess], relays: list) -> dict[str, float]:
    out = {f"node {i}": cpu_seconds(n.proc.pid) for i, n in enumerate(nodes)}
    out.update({f"relay {i}": cpu_seconds(r.pid) for i, r in enumerate(relays)})
    out["client"] = time.process_time()
    return out


def run_round(client: Client, swarm: LocalSwarm, trace, variant: Variant, rate: float, a):
    logdir = tempfile.mkdtemp(prefix="bench_link_")
    logs = [os.path.join(logdir, f"hop{i}.log") for i in range(len(SPANS) - 1)]
    step_logs = [os.path.join(logdir, f"node{i}.log") for i in range(len(SPANS))]
    rnd = Round(rate, variant.name)
    try:
        start_nodes(swarm, variant, rate, a, logs, step_logs)
        nodes, relays = swarm.nodes, swarm.relays
        wait_route(client, {n.peer for n in nodes})
        lock, stop = threading.Lock(), threading.Event()
        workers = [
            threading.Thread(target=steady, args=(client, stop, rnd, lock, i, a.vocab), daemon=True)
            for i in range(a.steady)
        ]
        for w in workers:
            w.start()
        time.sleep(a.warmup)
        cpu0 = cpu_now(nodes, relays)
        t0 = time.monotonic()
        for req in trace:
            time.sleep(max(0.0, t0 + req.at - time.monotonic()))
            d = Done(TokenTimes(time.monotonic()))
            rnd.requests.append(d)
            w = threading.Thread(
                target=generate, args=(client, req.prompt, req.new_tokens, d), daemon=True
            )
            w.start()
            workers.append(w)
        time.sleep(max(0.0, t0 + a.duration - time.monotonic()))
        cpu1 = cpu_now(nodes, relays)
        rnd.cpu = {k: (cpu1[k] - cpu0[k]) / (time.monotonic() - t0) for k in cpu1}
        deadline = time.monotonic() + a.drain
        for w in workers[a.steady :]:
            w.join(max(0.1, deadline - time.monotonic()))
        stop.set()
        for w in workers[: a.steady]:
            w.join(30)
        time.sleep(2.5)  # one more announcement carries the final link figures
        records = {r.peer: r for r in client.nodes()}
        rnd.links = [records[n.peer].link if n.peer in records else {} for n in nodes]
    finally:
        swarm.stop_nodes()
    for path in logs:
        samples, frames = read_queue_log(path) if os.path.exists(path) else ([], [])
        rnd.queues.append(samples)
        rnd.frames.append(frames)
    for path in step_logs:
        steps, prompts, passes = read_step_log(path) if os.path.exists(path) else ([], {}, [])
        rnd.node_steps.append(steps)
        rnd.prompts.append(prompts)
        rnd.passes.append(passes)
    shutil.rmtree(logdir, ignore_errors=True)
    return rnd


# ---- report ------------------------------------------------------------------------------------


def prefill_windows(rnd: Round) -> list[tuple[float, float]]:
    """From each trace request's start to its first token."""
    return [(d.start, d.first if d.first else d.end) for d in rnd.requests]


def covered(windows: list[tuple[float, float]]) -> float:
    """Seconds that at least one of `windows` covers."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(windows):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def step_split(rounds: list[Round]) -> tuple[list[float], list[float]]:
    """Steady decode step latencies while some trace request was in prefill, and while none was."""
    busy, quiet = [], []
    for rnd in rounds:
        windows = prefill_windows(rnd)
        for prev, now in rnd.steps:
            overlaps = any(s < now and prev < e for s, e in windows)
            (busy if overlaps else quiet).append(now - prev)
    return busy, quiet


def split_by_prefill(rnd: Round, timed: list[tuple[float, float]]):
    """Values (time, value) while the steady sessions ran: those when some prefill was in
    flight, and the others."""
    busy, quiet = [], []
    windows = prefill_windows(rnd)
    first, last = rnd.steps[0][0] if rnd.steps else 0.0, rnd.steps[-1][1] if rnd.steps else 0.0
    for t, value in timed:
        if first <= t <= last:
            (busy if any(s <= t < e for s, e in windows) else quiet).append(value)
    return busy, quiet


def split_rounds(rounds: list[Round], timed_of) -> tuple[list[float], list[float]]:
    """split_by_prefill over rounds; `timed_of(rnd)` gives a round's (time, value) pairs."""
    busy, quiet = [], []
    for rnd in rounds:
        b, q = split_by_prefill(rnd, timed_of(rnd))
        busy += b
        quiet += q
    return busy, quiet


def node_step_split(rounds: list[Round], node: int, column: int):
    """A node's decode steps, prefill in flight and not: column 1 time in the node, 2 compute,
    3 of that on a CPU, 4 waiting for one."""

    def timed(rnd: Round):
        steps = rnd.node_steps[node] if node < len(rnd.node_steps) else []
        return [(r[0], r[column]) for r in steps]

    return split_rounds(rounds, timed)


def queue_split(rounds: list[Round], hop: int, decode_frames: bool = False):
    """A hop's bottleneck wait while some prefill was in flight and while none was: sampled
    every 10 ms, or as each decode frame (one token's activations) met it."""
    low, high = DECODE_FRAME_BYTES

    def timed(rnd: Round):
        series = rnd.frames if decode_frames else rnd.queues
        rows = series[hop] if hop < len(series) else []
        return [(t, r[-1]) for t, *r in rows if not decode_frames or low <= r[0] < high]

    return split_rounds(rounds, timed)


def prompt_timeline(rounds: list[Round]) -> str:
    """Where a trace request's time to first token goes: mean seconds after its start at which
    its prompt reached each node (first and last piece) and was done there, then the token."""
    marks: list[list[float]] = []
    for rnd in rounds:
        for d in rnd.requests:
            at = [p.get(d.sid) for p in rnd.prompts]
            if d.error or not d.first or not d.sid or None in at:
                continue
            row = []
            for p in at:
                row += [p.first_in - d.start, p.last_in - d.start, p.done - d.start]
            marks.append([*row, d.ttft])
    if not marks:
        return "    prompt timeline: no request had a full step log"
    mean = [statistics.fmean(col) for col in zip(*marks)]
    parts = [
        f"node {i}: in {mean[3 * i]:5.2f}-{mean[3 * i + 1]:5.2f}, done {mean[3 * i + 2]:5.2f}"
        for i in range(len(SPANS))
    ]
    return (
        f"    prompt timeline, mean s after the request ({len(marks)} requests): "
        + "; ".join(parts)
        + f"; first token {mean[-1]:5.2f}"
    )


def prompt_passes(rounds: list[Round]) -> str:
    """Per node, the prompt passes of a round: how many, their mean size, compute per token (of
    which on a CPU and waiting for one)."""
    passes = []
    for i in range(len(SPANS)):
        rows = [p for r in rounds if i < len(r.passes) for p in r.passes[i]]
        if rows:
            tokens, secs, cpu, runq = (sum(col) for col in zip(*rows))
            passes.append(
                f"node {i} {len(rows) / len(rounds):.0f} of {tokens / len(rows):.1f} tokens,"
                f" {secs / tokens * 1e3:.1f} ms/token ({cpu / tokens * 1e3:.1f} on a CPU,"
                f" {runq / tokens * 1e3:.1f} waiting)"
            )
    in_flight = statistics.fmean(covered(prefill_windows(r)) for r in rounds)
    return (
        f"    prompt passes per round ({in_flight:.1f} s with a prefill in flight): "
        + "; ".join(passes)
    )


def figures(rounds: list[Round]) -> dict[str, tuple[float, float, float]]:
    ok = [d for r in rounds for d in r.requests if d.error is None and d.first]
    busy, quiet = step_split(rounds)
    return {
        "TTFT s": summary([d.ttft for d in ok]),
        "TPOT s": summary([d.tpot for d in ok if d.tpot is not None]),
        "latency s": summary([d.end - d.start for d in ok]),
        "step, prefill in flight s": summary(busy),
        "step, none in flight s": summary(quiet),
    }


def node_figures(rounds: list[Round]) -> list[str]:
    lines = []
    for i, span in enumerate(SPANS):
        busy, quiet = node_step_split(rounds, i, 1)
        busy_c, quiet_c = node_step_split(rounds, i, 2)
        if busy and quiet:
            lines.append(
                f"    node {span[0]}:{span[1]} decode step in the node (compute), prefill in"
                f" flight: mean {statistics.fmean(busy) * 1e3:5.1f}"
                f" ({statistics.fmean(busy_c) * 1e3:5.1f})"
                f" ms, p99 {pct(busy, 0.99) * 1e3:5.1f} ms; no prefill: mean"
                f" {statistics.fmean(quiet) * 1e3:5.1f} ({statistics.fmean(quiet_c) * 1e3:5.1f})"
                f" ms, p99 {pct(quiet, 0.99) * 1e3:5.1f} ms"
            )
            on_cpu = node_step_split(rounds, i, 3)
            split = [
                f"{label} {statistics.fmean(busy_x) * 1e3:5.1f}"
                f" / {statistics.fmean(quiet_x) * 1e3:5.1f} ms"
                for label, (busy_x, quiet_x) in (
                    ("on a CPU", on_cpu),
                    ("waiting for one", node_step_split(rounds, i, 4)),
                )
            ]
            busy_cpu = on_cpu[0]
            lines.append(
                "      its compute, prefill in flight / none: " + ", ".join(split) + ", the rest"
                f" blocked (the GIL); with prefill in flight {len(busy) / len(rounds):.0f} steps"
                f" a round, {sum(busy_cpu) / len(rounds):.1f} s on a CPU"
            )
        links = [r.links[i] for r in rounds if i < len(r.links) and r.links[i]]
        if i == len(SPANS) - 1 or not links:
            continue  # the last node's uplink is the client's result path

        def mean(key, links=links):
            return statistics.fmean(lk.get(key, 0.0) for lk in links)

        lines.append(
            f"    node {span[0]}:{span[1]} uplink: bandwidth est"
            f" {mean('bandwidth_Bps') * 8 / 1e6:5.2f} Mbps, rtt est {mean('rtt_s') * 1e3:5.1f} ms"
            f" (min {mean('min_rtt_s') * 1e3:5.1f}),"
            f" decode queueing p50 {mean('decode_delay_p50_s') * 1e3:6.1f} ms"
            f" p99 {mean('decode_delay_p99_s') * 1e3:7.1f} ms, chunks {mean('chunks_sent'):5.0f}"
            f" of {mean('chunk_tokens_mean'):5.1f} tokens, W resets {mean('w_resets'):3.0f},"
            f" held for acks {mean('prefill_held'):5.0f} (acks late p50"
            f" {mean('ack_lag_p50_s') * 1e3:5.1f} ms p99 {mean('ack_lag_p99_s') * 1e3:5.1f} ms),"
            f" paced {mean('prefill_paced'):5.0f}"
            f" (corrected by late acks {mean('pace_corrections'):4.0f}, came back late p50"
            f" {mean('pace_late_p50_s') * 1e3:4.1f} ms), link idle while a prefill waited"
            f" {mean('prefill_idle_s'):5.2f} s"
        )
        for what, decode_frames in (("10 ms samples", False), ("decode frames", True)):
            busy, quiet = queue_split(rounds, i, decode_frames)
            if busy and quiet:
                lines.append(
                    f"      bottleneck wait ({what}), prefill in flight: mean"
                    f" {statistics.fmean(busy) * 1e3:6.1f} ms, p99 {pct(busy, 0.99) * 1e3:6.1f}"
                    f" ms, none {sum(w == 0 for w in busy) / len(busy):4.0%}; no prefill: mean"
                    f" {statistics.fmean(quiet) * 1e3:6.1f} ms, p99"
                    f" {pct(quiet, 0.99) * 1e3:6.1f} ms"
                )
    return lines


def report(results: dict[tuple[float, str], list[Round]], variants: list[Variant], a) -> None:
    print(
        f"\n{len(SPANS)} nodes, shaped hops at --rtt-ms {a.rtt_ms}, buffer {a.buffer_kb} KiB;"
        f" {a.steady} steady sessions + trace requests at {a.rate_per_s}/s for {a.duration:.0f} s;"
        f" {a.rounds} round(s) per variant; client prefill steps of {a.prefill_chunk} tokens,"
        f" node passes of {a.prefill_pass_tokens}, in-flight gain {a.inflight_gain},"
        f" node options {a.node_args!r}"
    )
    for v in variants:
        print(f"  variant {v.name}: {' '.join(v.args)}")
    names = [v.name for v in variants]
    for rate in a.rates:
        print(f"\n== {rate:g} Mbps ==")
        figs = {}
        for name in names:
            rounds = results[(rate, name)]
            figs[name] = figures(rounds)
            n_ok = sum(1 for r in rounds for d in r.requests if d.error is None and d.first)
            n_all = sum(len(r.requests) for r in rounds)
            errors = [d.error for r in rounds for d in r.requests if d.error]
            errors += [e for r in rounds for e in r.steady_errors]
            print(
                f"  {name}: {n_ok}/{n_all} trace requests completed,"
                f" {sum(len(r.steps) for r in rounds)} steady decode steps, {len(errors)} errors"
                + (f" (first: {errors[0]})" if errors else "")
            )
            for line in node_figures(rounds):
                print(line)
            print(prompt_timeline(rounds))
            print(prompt_passes(rounds))
            cpu = {k: statistics.fmean(r.cpu.get(k, 0.0) for r in rounds) for k in rounds[0].cpu}
            print(
                "    CPU while requests arrived, cores: "
                + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
                + f"; all {sum(cpu.values()):.2f} of {os.cpu_count()}"
            )
        print(f"  {'':28}" + "".join(f"{n + ' mean/p50/p99':>26}" for n in names))
        for key in figs[names[0]]:
            print(
                f"  {key:28}"
                + "".join(f"{'/'.join(f'{x:.3f}' for x in figs[n][key]):>26}" for n in names)
            )
        first = names[0]
        for other in names[1:]:
            print(f"  {first}/{other} mean/p50/p99:")
            for key in figs[first]:
                m, f = figs[first][key], figs[other][key]
                ratio = "/".join(f"{x / y:.2f}" if y else "nan" for x, y in zip(m, f))
                print(f"    {key:28}{ratio:>22}")
        for name in names:
            busy, quiet = (
                figs[name]["step, prefill in flight s"],
                figs[name]["step, none in flight s"],
            )
            print(
                f"  {name}: decode step with prefill in flight / without:"
                f" mean {busy[0] / quiet[0]:.2f}x, p50 {busy[1] / quiet[1]:.2f}x,"
                f" p99 {busy[2] / quiet[2]:.2f}x"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rates", type=float, nargs="+", default=[5.0, 20.0], help="link Mbps")
    p.add_argument("--rtt-ms", type=float, default=30.0)
    p.add_argument("--buffer-kb", type=int, default=64, help="bottleneck buffer per direction")
    p.add_argument("--rounds", type=int, default=2, help="rounds per variant and rate")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per round")
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--drain", type=float, default=90.0, help="seconds to let requests finish")
    p.add_argument("--steady", type=int, default=2, help="steady decoding sessions")
    p.add_argument("--rate-per-s", type=float, default=0.1, help="trace request arrivals")
    p.add_argument("--input-scale", type=float, default=0.25)
    p.add_argument("--output-scale", type=float, default=0.25)
    p.add_argument(
        "--prefill-chunk", type=int, default=2048, help="tokens per prefill step the client sends"
    )
    p.add_argument(
        "--prefill-pass-tokens", type=int, default=64, help="the nodes' most tokens per pass"
    )
    p.add_argument(
        "--inflight-gain", type=float, default=2.0, help="the nodes' --link-inflight-gain"
    )
    p.add_argument(
        "--node-args", default="", help="more options for every node, e.g. '--compute-lanes 1'"
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=["molink", "fifo"],
        metavar="VARIANT",
        help='"molink", "fifo" or "NAME=NODE OPTIONS"; ratios are the first over each other',
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--model", help="a GGUF file to serve (default: the default model)")
    p.add_argument(
        "--synthetic-layers",
        type=int,
        default=0,
        help="serve an 8B-shaped Q4_K file of this many layers (written to --files), not --model",
    )
    p.add_argument("--files", type=Path, default=Path(tempfile.gettempdir()) / "swarm-l8b")
    a = p.parse_args()
    choose_model(a)
    variants = [Variant.parse(v) for v in a.variants]
    if len({v.name for v in variants}) != len(variants) or len(variants) < 2:
        p.error("--variants wants at least two distinct names")
    torch.set_num_threads(1)
    trace = draw_trace(random.Random(a.seed), a)
    print(
        f"trace: {len(trace)} requests, input tokens median"
        f" {statistics.median(len(r.prompt) for r in trace):.0f} max"
        f" {max(len(r.prompt) for r in trace)}, output median"
        f" {statistics.median(r.new_tokens for r in trace):.0f} max"
        f" {max(r.new_tokens for r in trace)}",
        flush=True,
    )
    with LocalSwarm() as swarm:
        # plaintext=True lets a variant run its nodes --plaintext; TLS nodes are dialled by key
        client = Client(swarm.peers, prefill_chunk=a.prefill_chunk, plaintext=True, model=a.model)
        try:
            report(run_rounds(client, swarm, trace, variants, a), variants, a)
        finally:
            client.close()


def choose_model(a) -> None:
    """The served file (a.model), its vocabulary (a.vocab: the trace's token ids stay below
    it) and the spans and decode frame size of it."""
    global SPANS, DECODE_FRAME_BYTES
    if a.synthetic_layers:
        from synthetic_gguf import l8b_file

        a.model = str(l8b_file(a.files, a.synthetic_layers))
    a.model = a.model or str(default_model_path())
    config = open_model(a.model).config
    a.vocab = min(40000, config.vocab)  # 40000: the default model's trace as it always was
    cuts = [round(config.num_layers * i / 3) for i in range(4)]
    SPANS = list(zip(cuts, cuts[1:]))
    DECODE_FRAME_BYTES = (2 * config.hidden, 4 * config.hidden)
    print(f"model: {a.model}, {config.num_layers} layers, hidden {config.hidden}", flush=True)


def run_rounds(client: Client, swarm: LocalSwarm, trace, variants: list[Variant], a):
    """Every rate's rounds, the variants alternating round by round."""
    results: dict[tuple[float, str], list[Round]] = {}
    for rate in a.rates:
        for i in range(a.rounds):
            order = variants if i % 2 == 0 else variants[::-1]
            for variant in order:
                started = time.monotonic()
                rnd = run_round(client, swarm, trace, variant, rate, a)
                results.setdefault((rate, variant.name), []).append(rnd)
                ok = [d for d in rnd.requests if d.error is None and d.first]
                print(
                    f"round {rate:g} Mbps {variant.name}:"
                    f" {len(ok)}/{len(rnd.requests)} requests,"
                    f" TTFT mean {statistics.fmean(d.ttft for d in ok) if ok else 0:.2f} s,"
                    f" {len(rnd.steps)} steady steps, {time.monotonic() - started:.0f} s",
                    flush=True,
                )
    return results


if __name__ == "__main__":
    main()
