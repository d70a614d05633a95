"""The experiment spec: one validated pydantic tree for everything a run needs.

A bad spec must fail in `opd validate` (or the first second of `opd train`), never hours into a cluster job,
so every field is typed and bounded, unknown keys are rejected, and the cross-field rules that would otherwise
surface late (layer ids beyond the target, roles that can never be scheduled, batches that do not divide) are
checked up front. Defaults are the Draft-OPD paper's settings (16-token blocks, 5 drafter layers, mixed KL with
γ = 0.8, lr 3e-4 with cosine decay).

The sections are by role: what a run reads (`inputs`), the target's sampling settings (`sampling`), its rollout
(`rollout`), what training does with it (`training`), where its actors run (`roles`, `resources`, with the
placement arithmetic in `placement`) and what it reports (`reporting`); the rules between sections are `rules`.
Validation here reads no file: what the files say (the target's depth, the prompt pool's size, the warm drafter)
is filled in or checked once, in the driver, by `opd.spec.resolve`, so an actor validates the resolved spec it is
handed without touching the filesystem. Loading YAML is `opd.spec.load`; flattening for MLflow `opd.spec.mlflow_params`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, model_validator

from opd.formats.section import Section, spec_issues
from opd.spec.inputs import DataSpec, ModelsSpec
from opd.spec.reporting import EvalSpec, TrackingSpec
from opd.spec.resources import ResourcesSpec
from opd.spec.rollout import RolloutSpec
from opd.spec.rules import experiment_issues
from opd.spec.sampling import ServingSpec
from opd.spec.training import LossSpec, OptimSpec, ReplaySpec, SftSpec


class ExperimentSpec(Section):
    """Everything one Draft-OPD experiment needs; the single source of truth passed to every actor.

    A step is one optimizer update, everywhere: the progress bar, checkpoint names (step-0000050), MLflow's step
    axis, `eval.every`, `tracking.checkpoint_every` and the learning-rate schedule count updates. An update trains
    on `batches_per_step` whole rollout batches (the paper's "~5.3K steps" are the authors' rollout batches:
    533 updates of 10). The run's length is given once, as `steps` (updates), `rollout_batches` or `epochs` over
    the prompt pool, and the other two are rounded up to whole updates; `steps` is then filled in, so a resolved
    spec that states both agrees with itself."""

    name: str = "experiment"
    seed: int = 0
    engine: Literal["local", "ray"] = "ray"
    steps: int | None = Field(None, gt=0, description="optimizer updates")
    rollout_batches: int | None = Field(None, gt=0, description="or rollout batches, rounded up to whole updates")
    epochs: float | None = Field(None, gt=0, description=(
        "or passes over data.train_pool_size prompts, rounded up likewise"))
    models: ModelsSpec
    data: DataSpec
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    replay: ReplaySpec = Field(default_factory=ReplaySpec)
    loss: LossSpec = Field(default_factory=LossSpec)
    sft: SftSpec = Field(default_factory=SftSpec)
    optim: OptimSpec = Field(default_factory=OptimSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    serving: ServingSpec | None = Field(None, description=(
        "The setting the drafter will be served in (None: no serving mode named, the paper's recipe)."))

    @model_validator(mode="after")
    def _check(self) -> ExperimentSpec:
        """The rules between sections (`opd.spec.rules`), which also fill in `steps` and the rollout's setting."""
        spec_issues(experiment_issues(self))
        return self

    @property
    def total_steps(self) -> int:
        """`steps` as the validator leaves it, always filled (from `rollout_batches` or `epochs` when not given),
        typed so: the field itself stays optional for the spec a user writes."""
        assert self.steps is not None  # the validator fills it or refuses the spec
        return self.steps

    @property
    def batches_per_step(self) -> int:
        """Rollout batches per optimizer step (the validator keeps `optim.batch_size` a multiple of
        `rollout.batch_size`): step s trains on batch indices s * batches_per_step .. (s + 1) * batches_per_step - 1."""
        return self.optim.batch_size // self.rollout.batch_size

    @property
    def run_dir(self) -> Path:
        """This run's directory (checkpoints, MLflow store, resolved spec)."""
        return Path(self.tracking.run_dir.format(name=self.name))

    @property
    def tracking_uri(self) -> str:
        """MLflow tracking URI: the spec's, else OPD_TRACKING_URI (a cluster's pods name its server there), else a
        sqlite store inside the run directory. Not MLflow's own MLFLOW_TRACKING_URI: `mlflow.set_tracking_uri`
        rewrites that one for the whole process, which would silently move every later spec's store."""
        return (self.tracking.uri or os.environ.get("OPD_TRACKING_URI")
                or f"sqlite:///{(self.run_dir / 'mlflow.db').resolve()}")

    def to_yaml(self) -> str:
        """The fully resolved spec as YAML; loading it back gives an equal spec."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def with_eval_samples(spec: ExperimentSpec, path: str | Path) -> ExperimentSpec:
    """`spec` evaluating offline on the held-out target samples in `path` (opd/eval/offline.py)."""
    return spec.model_copy(update={"eval": spec.eval.model_copy(update={"samples_path": str(path)})})
