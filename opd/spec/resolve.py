"""Resolving a spec: the one place that reads the files it names, once, in the driver.

The schema (opd/spec/schema.py) validates a mapping without reading a file, so every actor can validate the spec
it is handed, and a validator never waits on a slow shared filesystem. What only the files can say is filled in or
checked here, before the schema's rules run: the target's depth (which the drafter's layer ids are checked
against), the prompt pool's size (which a run length in epochs counts), whether a warm drafter is the drafter the
spec describes, and whether every path exists.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from opd.formats import DRAFTER_SECTIONS, detect_section
from opd.model_dir import ModelDir
from opd.spec.schema import ExperimentSpec

KINDS = [section.model_fields["kind"].default for section in DRAFTER_SECTIONS]


def file_facts(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(a copy of the raw spec with `models.target_num_layers` and `data.train_pool_size` filled from the files
    where unset, the lines for values that disagree with the files)."""
    data = copy.deepcopy(data)
    models, prompts = data.get("models"), data.get("data")
    problems = []
    if isinstance(models, dict) and isinstance(models.get("target_path"), str):
        target = ModelDir.find(models["target_path"], "target model")
        problems += _take(models, "target_num_layers", target.num_layers if target else None, "models",
                          f"num_hidden_layers {{value}} in {models['target_path']}/config.json")
        _take_kind(models)
    if isinstance(prompts, dict) and isinstance(prompts.get("train_prompts"), str):
        lines = count_prompts(Path(prompts["train_prompts"]))
        problems += _take(prompts, "train_pool_size", lines, "data",
                          f"the {{value}} prompts in {prompts['train_prompts']}")
    return data, problems


def _take_kind(models: dict[str, Any]) -> None:
    """An unset `models.drafter.kind` is the warm drafter's family, as its config.json says."""
    drafter = models.setdefault("drafter", {})
    directory = ModelDir.find(models.get("drafter_path"), "drafter") if isinstance(drafter, dict) else None
    section = detect_section(directory.config) if directory is not None else None
    if section is not None and "kind" not in drafter:
        drafter["kind"] = section.model_fields["kind"].default


def _take(section: dict[str, Any], name: str, value: int | None, where: str, source: str) -> list[str]:
    """Fill `section[name]` with what the file says, or report that the spec says otherwise."""
    if value is None:
        return []
    if section.get(name) is None:
        section[name] = value
        return []
    if section[name] != value:
        return [f"{where}.{name}: {section[name]} disagrees with {source.format(value=value)} (expected {value} or "
                "unset)"]
    return []


def count_prompts(path: Path) -> int | None:
    """Non-blank lines of a prompt file, or None when it cannot be read (the path check names it)."""
    try:
        return sum(1 for line in path.read_bytes().splitlines() if line.strip())
    except OSError:
        return None


def warm_drafter_issues(spec: ExperimentSpec) -> list[str]:
    """A warm drafter's checkpoint fixes its architecture; the spec must describe the same drafter."""
    m = spec.models
    directory = ModelDir.find(m.drafter_path, "drafter")
    if directory is None:
        return []
    section = detect_section(directory.config)
    if section is None or section.model_fields["kind"].default != m.drafter.kind:
        found = "an unknown" if section is None else f"a {section.model_fields['kind'].default}"
        return [f"models.drafter.kind: {m.drafter.kind} but {m.drafter_path}/config.json is {found} drafter "
                f"(expected kind: {'one of ' + ', '.join(KINDS) if section is None else found.split()[-1]})"]
    return [f"models.drafter.{key}: {ours} disagrees with the warm drafter's {found} in {m.drafter_path}/config.json "
            f"(expected {found})"
            for key, (ours, found) in m.drafter.checkpoint_fields(directory.config, m.layer_ids).items()
            if found is not None and ours is not None and found != ours]


def path_problems(spec: ExperimentSpec) -> list[str]:
    """One message per required path that is missing or of the wrong kind; empty when all are usable."""
    m, d = spec.models, spec.data
    wanted = [("models.target_path", m.target_path, "model"),
              ("models.tokenizer_path", m.tokenizer_path if m.tokenizer_path != m.target_path else None, "dir"),
              ("models.drafter_path", m.drafter_path, "model"),
              ("data.train_prompts", d.train_prompts, "file"), ("data.eval_prompts", d.eval_prompts, "file"),
              ("rollout.samples_path", spec.rollout.samples_path if spec.rollout.source == "samples" else None,
               "file"), ("eval.samples_path", spec.eval.samples_path, "file"),
              ("eval.suite", spec.eval.suite, "suite")]
    return [msg for field, path, kind in wanted
            if path is not None and (msg := _path_problem(field, Path(path), kind))]


def _path_problem(field: str, path: Path, kind: str) -> str | None:
    expected = {"model": "a model directory with config.json", "dir": "a directory", "file": "a jsonl file",
                "suite": "the directory `opd suite build --suite NAME --out DIR` wrote"}[kind]
    if not path.exists():
        problem = "does not exist"
    elif kind == "file" and not path.is_file():
        problem = "is not a file"
    elif kind != "file" and not path.is_dir():
        problem = "is not a directory"
    elif kind == "model" and not (path / "config.json").is_file():
        problem = "has no config.json"
    else:
        return None
    where = "" if path.is_absolute() else f", relative to {os.getcwd()}"
    return f"{field}: {path} {problem} (expected {expected}{where})"


