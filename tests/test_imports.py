"""The house's floors, read from the code (imports at module top and inside functions alike, bench/ included): no
import circles; profiles/ imports neither autotune/ nor exporters/ nor pipeline/; autotune/ imports neither exporters/
nor pipeline/; exporters/ does not import pipeline/ and reaches no module that measures or searches; kernels/ imports
no stage; only the CLI (and the benches) import the CLI's floors above the stages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("profiles", "autotune", "exporters", "kernels", "pipeline", "bench")
FORBIDDEN = {
    "profiles": {"autotune", "exporters", "pipeline", "cli", "bench"},
    "autotune": {"exporters", "pipeline", "cli", "bench"},
    "exporters": {"pipeline", "cli", "bench"},
    "kernels": {"profiles", "autotune", "exporters", "pipeline", "cli", "bench"},
    "pipeline": {"cli", "bench"},
}
# the torch-free modules every stage shares import no stage
FORBIDDEN |= dict.fromkeys(
    ("root", "settings", "records", "formats", "progress", "vllm_spelling"),
    {"profiles", "autotune", "exporters", "kernels", "pipeline", "bench", "cli"},
)
# what measures (loads a model and times or decodes it) or searches: a plan followed through export touches none of them
MEASURING_OR_SEARCHING = {
    "specdec_tune.profiles.torch_profile",
    "specdec_tune.profiles.torch_acceptance",
    "specdec_tune.profiles.vllm_profile",
    "specdec_tune.profiles.verify_curve",
    "specdec_tune.profiles.profile_run",
    "specdec_tune.profiles.decode_run",
    "specdec_tune.profiles.backends",
    "specdec_tune.profiles.models.loading",
    "specdec_tune.autotune.search",
    "specdec_tune.autotune.study",
}


def _modules() -> dict[str, Path]:
    files = [p for stage in STAGES for p in (ROOT / stage).rglob("*.py")] + sorted(ROOT.glob("*.py"))
    names = {}
    for p in files:
        parts = p.relative_to(ROOT).with_suffix("").parts
        names[".".join(("specdec_tune",) + parts).removesuffix(".__init__")] = p
    return names


def _bench_name(name: str, module: str) -> str:
    """A bench script imports its neighbours by their bare names (the scripts run from bench/)."""
    return f"specdec_tune.bench.{name}" if module.startswith("specdec_tune.bench.") else name


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and _is_type_checking(block.test)
        for stmt in block.body
        for n in ast.walk(stmt)
    }  # annotations' imports: never run
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
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
            out |= {".".join(n.split(".")[:k]) for k in range(2, n.count(".") + 2)} | {_bench_name(n, module)}
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


def _reach(graph: dict[str, set[str]], start: set[str]) -> set[str]:
    seen, todo = set(start), list(start)
    while todo:
        for w in graph[todo.pop()] - seen:
            seen.add(w)
            todo.append(w)
    return seen


def test_export_renders_without_measuring_or_searching():
    """exporters/ turns a plan into files and checks them: no module it can reach loads a model to run it, measures, or
    searches (those checks and loops are pipeline/'s); and it names no measuring module directly either."""
    graph = _graph()
    exporters = {m for m in graph if _floor(m) == "exporters"}
    assert MEASURING_OR_SEARCHING <= set(graph), "the list names modules that exist"
    assert sorted(_reach(graph, exporters) & MEASURING_OR_SEARCHING) == []


def test_the_walk_sees_a_bench_scripts_neighbours():
    graph = _graph()
    assert "specdec_tune.bench.common" in graph["specdec_tune.bench.decision_quality"]


@pytest.mark.parametrize(
    "planted, floor",
    [
        ("specdec_tune.profiles.specdec", "specdec_tune.exporters.bundle"),
        ("specdec_tune.kernels.greedy", "specdec_tune.profiles.schema"),
        ("specdec_tune.exporters.report", "specdec_tune.pipeline.export"),
    ],
)
def test_the_walk_sees_an_upward_import_and_a_circle(planted, floor):
    graph = _graph()
    graph[planted] = graph[planted] | {floor}
    assert any(_floor(t) in FORBIDDEN[_floor(planted)] for t in graph[planted])
    graph[floor] = graph[floor] | {planted}
    assert any(planted in c and floor in c for c in _circles(graph))


@pytest.mark.parametrize("stage", ["profiles", "autotune", "exporters", "kernels", "pipeline"])
def test_each_stage_names_its_entry_points(stage):
    import importlib

    package = importlib.import_module(f"specdec_tune.{stage}")
    assert package.__all__ and all(getattr(package, name) is not None for name in package.__all__)
