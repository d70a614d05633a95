"""Resolving a spec: the one place that reads the files it names, once, in the driver.

The schema (`opd.spec.experiment` and its sections) validates a mapping without reading a file, so every actor can
validate the spec it is handed, and a validator never waits on a slow shared filesystem. What only the files can say is filled in or
checked here, before the schema's rules run: the target's depth (which the drafter's layer ids are checked
against), the prompt pool's size (which a run length in epochs counts), whether a warm drafter is the drafter the
spec describes, and whether every path exists.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opd.formats import DRAFTER_SECTIONS, detect_section
from opd.formats.section import DrafterSection
from opd.model_dir import DRAFTER_FIELD, TARGET_FIELD, ModelDir, Wanted
from opd.spec.experiment import ExperimentSpec
from opd.spec.inputs import DEFAULT_SECTION
from opd.spec.resources import ResourcesSpec

KINDS = [section.model_fields["kind"].default for section in DRAFTER_SECTIONS]


@dataclass(frozen=True)
class SpecFiles:
    """The model directories a raw spec names, each read once (None where absent or unreadable: the path check
    names those)."""

    target: ModelDir | None
    drafter: ModelDir | None

    @classmethod
    def read(cls, data: dict[str, Any]) -> SpecFiles:
        models = data.get("models")
        models = models if isinstance(models, dict) else {}
        paths = [p if isinstance(p, str) else None for p in (models.get("target_path"), models.get("drafter_path"))]
        return cls(ModelDir.find(paths[0], "target model"), ModelDir.find(paths[1], "drafter"))

    def misplaced(self) -> list[str]:
        """A drafter named as the target or the target as the drafter, one line each: checked before anything is
        read from either, since a drafter's depth taken for the target's would only lead to layer-id errors."""
        named: tuple[tuple[ModelDir | None, Wanted, str], ...] = ((self.target, "target", TARGET_FIELD),
                                                                  (self.drafter, "drafter", DRAFTER_FIELD))
        return [line for directory, wanted, field in named
                if directory is not None and (line := directory.misplaced(wanted, field))]


def written_for_another_family(data: dict[str, Any], drafter: ModelDir | None) -> list[str]:
    """One line when the warm drafter is of another style than the default section's (EAGLE-3, P-EAGLE, an MTP
    head, against DFlash's) and the spec's drafter section, naming no kind, sets fields of its own: the spec was
    written for another drafter (configs/tiny.yaml given the tiny EAGLE-3 drafter), and its field-by-field
    refusals would take rounds to follow."""
    models = data.get("models")
    raw = models.get("drafter") if isinstance(models, dict) else None
    if drafter is None or not isinstance(raw, dict) or "kind" in raw or not raw:
        return []
    section = detect_section(drafter.config)
    if section is None:
        return []
    kind = str(section.model_fields["kind"].default)
    if section.style == DEFAULT_SECTION.style:  # families of the default's style read its fields as it does
        return []
    fields = ", ".join(f"{key}: {value}" for key, value in raw.items())
    shipped = Path(__file__).resolve().parents[2] / "configs" / f"tiny-{kind}.yaml"
    example = f", e.g. configs/{shipped.name}" if shipped.is_file() else ""
    return [f"{DRAFTER_FIELD}: {drafter.path} is {drafter.kind}, but this spec's models.drafter ({fields}) was not "
            f"written for it (expected a spec for {kind} drafters{example})"]


def file_facts(data: dict[str, Any], files: SpecFiles) -> tuple[dict[str, Any], list[str]]:
    """(a copy of the raw spec with `models.target_num_layers`, an unset `models.drafter.kind` and
    `data.train_prompts`'s size filled from the files, the lines for values that disagree with them)."""
    data = copy.deepcopy(data)
    models, prompts = data.get("models"), data.get("data")
    problems = []
    if isinstance(models, dict) and files.target is not None:
        problems += _take(models, "target_num_layers", files.target.num_layers, "models",
                          f"num_hidden_layers {{value}} in {models['target_path']}/config.json")
    if isinstance(models, dict) and isinstance(models.setdefault("drafter", {}), dict) and files.drafter is not None:
        section = detect_section(files.drafter.config)  # an unset kind is the warm drafter's family
        if section is not None and models["drafter"].setdefault("kind", section.model_fields["kind"].default) == \
                section.model_fields["kind"].default:
            _take_checkpoint_fields(models["drafter"], section, files.drafter.config)
    if isinstance(prompts, dict) and isinstance(prompts.get("train_prompts"), str):
        lines = count_prompts(Path(prompts["train_prompts"]))
        if lines == 0:  # named as the file, not as the pool size derived from it
            return data, problems + [f"data.train_prompts: {prompts['train_prompts']} holds no prompts (expected a "
                                     "jsonl file with one prompt a line)"]
        problems += _take(prompts, "train_pool_size", lines, "data",
                          f"the {{value}} prompts in {prompts['train_prompts']}")
    return data, problems


def _take_checkpoint_fields(raw: dict[str, Any], section: type[DrafterSection], config: dict[str, Any]) -> None:
    """A drafter section of the warm drafter's family describes that drafter: the fields its checkpoint fixes
    (block size, draft vocabulary, ...) and the section leaves out are the checkpoint's, not the section's
    defaults."""
    found = section.model_construct(kind=section.model_fields["kind"].default).checkpoint_fields(config, None)
    for name, (_, value) in found.items():
        if value is not None and name not in raw and name in section.model_fields:
            raw[name] = value


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


SPLIT_COUNTS = ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
                "num_experts", "num_local_experts")


