"""The layering docs/design/architecture.md states: actors/ → opd/, never back, except the launcher edge
opd/commands/launch.py → actors/; no Ray inside opd/ outside the launcher; no import cycles among opd/ and actors/;
and inside opd/ the floors below, where a module imports only from its own floor or one beneath it.

`LAYERS` is the one place the order is written down; the architecture page prints it (see
`test_the_architecture_page_states_the_layer_order`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = "opd.commands.launch"

# Bottom to top: the pipeline's stages in the order a prompt meets them, the ground beneath, the entry points above.
LAYERS: list[tuple[str, ...]] = [
    ("opd", "opd.errors", "opd.model_dir", "opd.formats", "opd.spec", "opd.progress", "opd.zero_copy", "opd.memory",
     "opd.tracking", "opd.run_dir", "opd.outputs"),
    ("opd.data",),  # prompt files, chat rendering, the prompt pool
    ("opd.models",),  # target, drafter families, formats, attention, LM head, FLOPs
    ("opd.tiny",),  # the shipped tiny models and their corpora
    ("opd.decoding",),  # speculative and autoregressive decoding
    ("opd.serving",),  # the vLLM engine
    ("opd.sources",),  # target samplers, the sample store, the rebuild
    ("opd.distill",),  # replay, losses, anchors
    ("opd.eval",),  # online and offline evaluation
    ("opd.train",),  # rollout, scorer, learner, SFT (no Ray)
    ("opd.reproduce",),  # matched-compute studies
    ("opd.commands",),  # one module per CLI command
    ("opd.cli",),
]


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
            out.update(f"{name}.{alias.name}" for alias in node.names)  # `from opd.commands import launch`
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
    assert LAUNCHER in _graph()["opd.commands.run"]


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


def _floor(module: str) -> int:
    """The floor of the longest LAYERS prefix of `module`."""
    matches = [(len(prefix), i) for i, floor in enumerate(LAYERS) for prefix in floor
               if module == prefix or module.startswith(prefix + ".")]
    assert matches, f"{module} is on no floor: add it to LAYERS"
    return max(matches)[1]


def test_every_module_imports_only_its_own_floor_or_below():
    graph = _graph()
    up = [f"{m} (floor {_floor(m)}) imports {i} (floor {_floor(i)})"
          for m, imports in sorted(graph.items()) if m.startswith("opd") for i in sorted(imports)
          if i.startswith("opd") and _floor(i) > _floor(m)]
    assert not up, "\n".join(up)


def test_the_launcher_is_the_one_edge_from_the_library_to_the_actors():
    edges = {(m, i) for m, imports in _graph().items() if m.startswith("opd")
             for i in imports if i.startswith("actors")}
    assert {m for m, _ in edges} == {LAUNCHER}


def test_the_root_of_opd_stays_small():
    root = sorted(p.name for p in (ROOT / "opd").glob("*.py"))
    assert len(root) <= 10, root


def test_the_architecture_page_states_the_layer_order():
    page = (ROOT / "docs" / "design" / "architecture.md").read_text()
    order = " < ".join(floor[0].removeprefix("opd.") if floor[0] != "opd" else "ground" for floor in LAYERS)
    assert order in page, f"docs/design/architecture.md should state the layer order: {order}"


def test_no_test_module_imports_another():
    """Shared test code lives in tests/helpers/, so a test module's imports never run another module's tests'
    module-level code, and moving a test never breaks an unrelated one."""
    offenders = [f"{path.name} imports {name}" for path in sorted((ROOT / "tests").glob("test_*.py"))
                 for name in sorted(_imports(path)) if name.split(".")[-1].startswith("test_")
                 and name.startswith(("tests.test_", "test_"))]
    assert not offenders, "\n".join(offenders)


def test_no_module_imports_another_modules_private_name():
    """What one module builds on from another is a public, documented member: an underscored name imported across
    modules is a seam nobody promised to keep."""
    found = []
    for path in sorted((ROOT / "opd").rglob("*.py")) + sorted((ROOT / "actors").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("opd", "actors")):
                found += [f"{_module(path)} imports {node.module}.{alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")]
    assert not found, found
