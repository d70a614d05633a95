"""The layering the README states (Layout): actors/ → opd/, never back, except the launcher edge
opd/launch.py → actors/; no Ray inside opd/ outside the launcher; no import cycles among opd/ and actors/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = "opd.launch"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at module level or inside functions (relative imports resolved)."""
    package = _module(path).split(".") if path.name == "__init__.py" else _module(path).split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            name = ".".join(p for p in (base, node.module or "") if p)
            out.add(name)
            out.update(f"{name}.{alias.name}" for alias in node.names)  # `from opd import launch`
    return out


def _graph() -> dict[str, set[str]]:
    files = sorted((ROOT / "opd").rglob("*.py")) + sorted((ROOT / "actors").rglob("*.py"))
    modules = {_module(f): f for f in files}
    return {m: {i for i in _imports(f) if i in modules and i != m} for m, f in modules.items()}


def test_only_the_launcher_imports_actors_or_ray():
    offenders = []
    for path in sorted((ROOT / "opd").rglob("*.py")):
        if _module(path) == LAUNCHER:
            continue
        bad = sorted(i for i in _imports(path) if i.split(".")[0] in ("actors", "ray"))
        offenders += [f"{path.relative_to(ROOT)} imports {name}" for name in bad]
    assert not offenders, "\n".join(offenders)


def test_the_launcher_is_what_opd_train_and_opd_run_call():
    assert LAUNCHER in _graph()["opd.main_job"]


def test_there_are_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" → ".join(path[path.index(nxt):] + [node, nxt]) if nxt in path else f"{node} → {nxt}")
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "\n".join(cycles)
