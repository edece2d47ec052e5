"""Imports go one way: rollout <- opd <- actors <- launch (and inside opd/, config <- data <- models
<- distill <- eval, run); Ray only in actors/launch,
DeepSpeed only in actors (docs/ARCHITECTURE.md, Layers); and no module imports itself through
others (no import cycles, lazy imports inside functions included; scripts/ is in the cycle check).

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


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_nodes(tree: ast.AST):
    """Every node of a module except those under `if TYPE_CHECKING:` (imports for annotations
    only, never executed, so never part of a cycle)."""
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
            for b in node.body for n in ast.walk(b)}
    return (n for n in ast.walk(tree) if id(n) not in skip)


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of the four packages it imports (at any depth of its code, so a
    lazy import inside a function counts): `from a.b import c` is an edge to a.b.c when c is a
    module, else to a.b."""
    modules = {module_name(f): f for p in PACKAGES for f in (ROOT / p).rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for node in runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                           else node.module for a in node.names]
            else:
                continue
            graph[mod] |= {t for t in targets if t in modules and t != mod}
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


def test_annotation_only_imports_are_not_edges():
    tree = ast.parse("import typing\nif typing.TYPE_CHECKING:\n    import a.b\nimport c\n")
    names = {a.name for n in runtime_nodes(tree) if isinstance(n, ast.Import) for a in n.names}
    assert names == {"typing", "c"}


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
