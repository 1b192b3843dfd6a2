"""The benchmarks' kit (vLLM's benchmarks/ way: shared helpers under many short scripts).

  stats    percentile (the project's one rank rule), mean/p50/p99 summaries
  proc     a process's CPU seconds and memory, the CPU's name and instruction set
  timing   a session's token times: TTFT, TPOT, gaps
  local    a local swarm (DHT, nodes, shaped relays in front of them) as one context manager
  table    fixed-width tables

Importing it puts this checkout first on the path, the one place that does: devtools/ is not
installed, and a benchmark measures this checkout's swarm, not an installed one. It sets
OpenMP's wait policy before anything imports torch, as a node does (swarm.process.wait_passively).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from swarm.process import wait_passively  # noqa: E402

wait_passively()
