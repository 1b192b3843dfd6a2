#!/usr/bin/env bash
# Load test of the health page on loopback.
#   1. render time: the HTML and JSON of synthetic snapshots, timed in-process
#   2. requests/s: a DHT, stand-in nodes (tests/test_health.py fake-node) and
#      `python -m swarm.health`, then wrk against / and /api/v1/state
# Needs wrk (Debian: apt-get install -y wrk). Tunables: DURATION, CONNS, THREADS, NODES.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v wrk >/dev/null || { echo "wrk is missing: apt-get install -y wrk" >&2; exit 2; }
export DURATION="${DURATION:-15s}" CONNS="${CONNS:-200}" THREADS="${THREADS:-2}" NODES="${NODES:-4}"

exec .venv/bin/python - <<'EOF'
import json, os, re, signal, subprocess, sys, time
from pathlib import Path

from swarm.health.probe import Reach
from swarm.health.render import render_page
from swarm.health.snapshot import DhtStatus, Known, Snapshot, build_model_view
from swarm.records import ModelRecord, NodeRecord

# ---- 1. render time ---------------------------------------------------------------------
def synthetic(num_layers: int, nodes: int) -> Snapshot:
    model = ModelRecord("SmolLM2-135M-Instruct", num_layers, "f" * 16)
    known, reach = [], {}
    for i in range(nodes):
        start = (i * 7) % num_layers
        end = min(num_layers, start + 10)
        r = NodeRecord(
            peer=f"12D3KooW{i:040d}", addr=f"10.0.{i // 250}.{i % 250}:31337", model=model.model,
            start=start, end=end, state="online", fingerprint=model.fingerprint, version="0.1.0",
            num_layers=num_layers, free_cache_tokens=32768, throughput=50.0 + i,
            link={"bandwidth_Bps": 12.5e6, "rtt_s": 0.02, "queue_delay_s": 0.001},
            updated=time.time() - 3,
        )
        known.append(Known(r, time.time() + 30))
        reach[r.addr] = Reach(rtt_ms=1.5) if i % 5 else Reach(error="no pong within 3 s")
    view = build_model_view(model, known, reach, time.time())
    return Snapshot(time.time(), DhtStatus("ok", time.time(), 0.05), 0, (view,), 5.0, "0.1.0", 1)

print("render time (median of 200, per snapshot):")
for layers, nodes in ((30, 8), (30, 50), (80, 500)):
    snap = synthetic(layers, nodes)
    html_t, json_t = [], []
    for _ in range(200):
        t = time.perf_counter(); page = render_page(snap, 10); html_t.append(time.perf_counter() - t)
        t = time.perf_counter(); body = json.dumps(snap.to_json()); json_t.append(time.perf_counter() - t)
    html_t.sort(); json_t.sort()
    print(f"  {layers:3d} blocks, {nodes:3d} nodes: HTML {html_t[100] * 1e3:6.2f} ms"
          f" ({len(page) / 1024:6.1f} KiB), JSON {json_t[100] * 1e3:6.2f} ms"
          f" ({len(body) / 1024:6.1f} KiB)")

# ---- 2. a live health server under wrk --------------------------------------------------
def start(cmd):
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

def wait_line(proc, pattern, timeout=120):
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if m := re.search(pattern, line):
            return m
        if time.monotonic() > deadline:
            break
    raise SystemExit(f"no {pattern!r} from {proc.args[:4]}")

procs = []
try:
    fake = [sys.executable, "tests/test_health.py", "fake-node"]
    first = start([*fake, "--span", "0:4", "--throughput", "20"])
    procs.append(first)
    peers = [wait_line(first, r"--initial-peers (\S+)").group(1)]
    n = int(os.environ["NODES"])
    for i in range(1, n):
        a = (i * 8) // n
        procs.append(start([*fake, "--span", f"{a}:{min(8, a + 4)}", "--initial-peers", *peers]))
    health = start([sys.executable, "-m", "swarm.health", "--initial-peers", *peers,
                    "--host", "127.0.0.1", "--port", "0", "--interval", "2"])
    procs.append(health)
    url = wait_line(health, r"health page on (http://\S+/)").group(1)
    import urllib.request
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "api/v1/state") as r:
            state = json.loads(r.read())
        if state["models"] and len(state["models"][0]["nodes"]) >= n:
            break
        time.sleep(1)
    with urllib.request.urlopen(url) as r:
        size = len(r.read())
    print(f"\nlive page: {len(state['models'][0]['nodes'])} nodes, {size / 1024:.1f} KiB; "
          f"wrk -t{os.environ['THREADS']} -c{os.environ['CONNS']} -d{os.environ['DURATION']}")
    for path in ("", "api/v1/state", "healthz"):
        out = subprocess.run(
            ["wrk", f"-t{os.environ['THREADS']}", f"-c{os.environ['CONNS']}",
             f"-d{os.environ['DURATION']}", "--latency", url + path],
            capture_output=True, text=True, check=True,
        ).stdout
        rps = re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)
        lat = dict(re.findall(r"\s+(50|99)%\s+(\S+)", out))
        errors = re.search(r"Socket errors:.*|Non-2xx.*", out)
        print(f"  /{path:<13} {float(rps):8.0f} requests/s   p50 {lat.get('50')}  p99 {lat.get('99')}"
              f"  {errors.group(0) if errors else 'no errors'}")
finally:
    for p in reversed(procs):
        try:
            os.kill(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for p in reversed(procs):
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # hivemind's DHT child lives in the same group
        except ProcessLookupError:
            pass
EOF
