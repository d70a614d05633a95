"""The `opd reproduce` driver: every (arm, seed) in a pool of worker processes, resumable from saved results."""

from __future__ import annotations

import json
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path

from opd.data.prompts import train_prompts
from opd.errors import OpdError
from opd.models.build import build_models
from opd.outputs import write_text_atomic
from opd.progress import progress_bar
from opd.reproduce.arms import run_arm, shares_samples
from opd.reproduce.spec import BUDGET_ARM, ArmJob, ArmResult, ArmSpec, ReproduceSpec
from opd.sources.samplers import build_sampler
from opd.spec import load_spec
from opd.train.sft_data import sft_examples, sft_store


def _marks(result: ArmResult) -> list[float]:
    return [x for x, _ in result.curve[1:]]


def _sft_data(spec: ReproduceSpec, out: Path) -> str:
    """The continued-SFT arm's data: the warm drafter's own SFT data, shipped or regenerated once and cached."""
    if spec.sft_data:
        if not Path(spec.sft_data).is_file():
            raise OpdError(f"sft_data: {spec.sft_data} does not exist (expected the warm drafter's SFT data, as "
                           "`opd gen-samples CONFIG --sft` writes it)")
        return spec.sft_data
    experiment = load_spec(spec.experiment, spec.set)
    path = out / "sft_data.jsonl"
    models = build_models(experiment)
    prompts = train_prompts(experiment.data, models.tokenizer)
    sampler = build_sampler(experiment, "autoregressive", models.target, None, models.eos_id)
    sft_examples(experiment, sft_store(experiment, prompts, path, field="sft_data"), prompts, sampler)
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
    families = {f"final_tau_{family}_{row['sampling']}": row["tau"]
                for family, rows in result.final_rows.items() for row in rows}
    tracker.log({**{f"final_tau_{k}": v for k, v in result.final.items()}, **families, "steps": result.steps,
                 "minutes": result.minutes}, len(result.curve) - 1)
    tracker.close()


def run_jobs(spec: ReproduceSpec, out: Path) -> list[ArmResult]:
    """The full arm per seed first; each finished budget releases that seed's other arms to the pool."""
    saved = out / "arms"
    saved.mkdir(parents=True, exist_ok=True)
    (out / "samples").mkdir(exist_ok=True)
    sft_data = _sft_data(spec, out) if any(a.kind == "sft" for a in spec.arms) else None
    budget_arm = next(a for a in spec.arms if a.name == BUDGET_ARM)

    sharing = {a.name for a in spec.arms if spec.share_samples and shares_samples(spec.experiment, spec.set, a)}

    def job(arm: ArmSpec, seed: int, marks: list[float] | None) -> ArmJob:
        samples = str(out / "samples" / f"seed{seed}.jsonl") if arm.name in sharing else None
        return ArmJob(arm, seed, spec.experiment, spec.set, str(out / "work" / f"{arm.name}-seed{seed}"),
                      spec.opd_steps, spec.eval_points, spec.eval_prompts, marks, sft_data, spec.families, samples,
                      str(out / "eval_samples") if spec.offline_eval else None,
                      str(out / "drafters" / f"{arm.name}-seed{seed}") if spec.keep_drafters else None)

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
                write_text_atomic(saved / f"{result.arm}-seed{result.seed}.json", json.dumps(asdict(result)) + "\n")
                track(finished_job, result, out)
                finish(result)
    return results

