"""The link alone: bench_link.py's trace through one hop of the simulator (devtools/sim.py).

The same LinkScheduler as a node's, with its default options and acknowledgements, in virtual
time: no compute to share cores with, so what is left between molink and fifo is the link's
doing. Each trace prompt reaches the hop in passes of --pass-tokens, one every --pass-s (node
0's compute), and --steady decode sessions step through it (--decode-ms here, --ring-ms for the
rest of the ring). Prints, per rate and pass time: the mean time a prompt takes to cross (from
its arrival to its last byte at the next node), molink over fifo, the decode send delay p99, and
how the link was used while some prompt waited or crossed: prompt, decode frames, idle.

    .venv/bin/python scripts/sim_link.py                       # 8 KiB a token, 10 and 20 Mbit/s
    .venv/bin/python scripts/sim_link.py --rates 5 --hidden 576 --pass-s 0.05
"""

from __future__ import annotations

import argparse
import random
import statistics
from types import SimpleNamespace

from bench.stats import percentile
from bench_link import draw_trace

from devtools.sim import DecodeStream, PrefillArrival, SimLink, SimResult, simulate
from swarm.link.options import LinkOptions
from swarm.link.scheduler import LinkScheduler
from swarm.protocol import PREFILL


def prompts(trace, bytes_per_token: int, pass_tokens: int, pass_s: float):
    out = []
    for i, req in enumerate(trace):
        n = len(req.prompt)
        for k in range(0, n, pass_tokens):
            at = req.at + (k // pass_tokens + 1) * pass_s
            tokens = min(pass_tokens, n - k)
            out.append(PrefillArrival(f"p{i}", at, tokens, bytes_per_token, phase_left=n - k))
    return out


def crossing(result: SimResult, trace) -> list[float]:
    done: dict[str, float] = {}
    for v in result.of_phase(PREFILL):
        if v.finished is not None:
            done[v.session] = max(done.get(v.session, 0.0), v.finished)
    latency = result.link.latency
    return [done[f"p{i}"] + latency - r.at for i, r in enumerate(trace) if f"p{i}" in done]


def link_use(result: SimResult, step: float = 0.001) -> tuple[float, float, float, float]:
    """Shares of link time spent on prompt bytes, on decode frames and idle, while some prompt
    had arrived and not finished crossing; and those seconds."""
    spans: dict[str, tuple[float, float]] = {}
    for v in result.of_phase(PREFILL):
        first, last = spans.get(v.session, (v.enqueued, 0.0))
        spans[v.session] = (min(first, v.enqueued), max(last, v.finished or 0.0))
    sends = sorted(result.sends, key=lambda s: s[0])
    counts = {"prompt": 0, "decode": 0, "idle": 0}
    i, t, end = 0, 0.0, max(last for _, last in spans.values())
    while t < end:
        while i + 1 < len(sends) and sends[i + 1][0] <= t:
            i += 1
        if any(first <= t < last for first, last in spans.values()):
            start, stop, send = sends[i] if sends else (0.0, 0.0, None)
            if send is not None and start <= t < stop:
                counts["prompt" if send.phase == PREFILL else "decode"] += 1
            else:
                counts["idle"] += 1
        t += step
    total = sum(counts.values()) or 1
    return (*(counts[k] / total for k in ("prompt", "decode", "idle")), total * step)


def run(policy: str, link: SimLink, a, trace, pass_s: float) -> SimResult:
    bpt = 2 * a.hidden  # float16 on the wire
    decodes = [
        DecodeStream(f"d{j}", 0.05 * j, 100_000, a.decode_ms / 1e3, a.ring_ms / 1e3, bpt)
        for j in range(a.steady)
    ]
    arrivals = prompts(trace, bpt, a.pass_tokens, pass_s)
    until = max(p.at for p in arrivals) + a.drain
    return simulate(LinkScheduler(LinkOptions(policy=policy)), link, decodes, arrivals, until)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rates", type=float, nargs="+", default=[10.0, 20.0], help="link Mbps")
    p.add_argument("--rtt-ms", type=float, default=30.0)
    p.add_argument("--hidden", type=int, default=4096, help="activation width (8B: 4096)")
    p.add_argument("--pass-s", type=float, nargs="+", default=[0.1, 0.5])
    p.add_argument("--pass-tokens", type=int, default=64)
    p.add_argument("--steady", type=int, default=2)
    p.add_argument("--decode-ms", type=float, default=10.0)
    p.add_argument("--ring-ms", type=float, default=90.0)
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--drain", type=float, default=60.0)
    p.add_argument("--rate-per-s", type=float, default=0.1)
    p.add_argument("--input-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1)
    # the trace's prompt ids are drawn below the vocabulary, so its lengths follow it too
    p.add_argument("--vocab", type=int, default=4096, help="bench_link's: 4096 for its 8B file")
    a = p.parse_args()
    shape = SimpleNamespace(
        rate_per_s=a.rate_per_s,
        duration=a.duration,
        input_scale=a.input_scale,
        output_scale=1.0,
        vocab=a.vocab,
    )
    trace = draw_trace(random.Random(a.seed), shape)
    tokens = [len(r.prompt) for r in trace]
    print(f"trace: {len(trace)} prompts, {sum(tokens)} tokens, {2 * a.hidden} bytes a token")
    for rate in a.rates:
        link = SimLink(rate * 1e6 / 8, a.rtt_ms / 2e3, acks=True)
        for pass_s in a.pass_s:
            out = {}
            for policy in ("molink", "fifo"):
                result = run(policy, link, a, trace, pass_s)
                delays = result.decode_delays()
                p99 = percentile(delays, 0.99) if delays else 0.0
                out[policy] = (statistics.fmean(crossing(result, trace)), p99, link_use(result))
            (m, m99, mu), (f, f99, fu) = out["molink"], out["fifo"]
            print(
                f"{rate:g} Mbit/s, a pass every {pass_s:g} s: prompt crossing mean molink {m:.2f}"
                f" s, fifo {f:.2f} s ({m / f:.2f}x); decode send delay p99 {m99 * 1e3:.0f} /"
                f" {f99 * 1e3:.0f} ms; link while a prompt is on its way (prompt / decode / idle):"
                f" molink {mu[0]:.1%} / {mu[1]:.1%} / {mu[2]:.1%}, fifo {fu[0]:.1%} / {fu[1]:.1%}"
                f" / {fu[2]:.1%}",
                flush=True,
            )


if __name__ == "__main__":
    main()
