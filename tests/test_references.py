"""The code's comments and docstrings cite only files the repository holds."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("swarm", "devtools", "scripts", "tests")
# a path with at least one folder (docs/design.md, devtools/sim.py), not a piece of a URL or
# of an absolute path
CITED = re.compile(r"(?<![\w/.~-])((?:[\w.-]+/)+[\w.-]+\.(?:py|md|txt|sh|toml|json))\b")


def test_every_path_the_code_cites_is_in_the_repository():
    missing = [
        f"{source.relative_to(ROOT)}: {cited}"
        for folder in FOLDERS
        for source in sorted((ROOT / folder).rglob("*.py"))
        for cited in CITED.findall(source.read_text())
        if not (ROOT / cited).exists()
    ]
    assert not missing
