"""What swarm's modules import, read from their source: the layering and circle tests' data."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "swarm"


def imported(
    source: str, module: str, is_package: bool, known: frozenset[str] = frozenset()
) -> set[str]:
    """Every swarm module `module`'s source names in an import, at any depth of the code.

    `from swarm.x import y` names swarm.x, or swarm.x.y where that is one of the `known` modules
    (`from swarm.model import kernels` runs swarm/model/kernels/__init__.py)."""
    out = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            # `from swarm import node` names a module; `from swarm.x import y` names x
            if base == "swarm":
                out |= {f"{base}.{a.name}" for a in node.names}
            else:
                subs = {f"{base}.{a.name}" for a in node.names} & known
                out |= subs if len(subs) == len(node.names) else {base, *subs}
    return {m for m in out if m == "swarm" or m.startswith("swarm.")}


def modules() -> list[tuple[str, Path]]:
    """(dotted name, path) of every module of swarm, a package named by its __init__.py."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return out
