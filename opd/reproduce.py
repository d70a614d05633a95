"""`opd reproduce`: the paper's central claims in miniature, every arm at matched training FLOPs over seeds.

The full Draft-OPD arm runs `opd_steps` optimizer steps and sets, per seed, the FLOP budget (rollout + teacher
replay + drafter training, `opd/train/flops.py`). Every other arm — continued SFT and the ablations — starts
from the same warm drafter and trains until it has spent that budget, with held-out greedy τ measured whenever
it crosses the marks where the full arm was measured, so the curves share their x-axis. Arms run in a pool of
worker processes; each finished (arm, seed) is saved, so a killed reproduction resumes where it stopped.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from opd.data import eval_prompts, train_prompts
from opd.errors import OpdError
from opd.eval import evaluate
from opd.models.build import Models, build_models
from opd.progress import progress_bar
from opd.spec import ExperimentSpec, SamplingSpec, load_spec
from opd.train.flops import FlopCounter
from opd.train.local import LocalTrainer
from opd.train.sft import SftExample, generate_responses, train_sft

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
    sft_data: str | None = None  # the warm drafter's SFT data (jsonl); None: regenerate it with the spec's sft:
    workers: int = Field(2, ge=1)
    out_dir: str = "runs/reproduce"
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
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise OpdError(f"{path}: {where}: {err['msg']}") from None
    names = [a.name for a in spec.arms]
    if BUDGET_ARM not in names or len(set(names)) != len(names):
        raise OpdError(f"{path}: arms: expected unique names including {BUDGET_ARM!r} (it sets the FLOP budget)")
    return spec


# ---------------------------------------------------------------------------------------------------- jobs


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


class _Evaluator:
    """Held-out τ of the drafter being trained (greedy for the curve, every setting at the end)."""

    def __init__(self, spec: ExperimentSpec, models: Models, num_prompts: int) -> None:
        self.spec, self.models = spec, models
        self.prompts = eval_prompts(spec.data, models.tokenizer, num_prompts)

    def __call__(self, drafter, samplings: list[SamplingSpec] | None = None) -> dict[str, float]:
        was_training = drafter.training
        drafter.eval()
        e = self.spec.eval
        rows = evaluate(Models(self.models.target, drafter, self.models.tokenizer), self.prompts,
                        samplings or [SamplingSpec(name="greedy")], max_new_tokens=e.max_new_tokens,
                        batch_size=e.batch_size, seed=self.spec.seed, baseline=False)
        drafter.train(was_training)
        return {r.sampling: r.tau for r in rows}


def arm_spec(job: ArmJob, steps: int) -> ExperimentSpec:
    sets = [*job.overrides, *job.arm.set, f"seed={job.seed}", "engine=local", f"steps={steps}", "eval.every=0",
            f"tracking.run_dir={job.run_dir}", f"tracking.checkpoint_every={steps + 1}"]
    return load_spec(job.experiment, sets)


def run_arm(job: ArmJob) -> ArmResult:
    """One (arm, seed) from the warm drafter to the budget; runs in a worker process."""
    torch.set_num_threads(1)
    os.environ["OPD_PROGRESS"] = "0"
    started = time.perf_counter()
    result = _run_sft_arm(job) if job.arm.kind == "sft" else _run_opd_arm(job)
    result.minutes = (time.perf_counter() - started) / 60
    return result


def _run_opd_arm(job: ArmJob) -> ArmResult:
    budget_setter = job.marks is None
    # Room past the full arm's step count for cheaper arms; the warmup stays as many steps as the full arm's.
    cap = 4 * job.opd_steps
    spec = arm_spec(job, cap)
    spec.optim.warmup_ratio *= job.opd_steps / cap
    trainer = LocalTrainer(spec, track=False)
    session = trainer.session
    trainer.start()
    evaluator = _Evaluator(spec, session.models, job.eval_prompts)
    initial = evaluator(session.drafter, spec.eval.sampling if budget_setter else None)
    curve = [(0.0, initial["greedy"])]
    mark_steps = {round(job.opd_steps * (i + 1) / job.eval_points) for i in range(job.eval_points)}
    marks = list(job.marks or [])
    records_by_step = []
    while True:
        report = trainer.train_step()
        records_by_step.append(report.metrics)
        spent = session.flops.total
        if budget_setter and session.step in mark_steps or marks and spent >= marks[0]:
            curve.append((spent, evaluator(session.drafter)["greedy"]))
            marks = marks[1:]
        if (budget_setter and session.step >= job.opd_steps) or (not budget_setter and not marks) or \
                session.step >= cap:
            break
    final = evaluator(session.drafter, spec.eval.sampling)
    return ArmResult(job.arm.name, job.seed, session.step, session.flops.as_dict(), curve, final,
                     _first_rejection_halves(records_by_step, session.drafter.block_size),
                     initial if budget_setter else {})


def _first_rejection_halves(metrics: list[dict[str, float]], block_size: int) -> dict[str, list[float]]:
    """Table 10: the rollout's first-rejected-position distribution, averaged over each half of training."""
    keys = [f"first_reject_{k}" for k in range(1, block_size)] + ["first_reject_full_accept"]
    half = len(metrics) // 2
    out = {}
    for name, part in (("first_half", metrics[:half]), ("second_half", metrics[half:])):
        out[name] = [sum(m[k] for m in part) / max(1, len(part)) for k in keys]
    return out


