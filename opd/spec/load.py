"""Loading a spec: YAML in, `base:` chains merged, `--set` overrides applied, every problem one line.

- A file may name `base: other.yaml` (relative to that file). Mappings deep-merge, the child wins, lists and scalars
  are replaced; chains are allowed and cycles are reported. `base: [a.yaml, b.yaml]` merges them in order, so a
  preset (configs/presets/) can be layered on any experiment.
- `--set a.b=c` overrides are applied after inheritance; the value is parsed as YAML, so `optim.lr=1e-4`,
  `loss.rejected_decay=false` and `resources.rollout.replicas=2` arrive typed.
- Relative model and data paths are kept as written and resolved against the current working directory when
  used; the shipped configs use paths relative to the repository root, so run `opd` from there.
- Every problem becomes one line `field.path: what is wrong (what is expected)` inside a `SpecError`.

Loading ends with `opd.spec.resolve`, which reads the files the spec names once: what reaches an actor is the
resolved spec, which validates again without touching a file.
"""

from __future__ import annotations

import difflib
import os
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Tag, ValidationError

from opd.errors import OpdError
from opd.spec.experiment import ExperimentSpec
from opd.spec.resolve import (
    SpecFiles,
    file_facts,
    path_problems,
    shard_degree_issues,
    warm_drafter_issues,
    written_for_another_family,
)


class SpecError(OpdError):
    """A spec that cannot be used; carries one line per problem so the CLI can print them all at once."""

    def __init__(self, messages: Sequence[str]):
        self.messages = list(messages)
        super().__init__("\n".join(self.messages))


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys, which PyYAML would otherwise resolve silently (last one wins)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line for a YAML error, with its 1-based line and column when PyYAML knows them."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
    return f"invalid YAML{where}: {problem}"


def _read_yaml(path: Path) -> dict[str, Any]:
    """One config file as a mapping, or a SpecError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError([f"{path}: file not found (expected a YAML spec)"]) from None
    except IsADirectoryError:
        raise SpecError([f"{path}: is a directory (expected a YAML spec file)"]) from None
    except UnicodeDecodeError:
        raise SpecError([f"{path}: not UTF-8 text (expected a YAML spec file)"]) from None
    except OSError as exc:
        raise SpecError([f"{path}: cannot read ({exc.strerror})"]) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        raise SpecError([f"{path}: {_yaml_problem(exc)}"]) from None
    if data is None:
        raise SpecError([f"{path}: file is empty (expected a YAML mapping of spec sections)"])
    if not isinstance(data, dict):
        raise SpecError([f"{path}: top level is a {type(data).__name__} (expected a mapping of spec sections)"])
    return data


def _deep_merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """Child wins; mappings merge recursively so a child states only its difference."""
    merged = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _resolve_file(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config with its `base:` chain merged in; `chain` holds the files above it, to detect cycles."""
    real = path.resolve()
    if real in chain:
        cycle = " -> ".join(str(p) for p in (*chain, real))
        raise SpecError([f"{path}: base cycle {cycle} (expected a chain that ends)"])
    data = _read_yaml(path)
    base = data.pop("base", None)
    bases = [base] if isinstance(base, str) else base or []
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise SpecError([f"{path}: base: got {base!r} (expected the path of another YAML spec, or a list of them)"])
    merged: dict[str, Any] = {}
    for name in bases:
        base_path = Path(os.path.normpath(path.parent / name))
        if not base_path.exists():
            raise SpecError([f"{path}: base: {base_path} not found (expected a YAML spec, relative to this file)"])
        merged = _deep_merge(merged, _resolve_file(base_path, (*chain, real)))
    return _deep_merge(merged, data)


