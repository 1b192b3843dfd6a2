"""The scripts the tests import: scripts/ is no package, so each is loaded from its path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(path: str) -> ModuleType:
    """scripts/`path`.py as a module named after its file, loaded once."""
    name = path.rpartition("/")[2]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{path}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


synthetic_gguf = load_script("synthetic_gguf")
family_plans = load_script("bench/family_plans")
