"""No import circle among swarm's modules: where two modules need each other, one of them takes a
narrow protocol instead.

Every import counts, at any depth of the code: at module level, inside a function, and under
`if TYPE_CHECKING:`. A circle of type-only imports is still two modules that cannot be read, moved
or tested apart, and an import inside a function is a circle deferred, not removed."""

from __future__ import annotations

from tests.helpers.imports import imported, modules


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """module -> the modules of `sources` it imports; sources: module -> (source, is_package)."""
    known = frozenset(sources)
    return {
        module: (imported(source, module, is_package, known) & known) - {module}
        for module, (source, is_package) in sources.items()
    }


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The modules of each circle (a strongly connected component of more than one module),
    sorted; Tarjan's algorithm, the recursion made a stack of iterators."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            v, targets = work[-1]
            w = next(targets, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = stack[stack.index(v) :]
                    del stack[stack.index(v) :]
                    if len(component) > 1:
                        out.append(sorted(component))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in stack:
                low[v] = min(low[v], index[w])
    return sorted(out)


def shortest_round(graph: dict[str, set[str]], circle: list[str]) -> list[str]:
    """The shortest path of imports from the circle's first module back to itself."""
    start, members = circle[0], set(circle)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    following.append(w)
        frontier = following
    raise AssertionError(f"{circle} is not a circle")


def named(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b -> a' for each circle, and every module in it where the round misses some."""
    out = []
    for circle in circles(graph):
        round_ = shortest_round(graph, circle)
        line = " -> ".join(round_)
        if len(round_) - 1 < len(circle):
            line += f" (circle of {', '.join(circle)})"
        out.append(line)
    return out


def test_no_module_of_swarm_is_in_an_import_circle():
    graph = import_graph({m: (p.read_text(), p.name == "__init__.py") for m, p in modules()})
    found = named(graph)
    assert not found, "import circles in swarm/:\n" + "\n".join(found)


def test_a_circle_through_a_type_only_import_is_caught():
    sources = {
        "swarm.node.server": ("from swarm.node.mover import hand_off\n", False),
        "swarm.node.mover": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from swarm.node.server import Node\n",
            False,
        ),
        "swarm.node.config": ("", False),
    }
    assert named(import_graph(sources)) == [
        "swarm.node.mover -> swarm.node.server -> swarm.node.mover"
    ]


def test_a_circle_of_three_through_a_function_level_import_is_caught():
    sources = {
        "swarm.node.session": ("from swarm.node import session_table\n", False),
        "swarm.node.session_table": ("from .downstream import Downstream\n", False),
        "swarm.node.downstream": ("def f():\n    from swarm.node.session import Session\n", False),
        "swarm.node": ("", True),
    }
    assert named(import_graph(sources)) == [
        "swarm.node.downstream -> swarm.node.session -> swarm.node.session_table"
        " -> swarm.node.downstream"
    ]


def test_two_modules_importing_a_third_are_no_circle():
    sources = {
        "swarm.a": ("import swarm.c\n", False),
        "swarm.b": ("from swarm.c import x\nfrom swarm import a\n", False),
        "swarm.c": ("", False),
    }
    assert named(import_graph(sources)) == []
