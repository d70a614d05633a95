"""MkDocs hook: the pages that come from the code, made at every build, so they cannot go stale.

- `reference/cli.md`: every `opd` command's help, from the argparse parser (`opd.cli.build_parser`).
- `reference/spec.md`: every experiment-spec field, from the pydantic models (`opd.spec.ExperimentSpec`): its type,
  default and bounds from the model, its note from the field's `description` (opd/spec/, opd/formats/).
- `results/bench/...`: the measured runs in `bench/results/` (reports, plots and their JSON), mounted as they are,
  so the results pages link to them without a copy in `docs/`, and `results/bench/index.md`, a list of the reports.
- `changelog.md`: the repository's `CHANGELOG.md`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import types
import typing
from pathlib import Path
from typing import Any

import annotated_types
from mkdocs.structure.files import File, Files
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
RESULT_SUFFIXES = (".md", ".png", ".json")
HELP_COLUMNS = "110"  # argparse wraps help to the terminal; a fixed width makes the page the same on every machine


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "reference/cli.md", content=cli_page()))
    files.append(File.generated(config, "reference/spec.md", content=spec_page()))
    files.append(File.generated(config, "changelog.md", abs_src_path=str(ROOT / "CHANGELOG.md")))
    reports = []
    for path in sorted(RESULTS.rglob("*")):
        if path.suffix in RESULT_SUFFIXES:
            uri = path.relative_to(RESULTS).as_posix()
            files.append(File.generated(config, "results/bench/" + uri, abs_src_path=str(path)))
            if path.suffix == ".md":
                reports.append(f"- [`{uri}`]({uri}): {_title(path)}")
    index = [
        "# Every measured run",
        "",
        "The reports in `bench/results/`, as the benchmarks and `opd reproduce` wrote "
        "them; the [results pages](../index.md) quote them.",
        "",
        *reports,
        "",
    ]
    files.append(File.generated(config, "results/bench/index.md", content="\n".join(index)))
    return files


def _title(path: Path) -> str:
    """A report's first heading, or its name."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return path.stem


# ------------------------------------------------------------------------------------------------------- the CLI


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help(parser: argparse.ArgumentParser) -> str:
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        return parser.format_help().rstrip()
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def cli_page() -> str:
    from opd.cli import build_parser

    parser = build_parser()
    out = [
        "# Command line (`opd`)",
        "",
        "Generated at every docs build from the argument parser in `opd/cli.py`: what `opd COMMAND --help` prints.",
        "Every user error is one line (`error: ...`) with exit code 2.",
        "",
        "```text",
        _help(parser),
        "```",
        "",
    ]
    for name, command in _subcommands(parser).items():
        out += [f"## `opd {name}`", "", command.description or "", "", "```text", _help(command), "```", ""]
        for subname, subcommand in _subcommands(command).items():
            out += [f"### `opd {name} {subname}`", "", "```text", _help(subcommand), "```", ""]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------------ the spec

_BOUNDS = (
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "≤"),
    (annotated_types.Lt, "lt", "<"),
)


def _bounds(metadata: list[Any]) -> list[str]:
    found = []
    for item in metadata:
        for kind, attribute, symbol in _BOUNDS:
            if isinstance(item, kind):
                found.append(f"{symbol} {getattr(item, attribute)}")
    return found


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The spec models an annotation holds (a section, or the items of a list of them)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _models(arg)]


def _type(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        bounds = _bounds(list(args[1:]))
        return _type(args[0]) + (f" ({', '.join(bounds)})" if bounds else "")
    if origin is typing.Literal:
        return " | ".join(f"`{json.dumps(arg)}`" for arg in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type(arg) for arg in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type(arg) for arg in args)}]"
    if annotation is type(None):
        return "null"
    return annotation.__name__


def _default(name: str, field: Any, section: BaseModel | None) -> str:
    """The field's default: as the section's default instance holds it when it has one (a section's default may
    differ from its class's, as `resources.evaluator`'s does), else as the field declares it."""
    if section is not None:
        value = getattr(section, name)
    elif field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{json.dumps([_plain(v) for v in value] if isinstance(value, list) else _plain(value))}`"


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_defaults=True)
    if isinstance(value, tuple):
        return list(value)
    return value


def _titled(dotted: str, model: type[BaseModel], members: int) -> str:
    """A section's title: a tagged union's member is named by its tag (`models.drafter (kind: eagle3)`)."""
    if members > 1 and "kind" in model.model_fields:
        return f"{dotted} (kind: {model.model_fields['kind'].default})"
    return dotted


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def spec_page() -> str:
    from opd.spec import ExperimentSpec

    out = [
        "# Experiment spec",
        "",
        "Generated at every docs build from the pydantic models in `opd/spec/` and the drafter families'",
        "sections in `opd/formats/`: each field's type, default, bounds and note (its `description`) come from the",
        "model. Cross-field rules",
        "(the validators) are not listed here: `opd validate CONFIG` applies them all and prints the resolved spec.",
        "Unknown keys, infinite and NaN floats are refused everywhere.",
        "",
    ]
    # (dotted path, model, its default instance when the section has one); each section is followed by its own
    # subsections, in field order
    sections: list[tuple[str, type[BaseModel], BaseModel | None]] = [("", ExperimentSpec, None)]
    while sections:
        path, model, instance = sections.pop(0)
        title = f"`{path}`" if path else "Top level"
        out += [
            f"## {title}",
            "",
            inspect.cleandoc(model.__doc__ or "") + f" (`{model.__name__}`)",
            "",
            "| field | type | default | note |",
            "|---|---|---|---|",
        ]
        subsections = []
        for name, field in model.model_fields.items():
            annotation = field.rebuild_annotation() if field.metadata else field.annotation
            dotted = f"{path}.{name}" if path else name
            inner, items = _models(field.annotation), "[]" if typing.get_origin(field.annotation) is list else ""
            if instance is not None:
                default = getattr(instance, name)
            else:
                default = field.default_factory() if field.default_factory is not None else None
            subsections += [
                (_titled(dotted + items, sub, len(inner)), sub, default if isinstance(default, sub) else None)
                for sub in inner
            ]
            note = field.description or ""
            if inner:
                note = (note + " " if note else "") + f"See `{dotted}{items}` below."
            out.append(
                f"| `{name}` | {_cell(_type(annotation))} | {_cell(_default(name, field, instance))} | {_cell(note)} |"
            )
        sections[0:0] = subsections
        out.append("")
    return "\n".join(out)