def _apply_override(data: dict[str, Any], item: str) -> str | None:
    """Apply one `a.b=c` in place; return a problem line instead when it is malformed.

    A numeric segment indexes a list (`eval.sampling.0.temperature=0.6`); a list the config does not set is
    first filled with the spec's default, so its items can be addressed as they will be validated."""
    key, sep, raw = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        return f"--set {item!r}: malformed (expected KEY=VALUE with a dotted key, e.g. optim.lr=1e-4)"
    try:
        value = yaml.load(raw, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        return f"--set {item!r}: {_yaml_problem(exc)}"
    node: dict[str, Any] | list[Any] = data
    try:
        for depth in range(len(parts) - 1):
            node = _child(node, parts[: depth + 1], indexed=parts[depth + 1].isdigit())
        container: Any = node  # a mapping indexed by key or a list by position, as `_slot` says
        container[_slot(node, parts)] = value
    except ValueError as exc:
        return f"--set {item!r}: {exc}"
    return None


def _child(node: dict[str, Any] | list[Any], path: list[str], indexed: bool) -> dict[str, Any] | list[Any]:
    """The section or list at `path` (its last segment read from `node`); a missing one is created: the spec's
    default list when the next segment is an index, else an empty section."""
    if isinstance(node, dict) and path[-1] not in node and not path[-1].isdigit():
        default = _default_list(path)
        if indexed and default is None:
            raise ValueError(f"{'.'.join(path)} is not a list (an index needs a list field; set the whole value "
                             f"instead, e.g. --set {'.'.join(path)}=[...])")
        node[path[-1]] = {} if default is None else default
    container: Any = node  # as `_slot` says: a key of a mapping or a position in a list
    child = container[_slot(node, path)]
    if not isinstance(child, (dict, list)):
        raise ValueError(f"{'.'.join(path)} is a {type(child).__name__}, not a section (expected a mapping or "
                         "a list)")
    return child


def _slot(node: dict[str, Any] | list[Any], path: list[str]) -> str | int:
    """The key or list index that the last segment of `path` names in `node`."""
    where, part = ".".join(path[:-1]) or "the spec", path[-1]
    if isinstance(node, dict):
        if part.isdigit():
            raise ValueError(f"{where} is a mapping, not a list (index {part} needs a list field)")
        return part
    indices = f"0..{len(node) - 1}" if node else "none: the list is empty"
    if not part.isdigit():
        raise ValueError(f"{where} is a list (expected an item index, {indices}; got {part!r})")
    if int(part) >= len(node):
        raise ValueError(f"{where}.{part}: index out of range ({where} has {len(node)} items; indices {indices})")
    return int(part)


def _default_list(path: list[str]) -> list[Any] | None:
    """The spec's default for the list field at `path` (as plain data), None for anything else."""
    model: type[BaseModel] = ExperimentSpec
    for depth, part in enumerate(path):
        field = model.model_fields.get(part)
        if field is None:
            return None
        if depth == len(path) - 1:
            default = field.get_default(call_default_factory=True)
            if not isinstance(default, (list, tuple)):  # a tuple default (optim.betas) is a list in YAML
                return None
            return [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in default]
        nested = _sections(field.annotation)
        if not nested:
            return None
        model = nested[0]
    return None


def _sections(annotation: Any) -> list[type[BaseModel]]:
    """The spec models an annotation holds: a section, the items of a list of them, or a tagged union's members."""
    return [t for t in (annotation, *map(_unannotated, getattr(annotation, "__args__", ())))
            if isinstance(t, type) and issubclass(t, BaseModel)]


def _unannotated(member: Any) -> Any:
    return typing.get_args(member)[0] if typing.get_origin(member) is typing.Annotated else member


def _tags(annotation: Any) -> dict[str, type[BaseModel] | None]:
    """A union's members by the tag pydantic puts in an error's location: a section's `kind`, or the `Tag` of a
    member (`number` or `range` in resources.rollout.replicas.range.max)."""
    tags: dict[str, type[BaseModel] | None] = {}
    for member in getattr(annotation, "__args__", ()):
        model = _unannotated(member)
        section = model if isinstance(model, type) and issubclass(model, BaseModel) else None
        for extra in typing.get_args(member)[1:]:
            if isinstance(extra, Tag):
                tags[extra.tag] = section
        if section is not None and "kind" in section.model_fields:
            tags[str(section.model_fields["kind"].default)] = section
    return tags


def _untagged(loc: tuple[int | str, ...]) -> tuple[tuple[int | str, ...], type[BaseModel] | None]:
    """(`loc` without the tags pydantic puts after a tagged union's field, such as `dflash` in
    models.drafter.dflash.block_size, the spec model `loc` ends in, None past a section)."""
    model: type[BaseModel] | None = ExperimentSpec
    out: list[int | str] = []
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        out.append(part)
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part)
        members = _sections(field.annotation) if field else []
        tags = _tags(field.annotation) if field else {}
        if len(tags) > 1 and parts and parts[0] in tags:
            model = tags[str(parts.pop(0))]
        else:
            model = members[0] if members else None
    return tuple(out), model


def _error_path(loc: tuple[int | str, ...]) -> str:
    """Pydantic location as `eval.sampling[1].top_p`."""
    out = ""
    for part in _untagged(loc)[0]:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _other_family(loc: tuple[int | str, ...]) -> str | None:
    """The kind of the tagged union member that has the unknown key at the end of `loc`, when another member does
    (a DFlash 2 option on a dflash drafter), else None."""
    parent = _untagged(loc[:-1])[0]
    if not parent or isinstance(parent[-1], int):
        return None
    container = _untagged(parent[:-1])[1]
    field = container.model_fields.get(parent[-1]) if container is not None else None
    members = _sections(field.annotation) if field is not None else []
    owners = [str(m.model_fields["kind"].default) for m in members
              if "kind" in m.model_fields and loc[-1] in m.model_fields]
    return owners[0] if len(members) > 1 and owners else None


