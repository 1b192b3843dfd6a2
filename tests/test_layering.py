"""The package's layers, as docs/design.md writes them down: no module imports a layer above it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tests.helpers.imports import PACKAGE, ROOT, imported, modules

TOP_MODULES = "swarm (its modules)"  # how the table names the modules directly in swarm/


@dataclass(frozen=True)
class Layer:
    name: str
    packages: tuple[str, ...]
    may_import: frozenset[str]


def read_layers(design: str) -> list[Layer]:
    """The ```layers table of docs/design.md: layer, packages, the layers it may import."""
    block = re.search(r"```layers\n(.*?)```", design, re.S)
    assert block, "docs/design.md has no ```layers table"
    layers = []
    for line in block.group(1).splitlines()[1:]:
        name, packages, may = re.split(r"\s{2,}", line.strip())
        allowed = frozenset() if may == "-" else frozenset(may.split(", "))
        layers.append(Layer(name, tuple(packages.split(", ")), allowed))
    return layers


def layer_of(module: str, layers: list[Layer]) -> Layer:
    """The layer whose most specific package holds `module` (a dotted name under swarm)."""
    best, depth = None, -1
    for layer in layers:
        for pkg in layer.packages:
            if pkg == TOP_MODULES:
                hit, d = module.count(".") <= 1, 0
            else:
                hit, d = module == pkg or module.startswith(pkg + "."), pkg.count(".")
            if hit and d > depth:
                best, depth = layer, d
    assert best is not None, f"{module} is in no layer of docs/design.md"
    return best


def upward_imports(module: str, source: str, is_package: bool, layers: list[Layer]) -> list[str]:
    """'a -> b (layer x may not import layer y)' for each import of a layer `module` may not use."""
    own = layer_of(module, layers)
    bad = []
    for target in sorted(imported(source, module, is_package)):
        if target == "swarm":
            continue  # the package's face: its version
        theirs = layer_of(target, layers)
        if theirs.name != own.name and theirs.name not in own.may_import:
            bad.append(f"{module} -> {target} ({own.name} may not import {theirs.name})")
    return bad


LAYERS = read_layers((ROOT / "docs" / "design.md").read_text())


def test_no_module_imports_a_layer_above_its_own():
    bad = []
    for module, path in modules():
        is_package = path.name == "__init__.py"
        bad += upward_imports(module, path.read_text(), is_package, LAYERS)
    assert not bad, "imports across layers:\n" + "\n".join(bad)


def test_every_package_of_swarm_is_in_a_layer():
    listed = {pkg for layer in LAYERS for pkg in layer.packages}
    packages = {".".join(p.parent.relative_to(ROOT).parts) for p in PACKAGE.glob("*/__init__.py")}
    assert packages <= listed, f"packages without a layer in docs/design.md: {packages - listed}"


def test_an_import_of_the_client_from_the_node_is_caught():
    source = "def f():\n    from swarm.client.routing import find_route\n"
    bad = upward_imports("swarm.node.server", source, False, LAYERS)
    assert bad == ["swarm.node.server -> swarm.client.routing (node may not import client)"]


def test_an_import_of_the_node_from_the_core_is_caught():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from swarm.node import x\n"
    bad = upward_imports("swarm.dht", source, False, LAYERS)
    assert bad == ["swarm.dht -> swarm.node (core may not import node)"]


def test_a_relative_import_is_resolved_to_its_module():
    assert imported("from ..model import blocks\n", "swarm.node.server", False) == {"swarm.model"}
