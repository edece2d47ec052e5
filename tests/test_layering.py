"""Imports go one way: rollout <- opd <- actors <- launch (and inside opd/, config <- data <- models
<- distill <- eval, run); Ray only in actors/launch,
DeepSpeed only in actors (docs/ARCHITECTURE.md, Layers); and no module imports itself through
others (no import cycles, counting imports inside functions and under TYPE_CHECKING; scripts/ is in
the cycle check).

    python tests/test_layering.py      # prints the import graph's size, depth and cycles
"""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "rollout": {"opd", "actors", "launch", "ray", "deepspeed"},
    "opd": {"actors", "launch", "ray", "deepspeed"},
    "actors": {"launch"},
    "launch": {"deepspeed"},
}


PACKAGES = ("rollout", "opd", "actors", "launch", "scripts")   # scripts/: for cycles only


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT, packages=PACKAGES) -> dict[str, set[str]]:
    """module -> the modules of the packages it imports, counting every import statement: at any
    depth of its code (a lazy import inside a function) and under `if TYPE_CHECKING:` (an
    annotation names the other module's type, so the two modules depend on each other all the
    same).  `from a.b import c` is an edge to a.b.c when c is a module, else to a.b; a relative
    import is resolved against the module's package."""
    files = {module_name(f, root): f for p in packages for f in (root / p).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) + 1 - node.level] if node.level else [])
                source = ".".join(filter(None, [base, node.module]))
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in files else source
                           for a in node.names]
            else:
                continue
            graph[mod] |= {t for t in targets if t in files and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each holds a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:                 # Tarjan
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
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def depth(graph: dict[str, set[str]]) -> int:
    """Modules on the longest import chain (the modules of one cycle count as one)."""
    node = {m: m for m in graph} | {m: f"cycle {i}" for i, c in enumerate(cycles(graph)) for m in c}
    dag: dict[str, set[str]] = {}
    for m, targets in graph.items():
        dag.setdefault(node[m], set()).update(node[t] for t in targets if node[t] != node[m])
    memo: dict[str, int] = {}

    def longest(v: str) -> int:
        if v not in memo:
            memo[v] = 1 + max((longest(w) for w in dag[v]), default=0)
        return memo[v]

    return max(longest(v) for v in dag)


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_go_one_way(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"package {package} has no files"
    bad = {str(f.relative_to(ROOT)): sorted(imported_roots(f) & FORBIDDEN[package]) for f in files}
    bad = {f: mods for f, mods in bad.items() if mods}
    assert not bad, f"forbidden imports: {bad}"


def test_checker_sees_forbidden_imports(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import ray.util\nfrom deepspeed import init\nfrom . import local\n")
    assert imported_roots(f) == {"ray", "deepspeed"}


def test_no_import_cycles():
    graph = import_graph()
    assert {"rollout.engine", "opd.distill.steps", "actors.driver.pipeline", "launch.cli",
            "scripts.soak", "scripts.node_loss"} <= set(graph)
    assert "scripts.node_loss" in graph["scripts.soak"]            # the soak runs the node faults
    assert cycles(graph) == []


def test_every_import_is_an_edge_and_a_planted_circle_fails(tmp_path):
    """An import under TYPE_CHECKING, one inside a function and a relative one all count: the
    planted circle a -> b -> c -> a is found though no import of it runs at module load."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from pkg.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": {"pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_cycle_finder_sees_a_cycle_and_measures_depth():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert depth(graph) == 3                         # e -> {a, b, c} -> d
    assert depth({"a": {"b"}, "b": {"c"}, "c": set()}) == 3



ROLES = {"actors.transport": ("actors.workers", "actors.driver", "actors.bench"),
         "actors.workers": ("actors.driver", "actors.bench"),
         "actors.driver": ("actors.bench",)}


def test_actors_roles_import_one_way():
    """actors/: driver -> workers -> transport (bench helpers on top)."""
    bad = {m: sorted(t for t in targets if t.startswith(ROLES[role]))
           for m, targets in import_graph().items()
           for role in ROLES if m.startswith(role + ".")}
    assert {m: t for m, t in bad.items() if t} == {}


CONCEPTS = {"opd.config": ("opd.data", "opd.models", "opd.distill", "opd.eval", "opd.run"),
            "opd.data": ("opd.models", "opd.distill", "opd.eval", "opd.run"),
            "opd.models": ("opd.distill", "opd.eval", "opd.run"),
            "opd.distill": ("opd.eval", "opd.run")}


def test_opd_concepts_import_one_way():
    """opd/: config <- data <- models <- distill <- eval, run (docs/ARCHITECTURE.md, module map of
    opd/); eval reads what a run writes (checkpoints, metrics logs) and a run evaluates, so those
    two may import each other's modules (never in a cycle: test_no_import_cycles)."""
    graph = import_graph()
    assert {"opd.config.schema", "opd.data.splits", "opd.models.factory", "opd.distill.steps",
            "opd.run.reference"} <= set(graph)
    bad = {m: sorted(t for t in targets if t.startswith(CONCEPTS[c]))
           for m, targets in graph.items() for c in CONCEPTS if m.startswith(c + ".")}
    assert {m: t for m, t in bad.items() if t} == {}


if __name__ == "__main__":
    g = import_graph()
    print(f"{len(g)} modules, {sum(map(len, g.values()))} imports, depth {depth(g)}, "
          f"{len(cycles(g))} cycles: {cycles(g)}")