def _homes(key: str, parent: str) -> list[str]:
    """Where else in the spec a misplaced `parent.key` lives: a field named `<parent's name>_<key>` (what an option
    is called one level up or in a family's section: `models.drafter_path` for `models.drafter.path`,
    `models.drafter.sft_objective` for `sft.objective`), else a field `key` of another section; a field of one
    drafter family only names its kind."""
    prefixed = f"{parent.rsplit('.', 1)[-1]}_{key}"
    found: dict[str, list[str | None]] = {}

    def walk(model: type[BaseModel], prefix: str, kind: str | None) -> None:
        for name, field in model.model_fields.items():
            path = f"{prefix}{name}"
            if name in (key, prefixed) and path != f"{parent}.{key}":
                found.setdefault(path, []).append(kind)
            members = _sections(field.annotation)
            for member in members:
                tagged = len(members) > 1 and "kind" in member.model_fields
                walk(member, f"{path}.", str(member.model_fields["kind"].default) if tagged else kind)

    walk(ExperimentSpec, "", None)
    named = [(path, kinds) for path, kinds in found.items() if path.endswith(prefixed)] or list(found.items())
    return [path + (f" (kind {kinds[0]})" if len(kinds) == 1 and kinds[0] else "") for path, kinds in named][:4]


def _fields_at(loc: tuple[int | str, ...]) -> list[str]:
    """Field names of the spec model at `loc`, to suggest the intended key for an unknown one."""
    model = _untagged(loc)[1]
    return list(model.model_fields) if model is not None else []


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _format_error(err: Mapping[str, Any]) -> list[str]:
    """Pydantic error -> `field.path: what is wrong (what is expected)` lines."""
    loc, kind = tuple(err["loc"]), err["type"]
    path = _error_path(loc)
    if kind == "spec_issues":
        prefix = f"{path}." if path else ""
        return [prefix + issue for issue in err["ctx"]["issues"]]
    if kind == "extra_forbidden":
        fields = _fields_at(loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), fields, n=1)
        homes = _homes(str(loc[-1]), path.rsplit(".", 1)[0]) if "." in path else []
        hint = (f"did you mean {' or '.join(homes)}?" if homes else f"did you mean {close[0]!r}?" if close
                else f"expected one of: {', '.join(fields)}")
        owner = _other_family(loc)
        if owner:
            hint = f"an option of kind {owner}; expected kind: {owner}, or the key removed"
        return [f"{path}: unknown key ({hint})"]
    if kind == "missing":
        return [f"{path}: missing (a value is required)"]
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return [f"{path or 'spec'}: got a {type(err['input']).__name__} (expected a mapping of fields)"]
    msg = err["msg"].removeprefix("Input ")
    return [f"{path}: got {_short(err['input'])} ({msg[0].lower() + msg[1:]})"]


def _drafter_lines_as(another: list[str], lines: list[str]) -> list[str]:
    """`lines` with those about the drafter section replaced by `another` (the one line saying the section was
    written for another family), where there is one: each of them would be a round to follow."""
    about_drafter = [line for line in lines if line.startswith(("models.drafter.", "drafter "))]
    return another + [line for line in lines if line not in about_drafter] if another and about_drafter else lines


def validate_spec(data: dict[str, Any], *, check_paths: bool = True) -> ExperimentSpec:
    """A raw mapping as a resolved ExperimentSpec, or a SpecError listing every problem: the fields the files
    fix (the target's depth, the prompt pool's size) are filled from them or checked against them first, so the
    schema's cross-field rules see the true values. A model directory of the wrong kind (a drafter as the target)
    is refused alone, before them: every fact read from it would be wrong."""
    files = SpecFiles.read(data)
    if misplaced := files.misplaced():
        raise SpecError(misplaced)
    another = written_for_another_family(data, files.drafter)
    data, problems = file_facts(data, files)
    try:
        spec = ExperimentSpec.model_validate(data)
    except ValidationError as exc:
        lines = problems + [line for err in exc.errors() for line in _format_error(err)]
        raise SpecError(_drafter_lines_as(another, lines)) from None
    problems += warm_drafter_issues(spec, files.drafter) + shard_degree_issues(spec.resources, files.target)
    problems = _drafter_lines_as(another, problems)
    if check_paths:
        problems += path_problems(spec)
    if problems:
        raise SpecError(problems)
    return spec


def load_spec(path: str | Path, overrides: Sequence[str] = (), *, check_paths: bool = True) -> ExperimentSpec:
    """Load a YAML spec with its `base:` chain and `--set` overrides, validated and resolved; raises SpecError."""
    data = _resolve_file(Path(path))
    problems = [p for item in overrides if (p := _apply_override(data, item))]
    if problems:
        raise SpecError(problems)
    return validate_spec(data, check_paths=check_paths)