def _run_sft_arm(job: ArmJob) -> ArmResult:
    assert job.marks is not None and job.sft_data is not None
    spec = arm_spec(job, job.opd_steps)
    spec.sft.max_flops = job.marks[-1]
    models = build_models(spec)
    examples = [SftExample(d["prompt_ids"], d["response_ids"])
                for d in map(json.loads, Path(job.sft_data).read_text().splitlines())]
    evaluator = _Evaluator(spec, models, job.eval_prompts)
    curve = [(0.0, evaluator(models.drafter)["greedy"])]
    marks = list(job.marks)
    steps = 0

    def on_step(flops: FlopCounter) -> None:
        nonlocal marks, steps
        steps += 1
        if marks and flops.total >= marks[0]:
            curve.append((flops.total, evaluator(models.drafter)["greedy"]))
            marks = marks[1:]

    flops = train_sft(spec, models, examples, on_step=on_step)
    if marks:
        raise OpdError(f"arm {job.arm.name}: SFT data ran out before the FLOP budget; raise sft.epochs")
    final = evaluator(models.drafter, spec.eval.sampling)
    return ArmResult(job.arm.name, job.seed, steps, flops.as_dict(), curve, final)


# --------------------------------------------------------------------------------------------- the driver


def _marks(result: ArmResult) -> list[float]:
    return [x for x, _ in result.curve[1:]]


def _sft_data(spec: ReproduceSpec, out: Path) -> str:
    """The continued-SFT arm's data: the warm drafter's own SFT data, shipped or regenerated once and cached."""
    if spec.sft_data:
        if not Path(spec.sft_data).is_file():
            raise OpdError(f"sft_data: {spec.sft_data} does not exist (expected the warm drafter's SFT jsonl)")
        return spec.sft_data
    experiment = load_spec(spec.experiment, spec.set)
    path = out / "sft_data.jsonl"
    models = build_models(experiment)
    generate_responses(experiment, models, train_prompts(experiment.data, models.tokenizer), path)
    return str(path)


def track(job: ArmJob, result: ArmResult, out: Path) -> None:
    """One MLflow run per (arm, seed) in OUT/mlflow.db, experiment "reproduce": the arm's resolved spec as
    params, held-out τ at each FLOP mark (step = mark index) and the final τ. Only this process writes."""
    from opd.tracking import Tracker

    experiment = load_spec(job.experiment, [*job.overrides, *job.arm.set, f"seed={job.seed}",
                                            f"name={job.arm.name}-seed{job.seed}", f"tracking.run_dir={out}",
                                            "tracking.experiment=reproduce"])
    tracker = Tracker(experiment)
    for i, (flops, tau) in enumerate(result.curve):
        tracker.log({"heldout_tau_greedy": tau, "flops_total": flops}, i)
    tracker.log({**{f"final_tau_{k}": v for k, v in result.final.items()}, "steps": result.steps,
                 "minutes": result.minutes}, len(result.curve) - 1)
    tracker.close()


def run_jobs(spec: ReproduceSpec, out: Path) -> list[ArmResult]:
    """The full arm per seed first; each finished budget releases that seed's other arms to the pool."""
    saved = out / "arms"
    saved.mkdir(parents=True, exist_ok=True)
    sft_data = _sft_data(spec, out) if any(a.kind == "sft" for a in spec.arms) else None
    budget_arm = next(a for a in spec.arms if a.name == BUDGET_ARM)

    def job(arm: ArmSpec, seed: int, marks: list[float] | None) -> ArmJob:
        return ArmJob(arm, seed, spec.experiment, spec.set, str(out / "work" / f"{arm.name}-seed{seed}"),
                      spec.opd_steps, spec.eval_points, spec.eval_prompts, marks, sft_data)

    def done(arm: str, seed: int) -> ArmResult | None:
        path = saved / f"{arm}-seed{seed}.json"
        return ArmResult(**json.loads(path.read_text())) if path.exists() else None

    results: list[ArmResult] = []
    total = len(spec.arms) * len(spec.seeds)
    with progress_bar() as bar, ProcessPoolExecutor(spec.workers, mp_context=get_context("spawn")) as pool:
        task = bar.add_task("reproduce (arm × seed)", total=total)
        pending: dict[Future, ArmJob] = {}

        def finish(result: ArmResult) -> None:
            results.append(result)
            bar.advance(task)
            if result.arm == BUDGET_ARM:
                for arm in spec.arms:
                    if arm.name != BUDGET_ARM:
                        submit(job(arm, result.seed, _marks(result)))

        def submit(j: ArmJob) -> None:
            if (previous := done(j.arm.name, j.seed)) is not None:
                finish(previous)
            else:
                pending[pool.submit(run_arm, j)] = j

        for seed in spec.seeds:
            submit(job(budget_arm, seed, None))
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                finished_job, result = pending.pop(future), future.result()
                (saved / f"{result.arm}-seed{result.seed}.json").write_text(json.dumps(asdict(result)) + "\n")
                track(finished_job, result, out)
                finish(result)
    return results


def run_reproduce(path: str, overrides: list[str] | None = None) -> int:
    from opd.paper_report import write_report

    spec = load_reproduce_spec(path, overrides)
    load_spec(spec.experiment, spec.set)  # refuse a bad experiment before any compute
    out = Path(spec.out_dir)
    started = time.perf_counter()
    results = run_jobs(spec, out)
    minutes = (time.perf_counter() - started) / 60
    report = write_report(spec, results, out, minutes)
    print(report.read_text())
    print(f"Done in {minutes:.1f} min: {report}, plots and per-arm JSON in {out}; one MLflow run per arm and "
          f"seed: mlflow ui --backend-store-uri sqlite:///{(out / 'mlflow.db').resolve()}")
    return 0
