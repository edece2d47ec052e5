"""Imports go one way: rollout <- opd <- actors <- launch; Ray only in actors/launch,
DeepSpeed only in actors (DESIGN.md)."""
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
