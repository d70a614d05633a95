"""docs/design/architecture.md's "## Layout" block matches the tree: every `opd/` module it names exists, and every
package under `opd/` has a line of its own.

The block is read as an indented tree. An entry line starts at two spaces per level, with a folder (`name/`) or
modules (`name.py`); a line indented deeper than one level below the previous entry continues that entry's prose.
A `.py` name resolves against the folder its entry belongs to (a folder entry's own folder, a module entry's
parent), or against the repository root when its first part is a top-level folder (`opd/eval/online.py`,
`bench/scale.py`), so one stage's entry can name another's module. Only names under `opd/` are checked; the prose
around them is free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "design" / "architecture.md"
INDENT = 2  # spaces per level of the tree
ENTRY = re.compile(r"(?P<indent> *)(?P<name>[\w.-]+/|[\w.-]+\.py)(?:\s|$)")
MODULE = re.compile(r"[\w/.-]*\w\.py\b")


@dataclass(frozen=True)
class Named:
    """A module the block names: its path from the repository root, and the line it is on (for the message)."""

    path: Path
    line: str


def layout_block(text: str) -> list[str]:
    """The lines of the first fenced block after the "## Layout" heading."""
    section = text.split("\n## Layout\n", 1)
    assert len(section) == 2, f"{DOC.relative_to(ROOT)} has no '## Layout' section"
    fenced = re.search(r"^```[^\n]*\n(.*?)^```", section[1], flags=re.M | re.S)
    assert fenced, f"{DOC.relative_to(ROOT)}'s Layout section has no fenced code block"
    return fenced.group(1).splitlines()


def resolve(name: str, folder: Path) -> Path:
    """`name` against the repository root when it starts with a top-level folder, else against `folder`."""
    first = name.split("/", 1)[0]
    return ROOT / name if "/" in name and (ROOT / first).is_dir() else folder / name


def read_tree(lines: list[str]) -> tuple[list[Path], list[Named]]:
    """The folders with an entry line of their own, and every module the block names (with its line)."""
    folders: list[Path] = []
    named: list[Named] = []
    stack: list[Path] = []  # the folder entries above the current line, by level
    folder = ROOT  # the folder the current entry's `.py` names resolve against
    for line in lines:
        entry = ENTRY.match(line)
        indent = len(entry.group("indent")) if entry else -1
        level = indent // INDENT
        if entry and indent % INDENT == 0 and level <= len(stack):
            del stack[level:]
            parent = stack[-1] if stack else ROOT
            if entry.group("name").endswith("/"):
                folder = parent / entry.group("name").rstrip("/")
                stack.append(folder)
                folders.append(folder)
            else:
                folder = parent
        named += [Named(resolve(m, folder), line.strip()) for m in MODULE.findall(line)]
    return folders, named


def test_every_opd_module_the_layout_names_exists():
    _, named = read_tree(layout_block(DOC.read_text()))
    missing = [n for n in named if n.path.is_relative_to(ROOT / "opd") and not n.path.is_file()]
    assert not missing, "\n".join(
        f"{DOC.relative_to(ROOT)}'s Layout names {n.path.relative_to(ROOT)}, which does not exist: remove it or "
        f"write the module's current name (line: {n.line!r})" for n in missing)


def test_every_opd_package_has_a_line_in_the_layout():
    folders, _ = read_tree(layout_block(DOC.read_text()))
    packages = sorted(p.parent for p in (ROOT / "opd").rglob("__init__.py"))
    unlisted = [p for p in packages if p not in folders]
    assert not unlisted, "\n".join(
        f"{DOC.relative_to(ROOT)}'s Layout has no line for the package {p.relative_to(ROOT)}/: add "
        f"'{' ' * INDENT * (len(p.relative_to(ROOT).parts) - 1)}{p.name}/' under "
        f"{p.parent.relative_to(ROOT)}/'s line, with what it holds" for p in unlisted)
    stale = [f for f in folders if f.is_relative_to(ROOT / "opd") and not (f / "__init__.py").is_file()]
    assert not stale, "\n".join(
        f"{DOC.relative_to(ROOT)}'s Layout lists {f.relative_to(ROOT)}/, which is not a package: remove its line "
        "or write the package's current name" for f in stale)


def test_the_tree_reading_follows_levels_and_skips_prose():
    lines = ["opd/    lib, see serving/isolated.py",
             "  a.py b.py    root modules",
             "  models/  x.py (see bench/scale.py)",
             "                y.py, opd/eval/online.py",
             "    kinds/  full.py",
             "  eval/  z.py",
             "tests/  pytest"]
    folders, named = read_tree(lines)
    opd = ROOT / "opd"
    assert folders == [opd, opd / "models", opd / "models" / "kinds", opd / "eval", ROOT / "tests"]
    assert [n.path for n in named] == [
        opd / "serving" / "isolated.py", opd / "a.py", opd / "b.py", opd / "models" / "x.py", ROOT / "bench" / "scale.py",
        opd / "models" / "y.py", opd / "eval" / "online.py", opd / "models" / "kinds" / "full.py", opd / "eval" / "z.py"]
