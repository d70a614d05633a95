"""What `opd reproduce` runs: its YAML spec (`configs/reproduce/*.yaml`), one (arm, seed) job and its result."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from opd.errors import OpdError

BUDGET_ARM = "draft-opd"


class ArmSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    kind: Literal["opd", "sft"] = "opd"
    set: list[str] = Field(default_factory=list)  # `--set` overrides on the experiment, e.g. loss.kl_mode=...


class ReproduceSpec(BaseModel):
    """What `configs/reproduce/tiny.yaml` holds."""

    model_config = ConfigDict(extra="forbid")

    experiment: str  # the base experiment spec: target, warm drafter, prompts, SFT recipe
    set: list[str] = Field(default_factory=list)  # overrides for every arm
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2], min_length=1)
    opd_steps: int = Field(ge=2)  # the full method's steps; their FLOPs are every arm's budget
    eval_points: int = Field(4, ge=1)  # held-out τ measured at this many evenly spaced marks
    eval_prompts: int = Field(64, ge=1)
    # Further held-out prompt families (name -> jsonl, or a directory `opd suite build` wrote: one family per
    # benchmark, named <name>-<benchmark>), measured with every eval setting at the start and the end (the
    # experiment's data.eval_prompts is "heldout"): does a result hold on prompts nothing was tuned on? A suite's
    # benchmarks are evaluated at the experiment's eval.max_new_tokens.
    families: dict[str, str] = Field(default_factory=dict)
    sft_data: str | None = None  # the warm drafter's SFT data (jsonl); None: regenerate it with the spec's sft:
    workers: int = Field(2, ge=1)
    # Each seed's opd arms train on one shared file of target samples (OUT/samples/seed<S>.jsonl, every rollout
    # setting in it, drawn once and resumable): rollout.source target with that samples_path. The arms then compare
    # on identical target text (paired), and each (setting, prompt, epoch) is sampled once instead of once per arm.
    # Arms whose recipe needs the speculative engine (random anchors, or rollout.source set) decode their own.
    share_samples: bool = True
    # Held-out τ offline (opd/eval/offline.py): the warm drafter's decodes of each family, stored once per seed in
    # OUT/eval_samples/, and every arm's evals rebuild its blocks on them; `draft: sample` settings still decode.
    offline_eval: bool = True
    out_dir: str = "runs/reproduce"
    # Save every arm's final drafter in OUT/drafters/<arm>-seed<S> (the DFlash format), so `opd gap` and `opd eval`
    # can take it apart afterwards; off by default, as each is a full drafter.
    keep_drafters: bool = False
    arms: list[ArmSpec] = Field(min_length=2)


def load_reproduce_spec(path: str | Path, overrides: list[str] | None = None) -> ReproduceSpec:
    """Read and check a reproduce spec; `overrides` are top-level `key=value` pairs (e.g. seeds=[0])."""
    path = Path(path)
    if not path.is_file():
        raise OpdError(f"{path}: no such reproduce spec (expected a YAML file like configs/reproduce/tiny.yaml)")
    try:
        data = yaml.safe_load(path.read_text()) or {}
        for item in overrides or []:
            key, sep, value = item.partition("=")
            if not sep:
                raise OpdError(f"--set {item}: expected KEY=VALUE")
            data[key.strip()] = yaml.safe_load(value)
        spec = ReproduceSpec.model_validate(data)
    except yaml.YAMLError as exc:
        raise OpdError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    except ValidationError as exc:
        raise OpdError(f"{path}: {_reproduce_error(exc.errors()[0])}") from None
    if "heldout" in spec.families:
        raise OpdError(f"{path}: families: 'heldout' is the experiment's data.eval_prompts (expected other names)")
    missing = [f"{name}: {file}" for name, file in spec.families.items() if not Path(file).exists()]
    if missing:
        raise OpdError(f"{path}: families: {missing[0]} does not exist (expected a prompts jsonl or a built suite "
                       "directory)")
    names = [a.name for a in spec.arms]
    if BUDGET_ARM not in names or len(set(names)) != len(names):
        raise OpdError(f"{path}: arms: expected unique names including {BUDGET_ARM!r} (it sets the FLOP budget)")
    return spec



def _reproduce_error(err: Any) -> str:
    """One pydantic error of a reproduce spec as `field: what is expected`; a key of the experiment's own (e.g.
    `--set optim.lr=...`) is pointed to `set:`, where the experiment's fields go."""
    where = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden" and len(err["loc"]) == 1 and (
            close := difflib.get_close_matches(where, list(ReproduceSpec.model_fields), n=1)):
        return f"{where}: not a field of a reproduce spec (did you mean {close[0]}?)"
    if err["type"] == "extra_forbidden":
        known = ", ".join(ReproduceSpec.model_fields)
        return (f"{where}: not a field of a reproduce spec (its fields: {known}); an experiment field goes in its "
                f"set: list, e.g. set: [{where}=VALUE] (--set set=[...] replaces the file's list)")
    return f"{where}: {err['msg']}"


@dataclass
class ArmJob:
    arm: ArmSpec
    seed: int
    experiment: str
    overrides: list[str]
    run_dir: str
    opd_steps: int
    eval_points: int
    eval_prompts: int
    marks: list[float] | None = None  # FLOPs at which to measure τ; the last is the budget (None: set it)
    sft_data: str | None = None
    families: dict[str, str] = field(default_factory=dict)
    samples_path: str | None = None  # the seed's shared sample file (None: the arm decodes its own rollouts)
    eval_samples_dir: str | None = None  # where each seed's held-out samples are stored (None: decode evals)
    drafter_dir: str | None = None  # where to save the final drafter (None: not saved)


@dataclass
class ArmResult:
    arm: str
    seed: int
    steps: int
    flops: dict[str, float]
    curve: list[tuple[float, float]]  # (FLOPs spent, held-out greedy τ), the warm drafter at 0
    final: dict[str, float]  # sampling name -> held-out τ at the end
    first_rejection: dict[str, list[float]] = field(default_factory=dict)  # "first_half"/"second_half"
    initial: dict[str, float] = field(default_factory=dict)  # the warm drafter, every setting (full arm only)
    minutes: float = 0.0
    eval_minutes: float = 0.0  # of which held-out evaluation (drawing samples and target views included)
    # family -> EvalRow dicts (every setting, with the expected-acceptance diagnostic), at the end and, for the
    # full arm, for the warm drafter
    final_rows: dict[str, list[dict]] = field(default_factory=dict)
    initial_rows: dict[str, list[dict]] = field(default_factory=dict)
    # rule -> per training step, the expected τ of that rule on the step's rollout states (opd arms)
    rollout_expected: dict[str, list[float]] = field(default_factory=dict)

