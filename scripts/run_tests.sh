#!/usr/bin/env bash
# The test command: README and CI both run this.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest "$@"