def shard_degree_issues(resources: ResourcesSpec, target: ModelDir | None) -> list[str]:
    """A role's ranks split the target's heads (and linear-attention heads) by tensor parallelism and its experts
    by expert parallelism: each count the target's config.json names must divide by the degree. Key/value heads
    may instead divide the degree (Qwen3.5's 2 at 8 ranks): each rank then holds the attention whole
    (opd/models/sharding.py `attention_splits`)."""
    counts = {key: value for key in SPLIT_COUNTS if target is not None and (value := target.int_or_none(key))}
    issues = []
    for name in ("rollout", "scorer", "learner", "evaluator"):
        degree = getattr(resources, name).gpus_per_replica
        uneven = [f"{key} {count}" for key, count in counts.items()
                  if count % degree and not (key == "num_key_value_heads" and degree % count == 0)]
        if degree > 1 and uneven:
            issues.append(f"resources.{name}.gpus_per_replica: {degree} does not divide the target's "
                          f"{', '.join(uneven)} (expected a common divisor of {', '.join(map(str, counts.values()))}"
                          "; or a multiple of the key/value heads)")
    return issues


def warm_drafter_issues(spec: ExperimentSpec, directory: ModelDir | None) -> list[str]:
    """A warm drafter's checkpoint (`directory`) fixes its architecture; the spec must describe the same drafter."""
    m = spec.models
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


def input_paths(spec: ExperimentSpec) -> list[tuple[str, str, str]]:
    """(field, path, kind) of every input the spec names: models, prompts, stored samples, the suite."""
    m, d = spec.models, spec.data
    wanted = [("models.target_path", m.target_path, "model"),
              ("models.tokenizer_path", m.tokenizer_path if m.tokenizer_path != m.target_path else None, "dir"),
              ("models.drafter_path", m.drafter_path, "model"), ("sft.init_from", spec.sft.init_from, "model"),
              ("data.train_prompts", d.train_prompts, "file"), ("data.eval_prompts", d.eval_prompts, "file"),
              ("rollout.samples_path", spec.rollout.samples_path, "file"),
              ("eval.samples_path", spec.eval.samples_path, "file"), ("eval.suite", spec.eval.suite, "suite")]
    return [(field, str(path), kind) for field, path, kind in wanted if path not in (None, "random")]


def path_problems(spec: ExperimentSpec) -> list[str]:
    """One message per required path that is missing or of the wrong kind; empty when all are usable."""
    return [msg for field, path, kind in input_paths(spec)
            if (field != "rollout.samples_path" or spec.rollout.source == "samples")
            and (msg := _path_problem(field, Path(path), kind))]


def absolute_inputs(spec: ExperimentSpec) -> ExperimentSpec:
    """`spec` with every relative input path resolved where this process runs: a cluster's other nodes run their
    actors in other working directories, where a relative path names nothing (or something else)."""
    for field, path, _ in input_paths(spec):
        if not Path(path).is_absolute():
            section, name = field.split(".")
            part = getattr(spec, section)
            spec = spec.model_copy(update={section: part.model_copy(update={name: os.path.abspath(path)})})
    return spec


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


