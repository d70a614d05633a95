"""What a run reports: its MLflow run and directory (`tracking`) and the held-out τ it measures (`eval`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from opd.formats.section import Section, spec_issues
from opd.spec.sampling import SamplingSpec


class TrackingSpec(Section):
    """MLflow run and run-directory layout."""

    uri: str | None = Field(None, description="None = $OPD_TRACKING_URI, else sqlite:///<run_dir>/mlflow.db")
    experiment: str = "draft-opd"
    run_dir: str = Field("runs/{name}", description=(
        "{name} = the spec's name. A relative path is resolved in the driver's working directory and handed to "
        "every actor as that absolute path; on a multi-node cluster it must be absolute, on storage every node "
        "mounts."))
    checkpoint_every: int = Field(100, ge=1)
    keep_last: int | None = Field(None, ge=1, description=(
        "keep the newest N checkpoints (None: all); GBs each at Qwen3 sizes"))
    log_every: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> TrackingSpec:
        try:
            self.run_dir.format(name="x")
        except (KeyError, IndexError, ValueError):
            spec_issues([f"run_dir: {self.run_dir!r} has a bad placeholder (expected only {{name}})"])
        return self


class EvalSpec(Section):
    """Periodic held-out τ measurement (speculative decoding against the target)."""

    every: int = Field(100, ge=0, description="optimizer steps between evals; 0 = only before and after training")
    num_prompts: int = Field(32, ge=1)
    max_new_tokens: int = Field(128, ge=1)
    batch_size: int = Field(8, ge=1)
    collapse_ratio: float | None = Field(None, gt=0, le=1, description=(
        "τ-collapse alarm: held-out τ (first sampling setting) below collapse_ratio x the best so far is logged as "
        "`tau_collapse` and, with stop_on_collapse, stops the run (a bad weight sync must not go unnoticed)."))
    stop_on_collapse: bool = False
    samples_path: str | None = Field(None, description=(
        "Stored target samples of the held-out prompts (`opd gen-samples --eval`): periodic and before/after evals "
        "then rebuild each point-mass setting's blocks on them instead of decoding (opd/eval/offline.py), the same "
        "τ in distribution at a fraction of the cost; `draft: sample` settings and the speedup still decode."))
    offline: bool = Field(True, description=(
        "opd train / opd run without samples_path: first store the warm drafter's decodes of the held-out prompts "
        "in RUN_DIR/eval_samples.jsonl (once; its τ is then exact) and evaluate offline on them. false: always "
        "decode."))
    speedup_prompts: int = Field(32, ge=1, description=(
        "offline: prompts still decoded for the before/after speedup column"))
    diagnostic: bool = Field(True, description=(
        "The periodic eval's expected-acceptance diagnostic (every rule on every setting's states, "
        "`eval_expected_*` in MLflow): a packed target replay per batch, several times the cost of the offline τ "
        "itself. `opd eval` always gives it."))
    suite: str | None = Field(None, description=(
        "A built benchmark suite (the directory `opd suite build --out DIR` wrote): `opd run` ends with its table "
        "in the paper's layout, the warm and the trained drafter beside the ceiling at every point-mass setting, "
        "with max new tokens per benchmark and thinking mode from the suite's card (opd/eval/suite.py). None: no "
        "suite."))
    sampling: list[SamplingSpec] = Field(
        default_factory=lambda: [SamplingSpec(name="greedy", temperature=0.0),
                                 SamplingSpec(name="sampled", temperature=0.6, top_p=0.95, top_k=20)],
        min_length=1)

    @model_validator(mode="after")
    def _check(self) -> EvalSpec:
        names = [s.name for s in self.sampling]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            spec_issues([f"sampling: name {dupes[0]!r} is used twice (expected unique names; they key the metrics)"])
        return self
