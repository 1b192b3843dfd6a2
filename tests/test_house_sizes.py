"""A newcomer reads a module in one sitting and a function on one screen: no module of swarm/
over 450 lines, no function over 80."""

from __future__ import annotations

import ast

from tests.helpers.imports import modules

MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of each function or method in `source` longer than `limit` lines."""
    return [
        (node.name, node.end_lineno - node.lineno + 1)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_module_of_swarm_is_over_450_lines():
    long = {m: n for m, p in modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_of_swarm_is_over_80_lines():
    long = {m: f for m, p in modules() if (f := long_functions(p.read_text()))}
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_a_long_function_is_found():
    body = "".join(f"    x{i} = {i}\n" for i in range(85))
    assert long_functions(f"class A:\n    def f(self):\n{body}".replace("\n    x", "\n        x"))
    assert long_functions("def g():\n" + body) == [("g", 86)]
    assert not long_functions("def h():\n    return 1\n")
