"""The house's floors, read from the code (imports at module top and inside functions alike): no import circles;
profiles/ imports neither autotune/ nor exporters/; autotune/ does not import exporters/; kernels/ imports no
stage; only the CLI imports the CLI."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("profiles", "autotune", "exporters", "kernels")
FORBIDDEN = {"profiles": {"autotune", "exporters", "cli"}, "autotune": {"exporters", "cli"},
             "exporters": {"cli"}, "kernels": {"profiles", "autotune", "exporters", "cli"}}


def _modules() -> dict[str, Path]:
    files = [p for stage in STAGES for p in (ROOT / stage).rglob("*.py")] + sorted(ROOT.glob("*.py"))
    names = {}
    for p in files:
        parts = p.relative_to(ROOT).with_suffix("").parts
        names[".".join(("specdec_tune",) + parts).removesuffix(".__init__")] = p
    return names


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for n in names:  # importing a.b.c runs a.b's __init__ first: an edge to the package as well
            out |= {".".join(n.split(".")[:k]) for k in range(2, n.count(".") + 2)}
    return {n for n in out if n in known and n != module}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, m, set(modules)) for m, p in modules.items()}


def _floor(module: str) -> str:
    return (module.split(".") + ["root"])[1]


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), bar a package with its own children
    (an __init__ that re-exports what its modules define)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            found.append(component)

    for v in graph:
        if v not in index:
            visit(v)
    family = lambda c: all(any(o.startswith(x + ".") or x.startswith(o + ".") for o in c if o != x) for x in c)  # noqa: E731
    return [sorted(c) for c in found if len(c) > 1 and not family(c)]


def test_no_import_circles():
    assert _circles(_graph()) == []


def test_stages_import_downward_only():
    graph = _graph()
    up = [f"{m} -> {t}" for m, ts in graph.items() for t in ts if _floor(t) in FORBIDDEN.get(_floor(m), ())]
    assert up == []


@pytest.mark.parametrize("planted, floor", [("specdec_tune.profiles.specdec", "specdec_tune.exporters.bundle"),
                                            ("specdec_tune.kernels.greedy", "specdec_tune.profiles.schema")])
def test_the_walk_sees_an_upward_import_and_a_circle(planted, floor):
    graph = _graph()
    graph[planted] = graph[planted] | {floor}
    assert any(_floor(t) in FORBIDDEN[_floor(planted)] for t in graph[planted])
    graph[floor] = graph[floor] | {planted}
    assert any(planted in c and floor in c for c in _circles(graph))
